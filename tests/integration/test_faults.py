"""Faults on real local Ray: a replica killed mid-stream (its streams continued), timeouts, disconnects,
overload, recovery.

Runs as its own application (``/faults``, two synthesizer replicas, fake runtimes) in the
session's Ray, so that killing a replica does not disturb the other suites' app. Slot accounting
is read over HTTP: ``/health`` (engine stats of every synthesizer replica) and ``/metrics``
(``tts_requests_in_flight`` of the ingress).

The long soak (``bench.soak``, 2,000 requests on the tiny model) is ``test_soak`` (``-m slow``).
"""
from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from tests.deployments import fakes
from tests.integration.conftest import TEST_ARGS, replica_ongoing
from tests.integration.waiting import GUARD_S, wait_for

pytestmark = pytest.mark.ray

PREFIX = "/faults"
APP = "faults"
RETRY_AFTER = 3
VOICE = "carol"


def _expected_samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


@pytest.fixture(scope="module")
def faults_app(ray_session):
    from ray import serve

    from bench.load import synthetic_prompt_wav
    from serve_app.app import build_app
    from serve_app.args import AppArgs

    args = {**TEST_ARGS, "synthesizer": {**TEST_ARGS["synthesizer"], "num_replicas": 2, "retry_after_s": RETRY_AFTER}}
    serve.run(build_app(AppArgs.model_validate(args)), name=APP, route_prefix=PREFIX)
    url = ray_session["base_url"] + PREFIX
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": VOICE, "prompt_text": "carol speaking", "overwrite": "true"},
                   files={"audio": ("c.wav", synthetic_prompt_wav(2.0), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    yield {"url": url}
    serve.delete(APP)


def _speech(text: str, stream: bool = True, seed: int | None = None) -> dict:
    return {"model": "tts-1", "input": text, "voice": VOICE, "response_format": "pcm", "stream": stream, "seed": seed}


def _engines(url: str, timeout_s: float = GUARD_S) -> dict[str, dict]:
    """Engine stats of every running synthesizer replica. A /health call can miss a replica
    (a probe that timed out on a loaded runner); counts summed over replicas need all of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = {rid: rep["engine"] for rid, rep in httpx.get(f"{url}/health?detail=1", timeout=30).json()
                ["synthesizer_replicas"].items()}
        if len(seen) >= _running("Synthesizer") or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def _in_flight(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return float(re.search(r"^tts_requests_in_flight(?:\{[^}]*\})? (\S+)$", text, re.MULTILINE).group(1))


def _wait_idle(url: str, timeout_s: float = GUARD_S) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        engines = _engines(url)
        idle = engines and all(e["running"] == 0 and e["waiting"] == 0 and e["open_streams"] == 0
                               for e in engines.values())
        if (idle and _in_flight(url) == 0) or time.monotonic() > deadline:
            return engines
        time.sleep(0.2)


def _assert_idle(url: str) -> dict[str, dict]:
    engines = _wait_idle(url)
    assert all(e["running"] == 0 and e["open_streams"] == 0 for e in engines.values()), engines
    assert _in_flight(url) == 0
    return engines


def _synth_replicas() -> set[str]:
    """Names of the app's live synthesizer replica actors (from the GCS; no dashboard needed)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#Synthesizer#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def _running(deployment: str) -> int:
    from ray import serve

    status = serve.status().applications[APP].deployments[deployment]
    return int(status.replica_states.get("RUNNING", 0))


class _Stream(threading.Thread):
    """One streamed request in a thread: records bytes, first-chunk time and how it ended."""

    def __init__(self, url: str, text: str, seed: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.text, self.seed = url, text, seed
        self.first = threading.Event()
        self.nbytes = 0
        self.status: int | None = None
        self.error: str | None = None
        self.done = False

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/audio/speech", json=_speech(self.text, seed=self.seed),
                              timeout=GUARD_S) as r:
                self.status = r.status_code
                for part in r.iter_raw():
                    self.nbytes += len(part)
                    self.first.set()
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__
        finally:
            self.first.set()
            self.done = True


# ------------------------------------------------------------------------------ replica crash
def _failovers(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf'^tts_stream_failovers_total\{{[^}}]*outcome="{outcome}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow  # ~18 s; tests/integration/test_failover_ray.py kills a real replica mid-stream in the default run
def test_killed_replica_mid_stream(faults_app):
    """Streams on the killed replica are continued on the other one (serve_app/failover.py) and
    every stream ends whole, Serve starts a replacement, and new requests succeed.

    The streams hold after their first chunk (a hold seed of the fakes) until the test releases
    them, so every one of them is mid-stream when the replica dies, whatever the machine's load.
    The audio's equality with an unbroken run is tests/integration/test_failover_ray.py's (real
    tiny model); here every stream has its exact length and no error."""
    import ray

    url = faults_app["url"]
    assert _running("Synthesizer") == 2
    before = _synth_replicas()
    assert len(before) == 2
    continued = _failovers(url, "continued")
    text, seed = "k" * 100, fakes.hold_seed()
    streams = [_Stream(url, text, seed) for _ in range(6)]
    try:
        for s in streams:  # one at a time, so the router sees each replica's load when placing the next
            s.start()
            assert s.first.wait(GUARD_S) and s.status == 200, (s.status, s.error)
        ongoing: dict[str, int] = {}

        def all_inside() -> bool:  # read from the replica actors: a handle probe would queue behind full slots
            ongoing.update(replica_ongoing(APP, "Synthesizer"))
            return len(ongoing) == 2 and sum(ongoing.values()) == 6

        wait_for(all_inside, "six streams inside two replicas")
        # Routing spreads six streams over two replicas (four slots each); each side gets some.
        assert all(ongoing.values()), ongoing
        victim_name = min(ongoing)
        ray.kill(ray.get_actor(victim_name, namespace="serve"), no_restart=True)
        # Each of the victim's streams starts a continuation (held again, on another replica).
        wait_for(lambda: _failovers(url, "continued") == continued + ongoing[victim_name],
                 "the victim's streams continued")
        fakes.release(seed)  # every stream runs to its end
        for s in streams:
            s.join(GUARD_S)
            assert not s.is_alive(), "a stream hung"
    finally:
        fakes.release(seed)
    fakes.forget(seed)
    assert all(s.error is None and s.nbytes == 2 * _expected_samples(text) for s in streams), [
        (s.error, s.nbytes) for s in streams]
    # Serve replaces the replica ...
    wait_for(lambda: len(now := _synth_replicas()) == 2 and victim_name not in now
              and _running("Synthesizer") == 2, "a replacement replica running")
    # ... and new requests (both replicas, unary and streamed) succeed.
    for stream in (False, True, False, True):
        r = httpx.post(f"{url}/v1/audio/speech", json=_speech("After the crash.", stream=stream), timeout=30)
        assert r.status_code == 200 and len(r.content) == 2 * _expected_samples("After the crash.")
    _assert_idle(url)


# ------------------------------------------------------------------------------ one request fails
def _http_requests(url: str, status: str) -> float:
    """``tts_http_requests_total`` of the speech route with ``status``, over its other labels."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tts_http_requests_total{") and 'route="/v1/audio/speech"' in line
               and f'status="{status}"' in line)


def test_a_request_failing_mid_stream_ends_with_an_error_and_counts_as_500(faults_app):
    """NaN audio after the first chunk (fakes.NAN_SEED): the stream breaks with a transport error
    instead of carrying the NaNs, /metrics counts a 500 (not the 200 its headers said), and the
    replica goes on serving; a unary request with the same fault gets the JSON 500."""
    url = faults_app["url"]
    _assert_idle(url)
    ok_before, failed_before = _http_requests(url, "200"), _http_requests(url, "500")
    s = _Stream(url, "n" * 100, seed=fakes.NAN_SEED)
    s.start()
    s.join(GUARD_S)
    assert s.status == 200 and s.error in ("RemoteProtocolError", "ReadError"), (s.status, s.error)
    assert 0 < s.nbytes < 2 * _expected_samples("n" * 100)
    r = httpx.post(f"{url}/v1/audio/speech", json=_speech("n" * 100, stream=False, seed=fakes.NAN_SEED), timeout=30)
    assert r.status_code == 500 and r.json()["error"]["code"] == "synthesis_failed", r.text
    assert "non-finite" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/audio/speech", json=_speech("Still fine.", stream=False), timeout=30)
    assert r.status_code == 200 and len(r.content) == 2 * _expected_samples("Still fine.")
    assert _http_requests(url, "500") == failed_before + 2
    assert _http_requests(url, "200") == ok_before + 1
    assert httpx.get(f"{url}/health?detail=1", timeout=30).json()["status"] == "ok"
    _assert_idle(url)


# ------------------------------------------------------------------------------ slots
def test_request_timeout_frees_its_slot(faults_app):
    url = faults_app["url"]
    _assert_idle(url)
    before = sum(e["aborted"] for e in _engines(url).values())
    # A unary request held by the fakes (no answer can come); once it decodes, the client gives up
    # as its read timeout would: it closes the connection. (Timing out after 1 s instead raced the
    # request's way to the engine on a loaded machine: cancelled before it had a slot, no abort.)
    parts = urlsplit(url)
    body = json.dumps(_speech("t" * 100, stream=False, seed=fakes.hold_seed())).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=GUARD_S) as sock:
        sock.sendall(f"POST {parts.path}/v1/audio/speech HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: sum(e["running"] for e in _engines(url).values()) == 1, "the request decoding")
        sock.shutdown(socket.SHUT_RDWR)
    engines = _assert_idle(url)
    assert sum(e["aborted"] for e in engines.values()) == before + 1, engines  # aborted, not decoded to the end


def test_disconnects_free_their_slots(faults_app):
    url = faults_app["url"]
    _assert_idle(url)
    before = sum(e["aborted"] for e in _engines(url).values())
    seed = fakes.hold_seed()  # never released

    async def open_and_drop(client):
        # Held after its first chunk: the connection closes mid-stream, whatever the machine's load.
        async with client.stream("POST", f"{url}/v1/audio/speech", json=_speech("d" * 100, seed=seed)) as r:
            assert r.status_code == 200
            async for _ in r.aiter_raw():
                break  # one chunk, then close the connection

    async def main():
        async with httpx.AsyncClient(timeout=30) as client:
            await asyncio.gather(*(open_and_drop(client) for _ in range(4)))

    asyncio.run(main())
    engines = _assert_idle(url)
    assert sum(e["aborted"] for e in engines.values()) == before + 4, engines


# ------------------------------------------------------------------------------ overload
def test_overload_429_then_recovery(faults_app):
    url = faults_app["url"]
    _assert_idle(url)

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            # Half streamed: a rejected stream must get the same JSON 429 as a unary request.
            return await asyncio.gather(*(client.post(f"{url}/v1/audio/speech",
                                                      json=_speech("o" * 300, stream=i % 2 == 0))
                                          for i in range(28)))

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == str(RETRY_AFTER), r.text
            assert r.json()["error"]["code"] == "queue_full" and r.json()["request_id"]
        else:
            assert len(r.content) == 2 * _expected_samples("o" * 300)
    _assert_idle(url)
    # Load dropped: every request is served again.
    for _ in range(6):
        r = httpx.post(f"{url}/v1/audio/speech", json=_speech("Recovered.", stream=False), timeout=30)
        assert r.status_code == 200


def test_no_request_lost_under_mixed_load(faults_app):
    """The load generator against the app: every request ends in audio or a documented code."""
    from bench.load import LoadConfig, LoadGenerator

    cfg = LoadConfig(base_url=faults_app["url"], mode="open", rate_rps=40.0, max_requests=80, max_duration_s=10.0,
                     texts=("Hi.", "Hello world.", "p" * 120, "q" * 400), voices=(VOICE, "nobody"),
                     sample_rate=fakes.SAMPLE_RATE, progress=False, seed=7)
    s = LoadGenerator(cfg).run()["summary"]
    assert s["requests"] == 80 and s["lost"] == 0, s["outcomes"]
    assert s["ok"] > 0 and s["outcomes"].get("404:voice_not_found", 0) > 0
    assert s["retry_after_missing"] == 0
    _assert_idle(faults_app["url"])


# ------------------------------------------------------------------------------ soak (slow)
@pytest.mark.slow
def test_soak(ray_session, tmp_path_factory):
    """2,000 requests on the tiny model (``make soak`` runs the same thing as a script)."""
    from ray import serve

    from bench.soak import run_soak, write_result
    from cosyvoice_runtime.tiny_model import write_tiny_model
    from serve_app.app import build_app
    from serve_app.args import AppArgs

    model_dir = write_tiny_model(tmp_path_factory.mktemp("soak-model") / "tiny-cosyvoice2", "cosyvoice2")
    args = AppArgs.model_validate({
        "model_dir": str(model_dir),
        "ingress": {"num_replicas": 1, "resources": {"num_cpus": 0.1}},
        "frontend": {"num_replicas": 1, "resources": {"num_cpus": 0.1},
                     "voices_dir": str(tmp_path_factory.mktemp("soak-voices"))},
        "synthesizer": {"num_replicas": 1, "device": "cpu", "max_running": 8, "max_ongoing_requests": 8,
                        "max_queued_requests": 16, "max_model_len": 1024, "token2wav": {"max_batch_size": 4},
                        "resources": {"num_cpus": 0.5}},
    })
    serve.run(build_app(args), name="soak", route_prefix="/soak")
    try:
        result = run_soak(ray_session["base_url"] + "/soak", requests=2000, concurrency=8, progress=False)
        write_result(result, tmp_path_factory.mktemp("soak-out") / "soak")
        assert result["requests_lost"] == 0 and not result["violations"], result["violations"]
        assert result["passed"]
    finally:
        serve.delete("soak")
