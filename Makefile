# Two entry points on a fresh machine: `make serve` and `make test` (see README).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: install browser serve test test-slow test-gpu soak

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	# torch first: the CPU wheel (a bare `torch` requirement would pull a CUDA build of several GB)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) browser

# The playground's browser test drives Debian's chromium through its chromedriver (no browser
# download at run time); installed here when missing and apt-get can (root), else that test skips.
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } \
		|| echo "note: installing chromium failed: the playground browser test will be skipped"; \
	else echo "note: /usr/bin/chromium or chromedriver missing: the playground browser test will be skipped" \
		"(apt-get install chromium chromium-driver)"; fi

serve: $(STAMP)
	$(VENV)/bin/fastcosy serve --config configs/local.yaml

test: $(STAMP) browser
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -q

test-slow: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m slow

test-gpu: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "gpu or trt"

# 2,000 requests against a local CPU service on the tiny model (~90 min on 2 cores); writes
# bench/results/<date>-soak/soak-<date>.{json,md}
soak: $(STAMP)
	$(VENV)/bin/python -m bench.soak --requests 2000 --concurrency 8
