"""Run by tests/integration/test_haproxy_ingress.py in a process of its own: a Ray cluster
started with ``RAY_SERVE_ENABLE_HA_PROXY=1`` (HAProxy in front, the ingress replica serving HTTP
itself; docs/tuning.md "The HTTP path") with the test app's fake runtimes, then one streamed
OpenAI request, one registered voice and one WebSocket session through it. Prints one JSON line
of what it saw; the test asserts on it."""
from __future__ import annotations

import base64
import json
import os
import sys

os.environ.update({"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                   "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"})  # before Ray starts: it inherits them

import httpx
import ray
from ray import serve
from websockets.sync.client import connect

from serve_app.app import build_app
from serve_app.args import AppArgs
from tests.integration.conftest import TEST_ARGS, _free_port
from tests.integration.test_serve_ray import _prompt_wav
from tests.integration.waiting import wait_for


def main() -> dict:
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2,
             namespace="haproxy-test")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(AppArgs.model_validate(TEST_ARGS)), name="tts", route_prefix="/")
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=10).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "HAProxy routes /health to the ingress replica")
        out = {}
        r = httpx.post(f"{url}/v1/voices", data={"voice_id": "default", "prompt_text": "hello", "overwrite": "true"},
                       files={"audio": ("a.wav", _prompt_wav(), "audio/wav")}, timeout=60)
        out["register"] = r.status_code
        with httpx.stream("POST", f"{url}/v1/audio/speech", timeout=60,
                          json={"model": "tts-1", "input": "Hello there.", "voice": "alloy", "response_format": "pcm"}) as r:
            out["speech"] = {"status": r.status_code, "server_timing": r.headers.get("server-timing", ""),
                             "bytes": len(r.read())}
        ws_url = url.replace("http://", "ws://") + "/v1/text-to-speech/default/stream-input?output_format=pcm_24000&mode=sentence"
        with connect(ws_url, open_timeout=60, close_timeout=10) as ws:
            ws.send(json.dumps({"text": " "}))
            ws.send(json.dumps({"text": "Spoken through HAProxy. "}))
            ws.send(json.dumps({"text": ""}))
            pcm, final = b"", False
            while not final:
                m = json.loads(ws.recv(timeout=60))
                pcm += base64.b64decode(m["audio"]) if m.get("audio") else b""
                final = bool(m.get("isFinal"))
        out["websocket_bytes"] = len(pcm)
        return out
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
    sys.exit(0)
