# The dashboard in a real headless browser. Included by the Makefile.
#
# Debian's chromium (installed with apt-get when missing; CI runs as root), driven from
# pytest by Playwright's Python package with executable_path, so no browser is downloaded.
# Playwright comes from the project's [browser] extra, installed into the core venv.
CHROMIUM ?= /usr/bin/chromium
BROWSER_STAMP := $(VENV)/.browser-installed
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

SUITES += test-browser

.PHONY: browser-deps test-browser

$(BROWSER_STAMP): $(STAMP) pyproject.toml make/browser.mk
	$(BIN)/pip install --progress-bar off -e '.[dev,browser]'
	touch $@

browser-deps:
	@test -x $(CHROMIUM) || { $(SUDO) apt-get update && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y chromium; }

# One toy sampler and one browser; about 1.5 minutes on two cores (installing chromium:
# 1-2 minutes more).
test-browser: $(BROWSER_STAMP) browser-deps
	CHROMIUM=$(CHROMIUM) $(BIN)/python -m pytest tests/browser -m browser -q
