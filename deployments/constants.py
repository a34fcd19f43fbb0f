"""Process-wide constants and the ONLY place that reads environment variables.

Everything configurable per deployment lives in the pydantic configs (``configs/*.yaml``);
environment variables are reserved for machine-level facts (where models are cached, the
execution mode of a node where the config leaves it unset). They are read by functions, never at
import time of a deployment module, so a replica reads them on the node it runs on (house style
§2.2).
"""
from __future__ import annotations

import os
from pathlib import Path

# Header carrying the request id in both directions (accepted from clients when well-formed).
REQUEST_ID_HEADER = "x-request-id"

# Bounds the replica constructor (model load + warmup); a hung load fails the replica.
REPLICA_START_TIMEOUT_S = 600.0

# Replica warmup: a few text ids and a zero prompt run once through every stage.
WARMUP_TEXT_TOKENS = 4

# Histogram boundaries, chosen for TTS latencies / real-time factors / batch sizes.
TTFA_BUCKETS_S = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0]
RTF_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0]
BATCH_SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64]
# Audio seconds served per synthesis call (tts_served_audio_seconds): the voice-agent mix's bounds
# (1-3, 3-8, 8-20 s) are bucket edges, so the served length distribution reads against the drawn one.
SERVED_AUDIO_BUCKETS_S = [0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0, 20.0, 30.0, 60.0, 120.0]
STAGE_BUCKETS_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0]  # first-audio stages
GIL_WAIT_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]  # how late a thread takes the GIL back (thread_load)
GC_PAUSE_BUCKETS_S = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5]  # Python collector pauses (python_gc)

# Ray's system config for every cluster this project starts (head-only: other nodes take it from
# the GCS). An argument or return value over Ray's 100 KiB default goes through the shared-memory
# object store instead of the call itself, and a voice prompt's features (16 KB of mel per second
# of prompt) pass it at 6.4 s of prompt, twice per request (frontend -> ingress -> synthesizer),
# as do audio chunks over ~1 s at 24 kHz: a 10 s prompt's hop took 1.6-1.9 ms against 0.9-1.2
# inline on a quiet 2-core VM, 3-5 against 1-2.5 with its cores busy (2026-12-07,
# bench/results/2026-12-07-cpu-serving-layer-ray-hop). 512 KiB keeps prompts up to 32 s and
# chunks up to 5 s inline.
RAY_SYSTEM_CONFIG = {"max_direct_call_object_size": 512 * 1024}

# Environment variable names (documented in docs/serving.md).
ENV_MODEL_DIR = "FAST_COSY_MODEL_DIR"  # model directory used when the config gives none
ENV_HOME = "FAST_COSY_HOME"  # cache root: generated tiny model, default voice store
ENV_MODE = "FAST_COSY_MODE"  # SynthesizerConfig.mode on this node when the config leaves it unset
ENV_DEVICE = "FAST_COSY_DEVICE"  # overrides SynthesizerConfig.device on this node
ENV_API_KEYS = "FAST_COSY_API_KEYS"  # API keys (comma-separated), for the ingress's auth (serve_app/auth.py)
ENV_CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"  # set per Ray worker; maps local CUDA indices to GPUs
ENV_RAY_AUTH_MODE = "RAY_AUTH_MODE"  # Ray's own: a client sends the cluster token only when it is "token"


def home_dir() -> Path:
    """Cache root (``$FAST_COSY_HOME`` or ``~/.cache/fastcosy``)."""
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".cache" / "fastcosy")


def model_dir_override() -> str | None:
    """``$FAST_COSY_MODEL_DIR`` if set and non-empty."""
    return os.environ.get(ENV_MODEL_DIR) or None


def mode_override() -> str | None:
    """``$FAST_COSY_MODE`` ("pytorch" | "torchscript" | "trt") if set; used only where
    ``SynthesizerConfig.mode`` is None (the config wins, ``cosyvoice_runtime.modes.resolve_mode``)."""
    value = os.environ.get(ENV_MODE) or None
    return value.lower() if value else None


def device_override() -> str | None:
    """``$FAST_COSY_DEVICE`` ("cpu" | "cuda" | "cuda:N") if set."""
    return os.environ.get(ENV_DEVICE) or None


def cuda_visible_devices() -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as set (None when unset: every GPU of the node is visible)."""
    return os.environ.get(ENV_CUDA_VISIBLE_DEVICES)


def api_keys_env() -> str | None:
    """``$FAST_COSY_API_KEYS`` if set and non-empty: ``key`` or ``key:scope+scope`` entries, comma-separated."""
    return os.environ.get(ENV_API_KEYS) or None


def ray_auth_mode() -> str | None:
    """``$RAY_AUTH_MODE`` as set in this process (``fastcosy serve --address`` explains a 401 with it)."""
    return os.environ.get(ENV_RAY_AUTH_MODE) or None


def default_voices_dir() -> Path:
    return home_dir() / "voices"


def default_pronunciation_dir() -> Path:
    return home_dir() / "pronunciation"


def tiny_model_dir(family: str) -> Path:
    return home_dir() / f"tiny-{family}"
