"""Synthesizer memory hygiene without Ray: glibc arenas capped in the replica's env, freed heap
returned to the OS once the replica has been idle for IDLE_TRIM_DELAY_S (never under load)."""
from __future__ import annotations

import asyncio

import pytest

from deployments import housekeeping
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments.test_synthesizer_unit import _req, _synth


def test_replica_env_caps_malloc_arenas_and_keeps_other_options():
    opts = Synthesizer.deployment_options(SynthesizerConfig())
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"] == {"MALLOC_ARENA_MAX": "2"}
    assert opts["ray_actor_options"]["num_cpus"] == SynthesizerConfig().resources.num_cpus


def test_heap_is_trimmed_once_after_idle_not_between_busy_requests(monkeypatch):
    """The idle timer is armed when the last request ends and called off by the next one; its
    expiry is played by calling its callback (no test waits for a timer)."""
    calls = []
    monkeypatch.setattr(housekeeping, "release_free_heap", lambda: calls.append(1) or True)
    s = _synth()

    async def one(rid):
        return [c async for c in s.synthesize(_req(rid, 5, stream=True))]

    async def main():
        loop = asyncio.get_running_loop()
        await asyncio.gather(one("a"), one("b"))
        armed = s.idle_trim.timer
        assert armed is not None and armed.when() - loop.time() <= housekeeping.IDLE_TRIM_DELAY_S
        await one("c")  # starts before the delay: the pending trim is called off, a new one armed
        assert armed.cancelled() and s.idle_trim.heap_trims == 0
        s.idle_trim.timer.cancel()
        s.idle_trim.fire()  # the delay has passed with nothing running
        assert s.idle_trim.heap_trims == 1 and s.idle_trim.timer is None
        await s.idle_trim.task
        s.idle_trim.fire()  # fired again while idle: trims again (nothing is in progress)
        await s.idle_trim.task

    asyncio.run(main())
    assert s.idle_trim.heap_trims == 2 and calls == [1, 1]


def test_no_trim_while_a_request_is_in_progress():
    s = _synth()

    async def main():
        gen = s.synthesize(_req("busy", 50, stream=True))
        await gen.__anext__()
        s.idle_trim.fire()  # a stale timer firing under load
        assert s.idle_trim.heap_trims == 0 and s.idle_trim.task is None
        await gen.aclose()

    asyncio.run(main())


def test_release_free_heap_runs_here():
    assert housekeeping.release_free_heap() in (True, False)  # glibc: whether anything was returned


def test_cuda_cache_is_emptied_only_when_measured_fragmented():
    from deployments.gpu_stats import FRAGMENTED_MIN_BYTES, fragmentation, is_fragmented, release_fragmented_cache

    mib = 1 << 20
    assert not is_fragmented(0, 0)
    assert not is_fragmented(FRAGMENTED_MIN_BYTES - 1, FRAGMENTED_MIN_BYTES)  # share high, bytes too few
    assert not is_fragmented(300 * mib, 4096 * mib)  # enough bytes, share 7 %: reusable, keep the cache
    assert is_fragmented(1200 * mib, 4096 * mib)
    assert fragmentation({"inactive_split_bytes.all.current": 5, "reserved_bytes.all.current": 9}) == (5, 9)
    assert release_fragmented_cache("cpu") is None


@pytest.mark.gpu
def test_fragmentation_reading_on_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from deployments.gpu_stats import release_fragmented_cache

    keep = [torch.empty(1 << 20, device="cuda") for _ in range(8)]
    del keep[::2]  # free every other block: split, unused memory inside the cache
    out = release_fragmented_cache("cuda")
    assert set(out) == {"inactive_split_bytes", "reserved_bytes", "released"} and out["reserved_bytes"] > 0
