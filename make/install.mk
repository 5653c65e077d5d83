# The core install (`pip install .`, no extra) in a fresh venv, against a live toy sampler
# from the core environment (tests/install). Included by the Makefile. Needs the package
# index or pip's cache for the core dependencies; about a minute on two cores.
SUITES += test-install

.PHONY: test-install

test-install: venv
	$(BIN)/python -m pytest tests/install -m install -q -rs
