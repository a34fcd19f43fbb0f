"""The app behind HAProxy with direct ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``), the HTTP path
docs/tuning.md offers instead of Serve's proxy actor: streamed speech with its Server-Timing
header, a voice upload and a WebSocket session work through it. Its own Ray cluster, in a
subprocess (tests/integration/haproxy_app.py): the flag must be set before Ray starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve_app.stage_timing import NOT_STAGES, STAGES, parse_server_timing
from tests.integration.test_openai_contract_ray import _samples

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
GUARD_S = 600  # a cluster that never answers fails the test instead of hanging it


@pytest.mark.slow  # ~27 s: a Ray cluster of its own in a subprocess (an optional HTTP path, docs/tuning.md)
def test_speech_voices_and_websocket_work_behind_haproxy():
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.haproxy_app"], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=GUARD_S)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["register"] == 201
    speech = out["speech"]
    assert speech["status"] == 200
    assert speech["bytes"] == 2 * _samples("Hello there.")
    assert list(parse_server_timing(speech["server_timing"])) == list(STAGES + NOT_STAGES)
    assert out["websocket_bytes"] == 2 * _samples("Spoken through HAProxy.")
