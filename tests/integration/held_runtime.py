"""The real tiny-model runtime with a hold, for killing a replica mid-stream deterministically.

``held_tiny_runtime`` (a ``synthesizer.runtime_factory``) builds the production runtime and lets a
stream whose seed is a hold seed (:func:`hold_seed`) make its first chunk, then holds its next
token2wav job until the test releases the seed (a marker file, seen by replicas on this machine).
So a stream is mid-stream, with audio at the client and more to come, for as long as the test
needs: it kills the replica serving it, then releases. A released seed is never held again, so an
unbroken run of the same request and seed follows. The replica that holds a stream writes its actor
name beside the marker (:func:`holder`): the test kills that replica, never one it guessed from
request counts (the ingress's background health probes are requests too). The wait polls the
marker in the replica's compute thread (a replica that serves a held stream makes no other audio
meanwhile).
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path

# above every seed the ingress draws for a request without one (serve_app/failover.py: 31 bits),
# so no such request is ever held; under the ElevenLabs body's 2**32 cap
HOLD_BASE = 2**31 + 11
POLL_S = 0.05  # spacing between looks at the marker, not a synchronisation
GUARD_S = 300.0  # a hold never released fails the stream instead of keeping the replica forever


def hold_seed(n: int = 0) -> int:
    """A hold seed of this test session (the pid keeps other sessions' markers apart)."""
    return HOLD_BASE + (os.getpid() % 100_000) * 100 + n


def _marker(seed: int) -> Path:
    return Path(tempfile.gettempdir()) / f"fastcosy-held-release-{seed}"


def _holder_file(seed: int) -> Path:
    return Path(tempfile.gettempdir()) / f"fastcosy-held-at-{seed}"


def release(seed: int) -> None:
    _marker(seed).touch()


def forget(seed: int) -> None:
    _marker(seed).unlink(missing_ok=True)
    _holder_file(seed).unlink(missing_ok=True)


def holder(seed: int) -> str | None:
    """The actor name of the replica holding ``seed``'s stream now (the last to hold it), if any."""
    try:
        return _holder_file(seed).read_text() or None
    except FileNotFoundError:
        return None


def _say_holder(seed: int) -> None:
    import ray

    tmp = _holder_file(seed).with_suffix(".tmp")
    tmp.write_text(ray.get_runtime_context().get_actor_name() or "")
    tmp.replace(_holder_file(seed))  # whole, never half-written


HOLD_SEEDS = range(HOLD_BASE, HOLD_BASE + 100_000 * 100)


def _is_hold(seed: int | None) -> bool:
    return seed in HOLD_SEEDS


class _HeldToken2Wav:
    """The runtime's token2wav; a held stream's second job waits for its release."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self._seeds: dict[int, int] = {}  # id(stream state) -> its hold seed
        self._jobs: dict[int, int] = {}  # id(stream state) -> jobs run
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def new_stream(self, prompt, stream: bool, speed: float, seed: int | None):
        state = self._inner.new_stream(prompt, stream, speed, seed)
        self._jobs[id(state)] = 0  # (an id may be a collected state's)
        self._seeds.pop(id(state), None)
        if _is_hold(seed) and not _marker(seed).exists():
            self._seeds[id(state)] = seed
        return state

    def run_batch(self, jobs):
        for job in jobs:
            key = id(job.state)
            with self._lock:
                n = self._jobs.get(key, 0)
                self._jobs[key] = n + 1
            seed = self._seeds.get(key)
            if seed is not None and n >= 1:
                _say_holder(seed)
                deadline = time.monotonic() + GUARD_S
                while not _marker(seed).exists():
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"hold seed {seed} never released")
                    time.sleep(POLL_S)
                self._seeds.pop(key, None)
        return self._inner.run_batch(jobs)


def held_tiny_runtime(cfg, source, plan):
    from deployments.synthesizer import default_runtime_factory

    runtime = default_runtime_factory(cfg, source, plan)
    runtime.token2wav = _HeldToken2Wav(runtime.token2wav)
    return runtime
