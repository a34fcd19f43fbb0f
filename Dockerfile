# FastCosyVoice Serve on one NVIDIA GPU node (also the image for KubeRay head/worker pods).
#
#   docker build -t fastcosy:0.1.0 .
#   docker run --gpus all --shm-size=8g -p 8000:8000 -v /srv/models/CosyVoice2-0.5B:/models/model:ro \
#       -v /srv/fastcosy/api_keys:/run/secrets/api_keys:ro fastcosy:0.1.0
#
# The default config (deploy/docker/single-gpu.yaml) requires API keys: the file above, or
# -e FAST_COSY_API_KEYS=... (docs/serving.md, Authentication). /health stays open for the probe.
#
# The torch wheel from PyPI bundles its own CUDA user-space libraries; the host driver must
# support that CUDA version (`docker run ... fastcosy doctor` checks driver, GPU arch and files).
#
# Reproducible builds: every Python package comes from requirements.lock (pip constraints; `make
# lock` regenerates it), and the base image is pinned by digest (CUDA_BASE_DIGEST): the tag is for
# humans, the digest picks the image. No registry is reachable where this repository is built, so
# the digest below is the one public Dockerfiles pin for this tag (the multi-arch index; seven
# independent repositories agreed, read 2026-12-07), not one pulled here: check it where the
# registry is reachable, and move both together:
#   docker buildx imagetools inspect nvidia/cuda:12.8.1-runtime-ubuntu24.04   # "Digest: sha256:..."
#   docker build --build-arg CUDA_BASE_DIGEST=@sha256:<digest> -t fastcosy:0.1.0 .
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG CUDA_BASE_DIGEST=@sha256:ebef3c171eeef0298e4eb2e4be843105edf3b8b0ac45e0b43acee358e8046867
FROM ${CUDA_BASE}${CUDA_BASE_DIGEST}

# = torch in requirements.lock (tests/test_dockerfile.py keeps them equal)
ARG TORCH_VERSION=2.13.0
# "trt" pulls TensorRT (its libraries are fetched from NVIDIA's package index at build time);
# set EXTRAS="" for a PyTorch-only image.
ARG EXTRAS=trt

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    RAY_USAGE_STATS_ENABLED=0 \
    FAST_COSY_HOME=/home/fastcosy/.cache/fastcosy

# Ubuntu's python3 (3.12) in a venv (PEP 668). Versions follow the pinned base image.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "${VIRTUAL_ENV}" \
    && useradd --create-home --uid 1000 --shell /bin/bash fastcosy

WORKDIR /app
COPY requirements.lock ./
# torch first and pinned: the project's own requirement range would otherwise pick a build.
RUN pip install -c requirements.lock "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md ./
COPY cosyvoice_runtime/ cosyvoice_runtime/
COPY deployments/ deployments/
COPY serve_app/ serve_app/
COPY fastcosy_cli/ fastcosy_cli/
# the benchmarks `fastcosy bench` runs; the GPU-rental scripts beside them are .dockerignored
COPY bench/ bench/
# The project itself is pinned by this source tree; its dependencies by requirements.lock.
# hadolint ignore=DL3013
RUN if [ -n "${EXTRAS}" ]; then pip install -c requirements.lock ".[${EXTRAS}]"; \
    else pip install -c requirements.lock .; fi

COPY configs/ configs/
COPY deploy/docker/single-gpu.yaml configs/single-gpu.yaml
RUN mkdir -p /models "${FAST_COSY_HOME}" && chown -R fastcosy:fastcosy /home/fastcosy /app

# numeric, so Kubernetes' runAsNonRoot can verify it
USER 1000:1000
EXPOSE 8000 8265
# /health answers 200 only when every synthesizer replica is ready (503 while loading).
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=8).status != 200)"]
CMD ["fastcosy", "serve", "--config", "configs/single-gpu.yaml", "--host", "0.0.0.0"]
