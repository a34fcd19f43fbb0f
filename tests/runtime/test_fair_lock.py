"""cosyvoice_runtime.graph_capture.FairLock: a graph owner's lock goes to its waiters in order, so a
replay waits for the background capture in progress, not for every capture after it."""
from __future__ import annotations

import threading

import pytest

from cosyvoice_runtime.graph_capture import FairLock, GraphOwner

SPIN_GUARD = 10_000_000  # spins before a waiter that never queued fails the test (no clock involved)


def _until_waiting(lock: FairLock, n: int) -> None:
    for _ in range(SPIN_GUARD):
        if lock.waiting >= n:
            return
    pytest.fail(f"{n} waiter(s) never queued")


def test_a_waiter_gets_the_lock_before_its_holder_takes_it_again():
    """The background capture's pattern: release after one graph, acquire at once for the next."""
    lock, order = FairLock(), []
    lock.acquire()

    def replay():
        with lock:
            order.append("replay")

    thread = threading.Thread(target=replay)
    thread.start()
    _until_waiting(lock, 1)
    lock.release()
    with lock:  # the next capture queues behind the replay
        order.append("capture")
    thread.join()
    assert order == ["replay", "capture"] and lock.waiting == 0


def test_waiters_are_served_in_arrival_order_and_the_lock_ends_free():
    lock, order, threads = FairLock(), [], []
    lock.acquire()
    for name in "abc":
        thread = threading.Thread(target=lambda n=name: (lock.acquire(), order.append(n), lock.release()))
        thread.start()
        threads.append(thread)
        _until_waiting(lock, len(threads))
    lock.release()
    for thread in threads:
        thread.join()
    assert order == ["a", "b", "c"]
    lock.acquire()  # free again: no waiter left holding it
    lock.release()
    with pytest.raises(RuntimeError, match="unheld"):
        lock.release()


def test_every_graph_owner_takes_a_fair_lock_and_a_copy_gets_its_own():
    import copy

    owner = GraphOwner()
    twin = copy.deepcopy(owner)
    assert isinstance(owner._lock, FairLock) and isinstance(twin._lock, FairLock) and twin._lock is not owner._lock
