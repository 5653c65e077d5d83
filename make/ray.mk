# The Ray scale-out suite (tests/ray): engine replicas as Ray actors behind one sampler.
# Included by the Makefile. Ray comes with the core environment (`make venv` installs the
# `[ray]` extra). The tests start their own small Ray clusters (no dashboard, 256-512 MiB
# object store, usage statistics off) and hf replicas on the toy model.
SUITES += test-ray

.PHONY: test-ray

test-ray: venv
	$(BIN)/python -m pytest tests/ray -m ray -q -rs
