# One entry point. Everything runs from the repo's .venv, made by `make setup`.
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup test test-gpu demo lint bench images

setup:
	bash scripts/setup.sh

test:
	$(PY) -m pytest -m "not gpu" tests

# Run on the GPU machine (see tests/gpu/README.md).
test-gpu:
	$(PY) -m pytest -m gpu tests

demo:
	$(VENV)/bin/vllm-hybrid demo

lint:
	$(VENV)/bin/ruff check runtime operator tests scripts bench
	$(VENV)/bin/helm lint charts/hybrid-inference
	$(VENV)/bin/hadolint images/*/Dockerfile

bench:
	bash bench/run.sh

images:
	bash scripts/images.sh
