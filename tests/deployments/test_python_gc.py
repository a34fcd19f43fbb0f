"""The replicas' garbage-collector handling: the start-up heap frozen, every pause recorded."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest

from deployments.python_gc import SLOW_PAUSE_S, GcPauses, freeze_startup_heap, settle_replica, watched


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_pauses_are_recorded_by_generation_into_cumulative_buckets():
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    for gen, pause_s in ((0, 0.0005), (2, 0.03), (2, 0.2)):
        pauses.callback("start", {"generation": gen})
        now[0] += pause_s
        pauses.callback("stop", {"generation": gen})
    snap = pauses.snapshot()
    full = snap["by_generation"]["2"]
    assert full["count"] == 2 and abs(full["seconds"] - 0.23) < 1e-9
    bounds = full["bounds"]
    assert full["buckets"] == [int(0.03 <= b) + int(0.2 <= b) for b in bounds]
    assert snap["by_generation"]["0"]["buckets"] == [1] * len(bounds) and snap["by_generation"]["1"]["count"] == 0
    assert snap["slow"] == 2 and 0.0005 < SLOW_PAUSE_S < 0.03


def test_a_collection_during_a_snapshot_is_recorded_without_deadlock(monkeypatch):
    """A collection can start at any allocation, also inside snapshot() on the same thread: its
    callback must not wait for anything snapshot() holds (a lock there hung a replica's /metrics)."""
    now = [0.0]
    pauses = GcPauses(clock=lambda: now[0])
    real = gc.get_freeze_count

    def collect_meanwhile():  # called inside snapshot(), as an allocation there could start a collection
        pauses.callback("start", {"generation": 2})
        now[0] += 0.05
        pauses.callback("stop", {"generation": 2})
        return real()

    monkeypatch.setattr(gc, "get_freeze_count", collect_meanwhile)
    worker = threading.Thread(target=pauses.snapshot, daemon=True)
    worker.start()
    worker.join(60)  # a guard against a hang, not a timing: it returns at once unless deadlocked
    monkeypatch.setattr(gc, "get_freeze_count", real)
    assert not worker.is_alive(), "snapshot() deadlocked on a collection it started"
    assert pauses.snapshot()["by_generation"]["2"]["count"] == 1


def test_a_stop_without_its_start_records_nothing():
    pauses = GcPauses(clock=lambda: 1.0)
    pauses.callback("stop", {"generation": 2})  # installed while a collection was running
    assert pauses.snapshot()["by_generation"]["2"]["count"] == 0


def test_the_process_watcher_is_installed_once_and_sees_a_real_collection():
    first = watched()
    assert watched() is first and gc.callbacks.count(first.callback) == 1
    before = first.snapshot()["by_generation"]["2"]["count"]
    gc.collect()
    assert first.snapshot()["by_generation"]["2"]["count"] == before + 1


def test_frozen_objects_leave_the_collectors_walks_until_unfrozen():
    obj = _Cycle()
    ref = weakref.ref(obj)
    assert freeze_startup_heap() > 0
    del obj
    gc.collect()
    assert ref() is not None  # frozen: a cycle made before the freeze is not walked
    gc.unfreeze()
    gc.collect()
    assert ref() is None


@pytest.mark.gc_freeze
def test_settle_replica_freezes_only_when_configured():
    gc.unfreeze()
    assert settle_replica(freeze=False) is watched() and gc.get_freeze_count() == 0
    settle_replica(freeze=True)
    assert gc.get_freeze_count() > 0
