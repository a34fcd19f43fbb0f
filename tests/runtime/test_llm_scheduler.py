"""Slot scheduler: admission order, batch cap, slot reuse, abort."""
from __future__ import annotations

import pytest

from cosyvoice_runtime.llm.scheduler import Scheduler


def ids(seqs):
    return [(s.request_id, s.slot) for s in seqs]


def test_fifo_admission_batch_cap_and_slot_reuse():
    sch = Scheduler(num_slots=2, max_seq_len=100, max_prefills_per_step=4)
    for rid in "abc":
        sch.add(rid, 10)
    out = sch.schedule()
    assert ids(out.prefill) == [("a", 0), ("b", 1)] and out.decode == []
    for rid in "ab":
        sch.mark_prefilled(rid)
    out = sch.schedule()
    assert ids(out.decode) == [("a", 0), ("b", 1)] and out.prefill == []
    assert sch.num_waiting == 1 and sch.num_free_slots == 0
    assert sch.finish("a")
    out = sch.schedule()
    assert ids(out.decode) == [("b", 1)] and ids(out.prefill) == [("c", 0)]
    assert sch.slot_of("c") == 0 and sch.has_unfinished()


def test_prefill_budget_and_max_batch_size():
    sch = Scheduler(num_slots=8, max_batch_size=3, max_prefills_per_step=2)
    for i in range(5):
        sch.add(f"r{i}", 4)
    assert len(sch.schedule().prefill) == 2
    assert len(sch.schedule().prefill) == 1  # batch cap 3 reached
    assert sch.schedule().prefill == [] and sch.num_waiting == 2


def test_abort_waiting_and_running_and_refusals():
    sch = Scheduler(num_slots=1, max_seq_len=10)
    sch.add("run", 5)
    sch.add("wait", 5)
    sch.schedule()
    assert sch.abort("wait") and sch.num_waiting == 0
    assert sch.abort("run") and sch.num_free_slots == 1 and not sch.has_unfinished()
    assert not sch.abort("run")
    with pytest.raises(ValueError):
        sch.add("big", 11)
    sch.add("x", 3)
    with pytest.raises(KeyError):
        sch.add("x", 3)


def test_parked_request_keeps_its_slot_without_work():
    s = Scheduler(num_slots=1, max_prefills_per_step=1)
    s.add("b", 10)
    s.add("w", 10)
    assert [q.request_id for q in s.schedule().prefill] == ["b"]
    s.mark_prefilled("b")
    s.park("b")
    # the slot is held, the waiting request cannot be admitted: no work, so a driver sleeps
    assert s.num_parked == 1 and s.num_free_slots == 0 and not s.has_unfinished()
    assert s.schedule().empty
    s.unpark("b")
    assert s.has_unfinished() and [q.request_id for q in s.schedule().decode] == ["b"]
    s.park("b")
    s.finish("b")
    assert s.num_parked == 0 and s.has_unfinished()  # the slot is free again: "w" can be admitted
    s.unpark("gone")  # unknown ids are ignored (a request that ended meanwhile)
