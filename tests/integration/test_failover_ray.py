"""Failover mid-stream on real local Ray (serve_app/failover.py, docs/serving.md "Failover").

Each family's app runs two synthesizer replicas of the tiny random-weight model behind a hold
(tests/integration/held_runtime.py): a stream with a hold seed makes its first chunk, then waits.
The test waits until the client has audio, kills the replica serving the stream (``ray.kill``),
waits until it is gone, and releases the stream: the ingress continues it on the other replica.
The client's audio must equal an unbroken run of the same request and seed (then released, so not
held): same length, samples equal within one int16 step. With the app's one continuation spent
(the continuation's replica killed too), HTTP ends with an aborted body, SSE with an ``error``
event; a WebSocket text-in (bistream) turn is not continued and closes with 1011.

Default run: CosyVoice2 over HTTP; the other family and transports are ``slow``.
"""
from __future__ import annotations

import base64
import contextlib
import json
import re
import threading

import httpx
import numpy as np
import pytest

from tests.integration import held_runtime
from tests.integration.conftest import sine_wav
from tests.integration.waiting import GUARD_S, wait_for

pytestmark = pytest.mark.ray

VOICE = "fo"
TEXT = "The weather is lovely today, and the park is full of people walking their dogs in the sun."
INT16_STEP = 1  # float noise of the continuation, after rounding to int16
_apps: dict[str, dict] = {}


def _app(ray_session, tmp_path_factory, family: str) -> dict:
    """The family's app, started on first use (both are deleted at the end of the module)."""
    if family in _apps:
        return _apps[family]
    from ray import serve

    from cosyvoice_runtime.tiny_model import write_tiny_model
    from serve_app.app import build_app
    from serve_app.args import AppArgs

    name = f"failover-{family}"
    model_dir = write_tiny_model(tmp_path_factory.mktemp("fo-model") / family, family)
    args = AppArgs.model_validate({
        "model_dir": str(model_dir),
        "ingress": {"num_replicas": 1, "resources": {"num_cpus": 0.1}, "stream_failover_retries": 1},
        "frontend": {"num_replicas": 1, "resources": {"num_cpus": 0.1},
                     "voices_dir": str(tmp_path_factory.mktemp("fo-voices"))},
        "synthesizer": {"num_replicas": 2, "device": "cpu", "max_running": 4, "max_ongoing_requests": 4,
                        "token2wav": {"max_batch_size": 4},
                        "max_model_len": 1024, "warmup": False, "resources": {"num_cpus": 0.2},
                        "runtime_factory": "tests.integration.held_runtime:held_tiny_runtime"},
    })
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    url = f"{ray_session['base_url']}/{name}"
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": VOICE, "prompt_text": "A prompt transcript."},
                   files={"audio": ("p.wav", sine_wav(), "audio/wav")}, timeout=120)
    assert r.status_code == 201, r.text
    _apps[family] = {"url": url, "name": name, "seeds": iter(range(family == "cosyvoice3", 100, 2))}
    return _apps[family]


@pytest.fixture(scope="module", autouse=True)
def _delete_apps():
    yield
    from ray import serve

    for app in _apps.values():
        serve.delete(app["name"])
    _apps.clear()


# ------------------------------------------------------------------------------ replicas
def _replicas(app: str) -> dict[str, int]:
    """Requests inside each live synthesizer replica of ``app`` (dead ones are left out)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#Synthesizer#"
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(prefix):
            with contextlib.suppress(Exception):  # a replica dying as we ask is left out
                actor = ray.get_actor(a["name"], namespace="serve")
                out[a["name"]] = ray.get(actor.get_num_ongoing_requests.remote(), timeout=30)
    return out


def _running(app: str) -> int:
    from ray import serve

    return int(serve.status().applications[app].deployments["Synthesizer"].replica_states.get("RUNNING", 0))


def _holder(seed: int, exclude: set[str] = frozenset()) -> str:
    """The replica holding the stream of ``seed`` (waits until one other than ``exclude`` holds it)."""
    found: list[str] = []

    def held() -> bool:
        name = held_runtime.holder(seed)
        found[:] = [name] if name else []
        return name is not None and name not in exclude
    wait_for(held, "the stream held inside a replica")
    return found[0]


def _kill(app: str, name: str) -> None:
    import ray

    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    wait_for(lambda: name not in _replicas(app), "the killed replica gone")


def _ready(app: dict) -> None:
    wait_for(lambda: _running(app["name"]) == 2 and all(n == 0 for n in _replicas(app["name"]).values()),
             "two idle synthesizer replicas")


def _failovers(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf'^tts_stream_failovers_total\{{[^}}]*outcome="{outcome}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


# ------------------------------------------------------------------------------ clients
class _Client(threading.Thread):
    """One streamed request in a thread: the PCM it got, and how it ended."""

    def __init__(self, url: str, transport: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.transport, self.seed = url, transport, seed
        self.first = threading.Event()
        self.pcm = bytearray()
        self.events: list[dict] = []
        self.error: str | None = None
        self.close_code: int | None = None

    def run(self) -> None:
        try:
            {"http": self._http, "sse": self._sse, "ws": self._ws, "bistream": self._ws}[self.transport]()
        except Exception as exc:  # noqa: BLE001 - how the stream ended is what the test reads
            self.error = type(exc).__name__
        finally:
            self.first.set()

    def _body(self) -> dict:
        return {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm", "seed": self.seed,
                "stream": True, **({"stream_format": "sse"} if self.transport == "sse" else {})}

    def _http(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/audio/speech", json=self._body(), timeout=GUARD_S) as r:
            assert r.status_code == 200, r.read()
            for part in r.iter_raw():
                self.pcm += part
                self.first.set()

    def _sse(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/audio/speech", json=self._body(), timeout=GUARD_S) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    self.events.append(event)
                    if event["type"] == "speech.audio.delta":
                        self.pcm += base64.b64decode(event["audio"])
                        self.first.set()

    def _ws(self) -> None:
        from websockets.exceptions import ConnectionClosed
        from websockets.sync.client import connect

        mode = "sentence" if self.transport == "ws" else "bistream"
        url = (self.url.replace("http://", "ws://") + f"/v1/text-to-speech/{VOICE}/stream-input"
               f"?output_format=pcm_24000&mode={mode}&seed={self.seed}")
        with connect(url, open_timeout=60, close_timeout=10) as ws:
            ws.send(json.dumps({"text": " "}))
            ws.send(json.dumps({"text": TEXT + " "}))
            ws.send(json.dumps({"text": ""}))
            try:
                while True:
                    msg = json.loads(ws.recv(timeout=GUARD_S))
                    self.events.append(msg)
                    if msg.get("audio"):
                        self.pcm += base64.b64decode(msg["audio"])
                        self.first.set()
                    if msg.get("isFinal"):
                        return
            except ConnectionClosed as exc:
                self.close_code = exc.rcvd.code if exc.rcvd is not None else None
                self.error = "closed"

    def samples(self) -> np.ndarray:
        return np.frombuffer(bytes(self.pcm), "<i2").astype(np.int32)


def _start(app: dict, transport: str) -> tuple[_Client, int]:
    seed = held_runtime.hold_seed(next(app["seeds"]))
    held_runtime.forget(seed)
    client = _Client(app["url"], transport, seed)
    client.start()
    assert client.first.wait(GUARD_S) and client.error is None, client.error
    return client, seed


def _unbroken(app: dict, transport: str, seed: int) -> np.ndarray:
    client = _Client(app["url"], transport, seed)  # released: not held
    client.start()
    client.join(GUARD_S)
    assert not client.is_alive() and client.error is None, client.error
    return client.samples()


# ------------------------------------------------------------------------------ tests
def _continued(ray_session, tmp_path_factory, family: str, transport: str) -> None:
    app = _app(ray_session, tmp_path_factory, family)
    _ready(app)
    before = _failovers(app["url"], "continued")
    client, seed = _start(app, transport)
    try:
        _kill(app["name"], _holder(seed))
    finally:
        held_runtime.release(seed)
    client.join(GUARD_S)
    assert not client.is_alive() and client.error is None, (client.error, client.events[-1:])
    got, want = client.samples(), _unbroken(app, transport, seed)
    held_runtime.forget(seed)
    assert len(got) == len(want) > 0
    assert np.abs(got - want).max() <= INT16_STEP, np.abs(got - want).max()
    if transport != "ws":  # the WebSocket session's continuations are not counted in /metrics
        assert _failovers(app["url"], "continued") == before + 1


def test_killed_replica_mid_stream_continues_http_cosyvoice2(ray_session, tmp_path_factory):
    _continued(ray_session, tmp_path_factory, "cosyvoice2", "http")


@pytest.mark.slow
@pytest.mark.parametrize("family,transport", [("cosyvoice2", "sse"), ("cosyvoice2", "ws"), ("cosyvoice3", "http"),
                                              ("cosyvoice3", "sse"), ("cosyvoice3", "ws")])
def test_killed_replica_mid_stream_continues(ray_session, tmp_path_factory, family, transport):
    _continued(ray_session, tmp_path_factory, family, transport)


# under slow (~20-36 s each on 2 cores): the in-process test_failover.py ends a stream with no
# continuation left in the default run
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["http", "sse"])
def test_no_continuation_left_is_an_unambiguous_error(ray_session, tmp_path_factory, transport):
    """The app allows one continuation: killing the replica that continues the stream too ends it
    with HTTP's aborted body or SSE's error event, never a clean end."""
    app = _app(ray_session, tmp_path_factory, "cosyvoice2")
    _ready(app)
    before = _failovers(app["url"], "lost")
    client, seed = _start(app, transport)
    try:
        first = _holder(seed)
        _kill(app["name"], first)
        _kill(app["name"], _holder(seed, exclude={first}))  # the continuation, held at its second chunk
    finally:
        held_runtime.release(seed)
    client.join(GUARD_S)
    held_runtime.forget(seed)
    assert not client.is_alive()
    if transport == "http":
        assert client.error in ("RemoteProtocolError", "ReadError"), client.error
    else:
        assert client.error is None and client.events[-1]["type"] == "error", client.events[-1:]
        assert client.events[-1]["error"]["code"] == "replica_lost"
        assert all(e["type"] != "speech.audio.done" for e in client.events)
    assert _failovers(app["url"], "lost") == before + 1


@pytest.mark.slow
def test_a_bistream_turn_is_not_continued_and_closes_1011(ray_session, tmp_path_factory):
    app = _app(ray_session, tmp_path_factory, "cosyvoice2")
    _ready(app)
    client, seed = _start(app, "bistream")
    try:
        _kill(app["name"], _holder(seed))
    finally:
        held_runtime.release(seed)
    client.join(GUARD_S)
    held_runtime.forget(seed)
    assert client.close_code == 1011, (client.close_code, client.events[-1:])
    assert "cannot be continued" in client.events[-1]["error"]["message"]
