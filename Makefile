# Two entry points on a fresh machine: `make serve` and `make test` (see README).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
# Every version installed anywhere (this venv, hence CI; the Docker image; cluster.yaml's nodes) is
# pinned here, as pip constraints (-c): it pins what is installed without installing what is not
# asked for (the CUDA libraries of the GPU torch on a CPU machine).
LOCK := requirements.lock
TORCH := 2.13.0
LOCK_VENV := $(VENV)/lock-tools

.PHONY: install debs serve test test-slow test-gpu soak lock

$(STAMP): pyproject.toml $(LOCK)
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -U pip
	# torch first: the CPU wheel (a bare `torch` requirement would pull a CUDA build of several GB)
	$(VENV)/bin/pip install -q -c $(LOCK) torch==$(TORCH)
	$(VENV)/bin/pip install -q -c $(LOCK) -e '.[dev]'
	touch $(STAMP)

# Re-resolve requirements.lock after changing a dependency in pyproject.toml (needs PyPI): one
# universal lock, Python 3.11 (CI, the Ray image of cluster.yaml) and 3.12 (the Docker image),
# with torch held at $(TORCH), runtime + dev + trt. --fork-strategy fewest: one version of each
# package for both Pythons, so the image runs what CI tested. uv runs from a throwaway venv.
lock:
	$(PY) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q uv==0.13.9
	echo "torch==$(TORCH)" > $(LOCK_VENV)/torch.txt
	$(LOCK_VENV)/bin/uv pip compile pyproject.toml --extra dev --extra trt --universal --python-version 3.11 \
		--fork-strategy fewest -c $(LOCK_VENV)/torch.txt --custom-compile-command "make lock" -o $(LOCK)

install: $(STAMP) debs

# Two tests drive Debian programs: the playground's browser test (chromium + chromedriver, no
# browser download at run time) and the TLS edge test (haproxy + openssl, tests/test_tls_edge.py).
# Installed here when missing and apt-get can (root); else those tests skip.
DEBS_NEEDED = $(strip $(if $(wildcard /usr/bin/chromium),,chromium) $(if $(wildcard /usr/bin/chromedriver),,chromium-driver) \
	$(if $(wildcard /usr/sbin/haproxy),,haproxy) $(if $(wildcard /usr/bin/openssl),,openssl))
debs:
	@if [ -z "$(DEBS_NEEDED)" ]; then :; \
	elif command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(DEBS_NEEDED); } \
		|| echo "note: installing $(DEBS_NEEDED) failed: the browser / TLS edge tests will be skipped"; \
	else echo "note: $(DEBS_NEEDED) missing: the browser / TLS edge tests will be skipped" \
		"(apt-get install $(DEBS_NEEDED))"; fi

serve: $(STAMP)
	$(VENV)/bin/fastcosy serve --config configs/local.yaml

test: $(STAMP) debs
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
