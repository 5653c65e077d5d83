# The verl test environment (.venv-verl). Included by the Makefile.
#
# On CPU-only machines the CPU torch build is installed first so resolving verl's torch
# requirement keeps it (pip finds the local torch==2.13.0+cpu wheel); GPU hosts let verl
# bring its CUDA torch. verl[verl-core]==0.9.1 pins transformers>=5.5.3,<5.11, which the
# project's range admits. The project is then installed on top (with the [server] extra:
# the suite starts toy samplers) with verl's torch, transformers and verl held by a
# constraints file (install_project_holding in the Makefile), and
# the last step fails the build if torch is not the CPU build there. Rebuilt when
# pyproject.toml or this file changes; a no-op otherwise.
VERL_VENV := .venv-verl
VERL_BIN := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.installed
VERL_PKG ?= verl[verl-core]==0.9.1

SUITES += test-verl

.PHONY: venv-verl test-verl

venv-verl: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml make/verl.mk
	$(PYTHON) -m venv $(VERL_VENV)
	$(if $(HAS_GPU),,$(VERL_BIN)/pip install --progress-bar off $(CPU_TORCH))
	$(VERL_BIN)/pip install --progress-bar off '$(VERL_PKG)'
	$(call install_project_holding,$(VERL_VENV),torch|transformers|verl|ray|numpy,verl)

# CPU: real verl 0.9.1 (no mocks), two toy samplers as subprocesses and a 2-CPU local Ray
# for TransferQueue; about 1.5 minutes on two cores (building .venv-verl: 4-6 minutes).
# The full verl training run needs a GPU: deploy/gpu_checks/run.sh (make/gpu_bundle.mk).
test-verl: venv-verl
	HF_HUB_OFFLINE=1 $(VERL_BIN)/python -m pytest tests/verl_integration -m verl -q -rs
