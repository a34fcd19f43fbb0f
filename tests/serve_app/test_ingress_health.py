"""``/health`` costs nothing (issue 41 item 2): anonymous calls answer from the status one background
task keeps, never a handle call; the live probe needs a key and concurrent ones share one probe.

The ingress runs in process with real TextFrontend/Synthesizer objects (fake runtimes) behind
handle stand-ins that count every call: a handle call is what takes a replica slot and what Serve's
autoscaling policy counts (``total_num_requests``), and the synthesizer's ``streams_in_flight`` is
the load-band policy's signal.
"""
from __future__ import annotations

import asyncio
import collections

from deployments import constants
from serve_app.ingress import IngressConfig
from tests.deployments import fakes
from tests.serve_app.test_auth import ADMIN_KEY as VOICES_KEY
from tests.serve_app.test_auth import KEYS_ENV, OPS_KEY, SYNTH_KEY
from tests.serve_app.test_ingress_inproc import _ingress, _wav, client

TEXT = "Hello there."
GUARD_S = 60.0
FLOOD = 500


class _Counted:
    """A handle method whose ``remote`` calls are counted; ``synthesize`` streams can be held."""

    def __init__(self, method, name: str, owner: CountingHandle) -> None:
        self._method, self._name, self._owner = method, name, owner

    def remote(self, *args):
        self._owner.calls[self._name] += 1
        res = self._method.remote(*args)
        return self._owner.held_stream(res) if self._name == "synthesize" and self._owner.stream else res


class CountingHandle:
    """Wraps an in-process handle stand-in; ``calls`` counts ``.remote()`` calls by method name.

    A ``synthesize`` stream yields ``hold_at`` chunks, then sets ``at_gate`` and waits for ``gate``."""

    def __init__(self, inner, calls: collections.Counter | None = None, stream: bool = False,
                 gate: asyncio.Event | None = None, at_gate: asyncio.Event | None = None, hold_at: int = 1) -> None:
        self._inner, self.stream = inner, stream
        self.calls = calls if calls is not None else collections.Counter()
        self.gate, self.at_gate, self.hold_at = gate, at_gate, hold_at

    def options(self, stream: bool = False):
        return CountingHandle(self._inner.options(stream=stream), self.calls, stream, self.gate, self.at_gate,
                              self.hold_at)

    def __getattr__(self, name: str):
        return _Counted(getattr(self._inner, name), name, self)

    def held_stream(self, inner):
        owner = self

        class Held:
            def __init__(self) -> None:
                self.n = 0

            def __aiter__(self):
                return self

            async def __anext__(self):
                if self.n == owner.hold_at and owner.gate is not None:
                    owner.at_gate.set()
                    await owner.gate.wait()
                self.n += 1
                return await inner.__anext__()

            def cancel(self) -> None:
                inner.cancel()

        return Held()


def _counted_ingress(gate=None, at_gate=None, **cfg):
    ingress = _ingress(IngressConfig(max_input_chars=1000, health_refresh_s=3600.0, **cfg))
    ingress.synth = CountingHandle(ingress.synth, gate=gate, at_gate=at_gate)
    ingress.frontend = CountingHandle(ingress.frontend)
    monitor = ingress.health_monitor
    monitor.synth, monitor.frontend = ingress.synth, ingress.frontend
    return ingress


def _n_bytes(text: str) -> int:
    return 2 * len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN  # s16le


def _policy_inputs(synthesizer) -> dict:
    """What the load-band policy reads from the replica (utilisation is for dashboards only; the
    engine's own occupancy moves on while the held stream's tokens are generated)."""
    return {"streams_in_flight": synthesizer.record_autoscaling_stats()["streams_in_flight"]}


def test_anonymous_health_flood_during_a_stream_calls_no_replica(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS_ENV)  # keys on: /health stays open to strangers
    ingress = _counted_ingress()
    app = ingress.__serve_build_asgi_app__()
    synth_calls, frontend_calls = ingress.synth.calls, ingress.frontend.calls
    synthesizer = ingress.synth._inner._target  # the Synthesizer object behind the handle

    async def main():
        gate, at_gate = asyncio.Event(), asyncio.Event()
        ingress.synth.gate, ingress.synth.at_gate = gate, at_gate
        auth = {"Authorization": f"Bearer {VOICES_KEY}"}  # voices + synthesis: registers and uses its voice
        async with client(app) as c:
            r = await c.post("/v1/voices", data={"voice_id": "v1", "prompt_text": "hi"}, headers=auth,
                             files={"audio": ("a.wav", _wav(), "audio/wav")})
            assert r.status_code == 201
            # The background task's first probe (shared by this call), then none for an hour.
            ingress.health_monitor.start()
            await ingress.health_monitor.probe()
            stream = asyncio.create_task(c.post("/v1/audio/speech", headers=auth, json={
                "model": "tts-1", "input": TEXT, "voice": "v1", "response_format": "pcm", "stream": True}))
            # the stream has delivered its first chunk and holds the rest (the guard only fails a hang)
            await asyncio.wait_for(at_gate.wait(), GUARD_S)
            before = (dict(synth_calls), dict(frontend_calls), _policy_inputs(synthesizer))
            assert before[2]["streams_in_flight"] == 1.0
            answers = await asyncio.gather(*(c.get("/health") for _ in range(FLOOD)))
            assert {r.status_code for r in answers} == {200}
            assert {r.json()["status"] for r in answers} == {"ok"}
            assert "synthesizer_replicas" not in answers[0].json()  # counts only, no replica detail
            after = (dict(synth_calls), dict(frontend_calls), _policy_inputs(synthesizer))
            assert after == before  # no handle call, no stream more or less: the autoscaler sees nothing
            gate.set()
            r = await stream
            assert r.status_code == 200 and len(r.content) == _n_bytes(TEXT)  # the stream finished whole

    asyncio.run(main())


def test_health_before_the_first_probe_says_starting_without_probing():
    """Before the first background probe lands, /health says so (503) instead of probing itself."""
    ingress = _counted_ingress()
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            r = await c.get("/health")  # starts the background task; answers before it has run
            assert r.status_code == 503 and r.json() == {"status": "unavailable", "reason": "starting"}
            assert ingress.synth.calls["health"] == 0 and ingress.frontend.calls["status"] == 0
            await ingress.health_monitor.probe()  # shares the background task's first probe
            r = await c.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            assert r.json()["synthesizer_replicas_ready"] == 1 and r.json()["checked_age_s"] >= 0
            assert ingress.health_monitor.probes == 1

    asyncio.run(main())


def test_detail_needs_a_metrics_key_and_concurrent_detail_calls_share_one_probe(monkeypatch):
    monkeypatch.setenv(constants.ENV_API_KEYS, KEYS_ENV)
    ingress = _counted_ingress()
    app = ingress.__serve_build_asgi_app__()

    async def main():
        async with client(app) as c:
            ingress.health_monitor.start()
            await ingress.health_monitor.probe()
            calls = ingress.synth.calls["health"]
            assert (await c.get("/health?detail=1")).status_code == 401
            r = await c.get("/health?detail=1", headers={"Authorization": f"Bearer {SYNTH_KEY}"})
            assert r.status_code == 403
            assert ingress.synth.calls["health"] == calls  # refused before any probe
            ops = {"Authorization": f"Bearer {OPS_KEY}"}
            answers = await asyncio.gather(*(c.get("/health?detail=1", headers=ops) for _ in range(50)))
            assert {r.status_code for r in answers} == {200}
            assert all(r.json()["synthesizer_replicas"]["local"]["ready"] for r in answers)
            # one probe for all 50: one round of 2 calls (Serve counts no replica outside Serve)
            assert ingress.synth.calls["health"] == calls + 2
            assert ingress.frontend.calls["status"] == 2  # the background probe's and the shared one's

    asyncio.run(main())
