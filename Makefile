# Every target does its own set-up, idempotently: a fresh clone needs only `make test`
# or `make demo`. Environments are rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# On a machine without a CUDA GPU, install the CPU torch build first so resolving the
# project's torch range does not pull a multi-GB CUDA build (DESIGN.md section 11).
CPU_TORCH := torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1

# Suites: make/*.mk add their own environments and append their test targets here.
SUITES := test-core

.PHONY: venv test test-core lint demo clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(HAS_GPU),,$(BIN)/pip install --progress-bar off $(CPU_TORCH))
	$(BIN)/pip install --progress-bar off -e '.[dev]'
	touch $@

include $(wildcard make/*.mk)

test: $(SUITES)

test-core: venv
	$(BIN)/python -m pytest tests -m "not vllm and not verl and not gpu" -q

lint: venv
	$(BIN)/ruff check strategies sampler_service trainer_client tests bench

demo: venv
	$(BIN)/adaptive-rollout demo

clean:
	rm -rf $(VENV) .venv-vllm .venv-verl demo_out .pytest_cache .hypothesis
