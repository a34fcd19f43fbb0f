"""Where a replica's CPU goes, thread by thread, and how long its threads wait for the GIL.

Why: the whole Serve app once met the SLO at a fraction of the sessions the same runtime held in
the benchmark's replica simulation, with the GPU often idle and the token2wav stage's tail growing
with load (docs/tuning.md §1, "The serving layer against the runtime"). A GPU left idle by a
replica is a replica whose threads do not launch work: a thread busy on a core (the event loop
streaming chunks through Ray, say) shows in :func:`thread_cpu_seconds`; a thread that is ready but
waits for the GIL (the token2wav driver coming back from a graph replay while another thread runs
Python) uses no CPU and shows only in :class:`GilWait`: a probe thread that sleeps a fixed period
and measures how late it wakes (the time to take the GIL back, plus the OS's timer slack of
~0.1 ms).
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import psutil

from deployments import constants
from deployments.observability import Durations

GIL_PROBE_PERIOD_S = 0.02  # 50 wake-ups a second: each takes the GIL for microseconds
SLOW_WAIT_S = 0.01  # a wait past this shows in the capacity reports (bench/capacity.py)
NATIVE = "native"  # threads Python did not start: Ray's core worker, CUDA's, OpenMP's
_POOL_NUMBER = re.compile(r"_\d+$")  # ThreadPoolExecutor names its threads <prefix>_<n>
_UNNAMED = re.compile(r"^Thread-\d+(?: \((.+)\))?$")  # threading's default: Thread-<n> (<target>)


def thread_group(name: str) -> str:
    """A thread's name without the numbers that differ between threads of one kind
    (``compute-token2wav_0`` -> ``compute-token2wav``, ``Thread-7 (_run_user_code_event_loop)`` ->
    ``_run_user_code_event_loop``), so the metric's label values stay few however many threads
    come and go."""
    unnamed = _UNNAMED.match(name)
    if unnamed:
        name = unnamed.group(1) or "Thread"
    return _POOL_NUMBER.sub("", name)


_retired: dict[str, float] = {}  # CPU seconds of ended threads (retire_thread), by group
_retired_lock = threading.Lock()


def retire_thread() -> None:
    """Keep the calling thread's CPU seconds after it ends (call it last, in a ``finally``).

    For threads that end when idle and start again with work (the engine's step thread): read
    at the end of a probe, once the load has drained, such a thread is gone, and with it every
    second it ran."""
    group = thread_group(threading.current_thread().name)
    with _retired_lock:
        _retired[group] = _retired.get(group, 0.0) + time.thread_time()


def thread_cpu_seconds(process: psutil.Process | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads, summed by :func:`thread_group`:
    the live ones (threads Python does not know are :data:`NATIVE`) and those that ended through
    :func:`retire_thread`. Any other thread that ended takes its seconds with it."""
    groups = {t.native_id: thread_group(t.name) for t in threading.enumerate()}
    with _retired_lock:
        out = dict(_retired)
    for t in (process or psutil.Process()).threads():
        group = groups.get(t.id, NATIVE)
        out[group] = out.get(group, 0.0) + t.user_time + t.system_time
    return out


class GilWait:
    """How late a thread wakes from a sleep of ``period_s`` (see the module docstring).

    Args:
        period_s: the sleep between readings.
        clock / sleep: seconds and how to wait (tests pass fakes and call :meth:`tick`).
    """

    def __init__(self, period_s: float = GIL_PROBE_PERIOD_S, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.period_s = period_s
        self.clock = clock
        self.sleep = sleep
        self.waits = Durations(constants.GIL_WAIT_BUCKETS_S, SLOW_WAIT_S)

    def tick(self) -> float:
        """One reading: sleep ``period_s``, record and return how much later than that it woke."""
        started = self.clock()
        self.sleep(self.period_s)
        late = max(0.0, self.clock() - started - self.period_s)
        self.waits.add(late)
        return late

    def run_forever(self) -> None:
        while True:
            self.tick()

    def snapshot(self) -> dict:
        """:meth:`Durations.snapshot` of the readings."""
        return self.waits.snapshot()


_PROBE: GilWait | None = None
_probe_lock = threading.Lock()


def gil_wait() -> GilWait:
    """This process's GIL probe, its thread started on first use (one per process, daemon)."""
    global _PROBE
    with _probe_lock:
        if _PROBE is None:
            _PROBE = GilWait()
            threading.Thread(target=_PROBE.run_forever, name="gil-probe", daemon=True).start()
    return _PROBE
