"""A replica's CPU by thread and its threads' wait for the GIL (deployments.thread_load)."""
from __future__ import annotations

import threading
import time

from deployments.thread_load import GilWait, gil_wait, retire_thread, thread_cpu_seconds, thread_group


def test_pool_threads_are_grouped_by_their_prefix():
    assert thread_group("compute-token2wav_0") == "compute-token2wav"
    assert thread_group("frontend_12") == "frontend"
    assert thread_group("engine-step") == "engine-step" and thread_group("MainThread") == "MainThread"
    assert thread_group("Thread-1 (_run_user_code_event_loop)") == "_run_user_code_event_loop"
    assert thread_group("Thread-57") == "Thread" and thread_group("asyncio_3") == "asyncio"


def test_cpu_seconds_are_read_per_named_thread_while_it_lives():
    parked, release = threading.Event(), threading.Event()

    def burn():
        while time.thread_time() < 0.06:  # this thread's own CPU time, not the wall clock
            pass
        parked.set()
        release.wait()

    workers = [threading.Thread(target=burn, name=f"burner_{i}") for i in range(2)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            assert parked.wait(60)
        seen = thread_cpu_seconds()
    finally:
        release.set()
        for w in workers:
            w.join()
    assert seen["burner"] >= 0.05  # at least one parked burner, summed under its pool prefix
    assert "MainThread" in seen and all(v >= 0 for v in seen.values())
    assert not any(name.startswith("burner_") for name in seen)  # one group, not one entry per thread


def test_a_thread_that_retires_keeps_its_cpu_seconds_after_it_ends():
    """The engine's step thread ends when idle: read after a probe's load has drained, its
    seconds would be gone without retire_thread."""
    before = thread_cpu_seconds().get("retiring", 0.0)

    def burn():
        try:
            while time.thread_time() < 0.05:
                pass
        finally:
            retire_thread()

    worker = threading.Thread(target=burn, name="retiring")
    worker.start()
    worker.join()
    assert thread_cpu_seconds()["retiring"] - before >= 0.05


def test_a_late_wake_up_is_recorded_as_a_gil_wait():
    now = [0.0]
    lateness = iter([0.0002, 0.03, 0.004])

    def sleep(s):
        now[0] += s + next(lateness)

    probe = GilWait(period_s=0.02, clock=lambda: now[0], sleep=sleep)
    waits = [probe.tick() for _ in range(3)]
    assert [round(w, 6) for w in waits] == [0.0002, 0.03, 0.004]
    snap = probe.snapshot()
    assert snap["count"] == 3 and abs(snap["seconds"] - 0.0342) < 1e-9 and snap["slow"] == 1  # only the 30 ms wait is past SLOW_WAIT_S
    assert snap["buckets"] == [sum(w <= b for w in waits) for b in snap["bounds"]]


def test_the_process_probe_is_one_daemon_thread():
    probe = gil_wait()
    assert gil_wait() is probe
    threads = [t for t in threading.enumerate() if t.name == "gil-probe"]
    assert len(threads) == 1 and threads[0].daemon and threads[0].is_alive()
