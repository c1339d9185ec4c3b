# One command to set up and run the demo; one to set up and run the tests.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo lint test unit integration bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# as root the demo's machines get network namespaces of their own (--isolate-network), as the
# network faults need; otherwise they share the host's network
demo: setup
	$(BIN)/stalwart run --state-dir .stalwart/demo --fresh --machines 4 --gpus-per-machine 2 \
	    $(if $(filter 0,$(shell id -u)),--isolate-network) \
	    --tp 2 --pp 2 --dp 2 --steps 200 --standby 1 --ckpt-every 10 \
	    --chaos "crash@step=60,machine=1" --chaos "gpu-xid@step=120,machine=2" \
	    -- python -m stalwart.examples.gpt --log-every 20
	$(BIN)/stalwart report --state-dir .stalwart/demo

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

test: setup lint
	$(BIN)/python -m pytest -q -rs --durations=25 tests

unit: setup
	$(BIN)/python -m pytest -q tests/unit

integration: setup
	$(BIN)/python -m pytest -q tests/integration

clean:
	rm -rf $(VENV) .stalwart build src/*.egg-info
