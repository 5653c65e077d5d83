# The API suite: schemathesis against a live toy sampler (tests/api). Included by the
# Makefile; schemathesis comes with the [dev] extra of the core environment.

SUITES += test-api

.PHONY: test-api

test-api: venv
	$(BIN)/python -m pytest tests/api -m api -q
