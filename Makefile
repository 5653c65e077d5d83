# Every target does its own set-up, idempotently: a fresh clone needs only `make test`
# or `make demo`. Environments are rebuilt when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# On a machine without a CUDA GPU, install the CPU torch build first so resolving the
# project's torch range does not pull a multi-GB CUDA build.
CPU_TORCH := torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
# The last steps of a suite environment's recipe, for the suites that bring their own torch
# ($1: the environment's folder, $2: the pip names it holds, as a regex alternation, $3:
# the module whose version is printed): the project goes on top with the suite's torch,
# transformers and $3 held by a constraints file, so pip cannot swap that torch for another
# build, and the build fails if torch is not the CPU build on a machine without a GPU.
define install_project_holding
	$1/bin/pip freeze | grep -iE '^($2)==' > $1/held.txt
	$1/bin/pip install --progress-bar off -c $1/held.txt -e '.[dev,server]'
	$1/bin/python -c "import sys, torch, transformers, $3; \
	  print('torch', torch.__version__, 'transformers', transformers.__version__, '$3', $3.__version__); \
	  sys.exit(0 if $(if $(HAS_GPU),True,torch.__version__.endswith('+cpu')) else 'torch is not the CPU build: ' + torch.__version__)"
	touch $@
endef
# Nothing phones home: no hub downloads, no usage statistics from vLLM or Ray.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export VLLM_NO_USAGE_STATS := 1
export RAY_USAGE_STATS_ENABLED := 0
export DO_NOT_TRACK := 1

# Suites: make/*.mk add their own environments and append their test targets here, and
# their pytest marker to SUITE_MARKERS so that test-core leaves their tests out.
SUITES := test-core
SUITE_MARKERS := vllm verl gpu ray browser api deploy gpu_bundle install
empty :=
space := $(empty) $(empty)
CORE_EXPR = not $(subst $(space), and not ,$(strip $(SUITE_MARKERS)))
LINT_PATHS := strategies sampler_service trainer_client tests bench examples

.PHONY: venv test test-core test-unit lint format demo demo-calculator wheel clean

venv: $(STAMP)

# Every part of the project and what its suites need: the sampler, the reference
# trainer, the ops CLI's tables, Ray and the test tools.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(HAS_GPU),,$(BIN)/pip install --progress-bar off $(CPU_TORCH))
	$(BIN)/pip install --progress-bar off -e '.[dev,server,trainer,ops,ray]'
	touch $@

include $(wildcard make/*.mk)

# Every suite runs even when an earlier one fails; each one's wall time is printed at
# the end, and the target fails if any suite did.
test:
	@failed=""; times=""; \
	for suite in $(SUITES); do \
	  start=$$(date +%s); \
	  $(MAKE) --no-print-directory $$suite || failed="$$failed $$suite"; \
	  times="$$times\n  $$suite: $$(( $$(date +%s) - start )) s"; \
	done; \
	printf "suite wall times:$$times\n"; \
	if [ -n "$$failed" ]; then echo "failed suites:$$failed"; exit 1; fi

# Two workers, a test file each at a time (a module's shared server stays in one
# worker): the suite mostly waits on servers, so two workers fit two cores.
CORE_WORKERS ?= 2
test-core: venv
	$(BIN)/python -m pytest tests -m "$(CORE_EXPR)" -q -n $(CORE_WORKERS) --dist loadfile

# The pure suite (no server, no engine): a quick check while editing. It is
# part of test-core too, so `make test` does not list it apart.
test-unit: venv
	$(BIN)/python -m pytest tests/unit -q

lint: venv
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy

format: venv
	$(BIN)/ruff format $(LINT_PATHS)
	$(BIN)/ruff check --fix $(LINT_PATHS)

demo: venv
	$(BIN)/adaptive-rollout demo

# The same loop on multi-turn episodes: the toy calculator tool task.
demo-calculator: venv
	$(BIN)/adaptive-rollout demo --task calculator --out demo_calculator_out

# The package is not on PyPI: this builds the wheel to install elsewhere (the README's
# Install), with any Python that has pip; no environment of ours is needed.
wheel:
	$(PYTHON) -m pip wheel --no-deps --progress-bar off --wheel-dir dist .

clean:
	rm -rf $(VENV) .venv-vllm .venv-verl demo_out demo_calculator_out .pytest_cache .hypothesis \
	  build dist
