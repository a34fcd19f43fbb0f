"""Continuous-batching scheduler of the speech LM (pure Python, no torch).

Requests wait in FIFO order until a KV slot is free and the running batch has room; they are
then prefilled (one sequence per prefill) and join the decode batch on the next step. A finished
or aborted request gives its slot back at once, so a waiting request can be admitted in the
very next step.

A running request can be parked (a bistream request waiting for text): it keeps its slot but is
left out of the decode batch, and does not count as work (:meth:`Scheduler.has_unfinished`)
until it is unparked.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    request_id: str
    slot: int


@dataclass
class SchedulerOutput:
    """What to run in one engine step."""

    decode: list[ScheduledSeq] = field(default_factory=list)  # running, one new token each
    prefill: list[ScheduledSeq] = field(default_factory=list)  # admitted this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass
class _Entry:
    request_id: str
    num_positions: int  # prompt length + max new tokens: the KV room the request may need
    slot: int | None = None
    prefilled: bool = False
    parked: bool = False


class Scheduler:
    """Waiting/running queues over a fixed pool of KV slots.

    Args:
        num_slots: KV cache slots (= the largest decode batch).
        max_batch_size: cap on running sequences (<= num_slots).
        max_seq_len: positions per slot; a request needing more is refused at ``add``.
        max_prefills_per_step: sequences admitted per step, bounding a step's latency.
    """

    def __init__(self, num_slots: int, max_batch_size: int | None = None, max_seq_len: int | None = None,
                 max_prefills_per_step: int = 4) -> None:
        if num_slots < 1 or max_prefills_per_step < 1:
            raise ValueError(f"need >= 1 slot and prefill per step, got {num_slots}, {max_prefills_per_step}")
        self.num_slots = num_slots
        self.max_batch_size = min(max_batch_size or num_slots, num_slots)
        self.max_seq_len = max_seq_len
        self.max_prefills_per_step = max_prefills_per_step
        self._free_slots: deque[int] = deque(range(num_slots))
        self._entries: dict[str, _Entry] = {}
        self._waiting: deque[str] = deque()
        self._running: OrderedDict[str, _Entry] = OrderedDict()

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_parked(self) -> int:
        return sum(e.parked for e in self._running.values())

    @property
    def num_tracked(self) -> int:
        """Requests held in any state (waiting, running, parked): 0 once every one has ended."""
        return len(self._entries)

    def has_unfinished(self) -> bool:
        """Whether a step has work: a running request that is not parked, or a waiting one that
        can be admitted (while parked requests fill every slot, waiting ones wait for a slot)."""
        return any(not e.parked for e in self._running.values()) or self._can_admit()

    def _can_admit(self) -> bool:
        return bool(self._waiting and self._free_slots and len(self._running) < self.max_batch_size)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def slot_of(self, request_id: str) -> int | None:
        entry = self._entries.get(request_id)
        return None if entry is None else entry.slot

    # -- mutations -------------------------------------------------------------------------
    def add(self, request_id: str, num_positions: int) -> None:
        """Queue a request that may occupy up to ``num_positions`` KV positions.

        Raises:
            KeyError: the id is already queued or running.
            ValueError: it can never fit in a slot.
        """
        if request_id in self._entries:
            raise KeyError(f"request {request_id!r} is already scheduled")
        if self.max_seq_len is not None and num_positions > self.max_seq_len:
            raise ValueError(f"request {request_id!r} needs {num_positions} positions, slots hold {self.max_seq_len}")
        self._entries[request_id] = _Entry(request_id, num_positions)
        self._waiting.append(request_id)

    def schedule(self) -> SchedulerOutput:
        """Admit waiting requests into free slots and list this step's work."""
        out = SchedulerOutput(decode=[ScheduledSeq(e.request_id, e.slot) for e in self._running.values()
                                      if e.prefilled and not e.parked])
        while self._can_admit() and len(out.prefill) < self.max_prefills_per_step:
            entry = self._entries[self._waiting.popleft()]
            entry.slot = self._free_slots.popleft()
            self._running[entry.request_id] = entry
            out.prefill.append(ScheduledSeq(entry.request_id, entry.slot))
        return out

    def mark_prefilled(self, request_id: str) -> None:
        self._entries[request_id].prefilled = True

    def park(self, request_id: str) -> None:
        """Keep a running request's slot but leave it out of the steps until :meth:`unpark`."""
        self._entries[request_id].parked = True

    def unpark(self, request_id: str) -> None:
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.parked = False

    def finish(self, request_id: str) -> bool:
        """Remove a request (finished or aborted) and free its slot; False if unknown."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return False
        if entry.slot is None:
            self._waiting.remove(request_id)
        else:
            del self._running[request_id]
            self._free_slots.append(entry.slot)
        return True

    abort = finish
