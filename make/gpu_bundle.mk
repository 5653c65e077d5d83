# The wheel bundle the GPU check carries to a GPU machine without network, and its CPU
# test. Included by the Makefile.
#
#   make gpu-bundle        .gpu-bundle/cp312: the cp312/py3 manylinux wheels of
#                          deploy/gpu_checks/bundle.txt (<= 60 MiB; reruns are no-ops)
#   make test-gpu-bundle   the bundle's checks: size, one version each, cp312 tags
#                          (pip install --dry-run for CPython 3.12), and its cp311 twin
#                          installed over a venv holding only the CPU torch and the GPU
#                          image's packages (deploy/gpu_checks/twin.txt), where the GPU
#                          check's imports and its CPU dry run (deploy/gpu_checks/run.sh
#                          --cpu-dry-run) must work.
GPU_BUNDLE := .gpu-bundle
TWIN_VENV := $(GPU_BUNDLE)/twin
TWIN_STAMP := $(TWIN_VENV)/.installed

SUITES += test-gpu-bundle

.PHONY: gpu-bundle test-gpu-bundle

gpu-bundle: venv
	$(BIN)/python deploy/gpu_checks/bundle.py --out $(GPU_BUNDLE) --python 3.12

$(TWIN_STAMP): deploy/gpu_checks/twin.txt make/gpu_bundle.mk
	rm -rf $(TWIN_VENV)
	$(PYTHON) -m venv $(TWIN_VENV)
	$(TWIN_VENV)/bin/pip install --progress-bar off $(CPU_TORCH)
	$(TWIN_VENV)/bin/pip install --progress-bar off --no-deps -r deploy/gpu_checks/twin.txt
	touch $@

test-gpu-bundle: gpu-bundle $(TWIN_STAMP)
	$(BIN)/python deploy/gpu_checks/bundle.py --out $(GPU_BUNDLE) --python 3.11
	$(BIN)/python -m pytest tests/gpu_bundle -m gpu_bundle -q -rs
