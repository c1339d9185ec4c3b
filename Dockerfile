# The image of a stalwart job on Kubernetes: the controller, the agents and the training workers
# run from it. It holds stalwart (with the Kubernetes client) and torch; the training code goes in
# /app, the job's code_dir (kubernetes.code_dir), in an image built FROM this one:
#
#   docker build -t registry.example.com/stalwart:0.1.0 .
#   # in the training repository:  FROM registry.example.com/stalwart:0.1.0
#   #                              COPY . /app
#
# TORCH picks the torch build (the default, PyPI's, is the CUDA one for GPU nodes; for CPU nodes:
# --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu").
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH="torch==2.13.0"

# iproute2: the agent's NIC probe and network chaos; procps: process listings in diagnostics.
# (Debian's versions move with the base image: pinning them would break every rebuild.)
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 procps \
    && rm -rf /var/lib/apt/lists/*

# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH}

WORKDIR /opt/stalwart
COPY pyproject.toml README.md ./
COPY src ./src
# (stalwart from this source; its dependencies are pinned in pyproject.toml)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[k8s]"

# the job's code (code_dir); the rendered pods start their own commands (stalwart controller,
# python -m stalwart.backends.k8s_agent), so the image has no entry point of its own
WORKDIR /app
ENV PYTHONUNBUFFERED=1
