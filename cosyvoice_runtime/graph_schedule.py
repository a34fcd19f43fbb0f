"""Which CUDA graphs a replica captures before it serves, and the rest after, in the background.

Capturing every graph of a full-size CosyVoice2 replica is most of its start-up (hundreds of
token2wav graphs and dozens of the LLM's; how many and how long: docs/tuning.md "Cold start"), and
a replica that is not ready yet serves nobody: an autoscaler that adds one reacts that much later.
Most of those graphs serve batches a new replica does not see at first. So with
``graphs_before_ready: first`` the replica captures the graphs of batch bucket 1
(:func:`is_first`: what one stream at a time runs, the first request included) before it is ready,
and every other one in a background thread once it serves, the smallest batches first (those light
load meets next). Until a graph exists, its shape runs eagerly (the owner is ``deferred``: a call
of a shape not captured yet takes the eager path instead of capturing it on the serving thread)
and is counted as a graph miss.

The owners (:class:`~cosyvoice_runtime.graph_capture.GraphOwner` subclasses) take part through
``graph_keys()`` (every key they capture at start), ``capture_key(key)`` (one graph, safe beside
serving: under the owner's replay lock, or for the LLM runners with a warm-up on scratch buffers)
and ``deferred``. Nothing here imports torch: the scheduling is tested on the CPU with fake owners
(``tests/runtime/test_graph_schedule.py``).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

FIRST_BATCH = 1  # batch buckets up to this are captured before ready (graphs_before_ready: first)
# Owners whose graphs serve no streamed request of a fresh replica: the recomputed flow's passes
# (unstreamed requests, and streams whose incremental flow cache no longer fits) and the CV2
# vocoder's last-chunk lengths (a first utterance's last chunk may run eagerly once)
LATER_OWNERS = ("flow.stepper", "vocoder.last_chunks")
# The suffix of an owner's keys for calls longer than a replica captures before ready
# (``flow_graph_first_s``: flow_graph_owners), captured after: long answers are rare at first
LONG = ".long"


class Owner(Protocol):
    """What :class:`GraphSchedule` needs of a graph owner."""

    deferred: bool
    background_safe: bool  # False: its graphs are all captured before ready (e.g. a torch.compile'd step)

    def graph_keys(self) -> list[tuple]: ...

    def capture_key(self, key: tuple) -> None: ...


class KeyGroup:
    """Some of an owner's start-up keys under a name of their own (so a rule of their own applies):
    the CV2 vocoder's last-chunk lengths (``vocoder.last_chunks``)."""

    def __init__(self, owner: Owner, keys: Sequence[tuple]) -> None:
        self.owner = owner
        self.keys = list(keys)

    @property
    def background_safe(self) -> bool:
        return self.owner.background_safe

    @property
    def deferred(self) -> bool:
        return self.owner.deferred

    @deferred.setter
    def deferred(self, value: bool) -> None:
        self.owner.deferred = value

    def graph_keys(self) -> list[tuple]:
        return self.keys

    def capture_key(self, key: tuple) -> None:
        self.owner.capture_key(key)


def is_first(owner: str, key: tuple) -> bool:
    """Whether ``key`` (its batch bucket first) of ``owner`` is captured before ready (not a later
    owner, not a long call's)."""
    return owner not in LATER_OWNERS and not owner.endswith(LONG) and key[0] <= FIRST_BATCH


@dataclass(frozen=True)
class Task:
    owner: str
    key: tuple


class GraphSchedule:
    """The capture of one replica's graphs: some before ready (:meth:`capture_first`), the rest
    in a background thread (:meth:`start_background`).

    Args:
        owners: (name, owner) in the order their graphs of one batch bucket are captured.
        before_ready: "first" (:func:`is_first`'s before ready, the rest later) or "all".
        first: the predicate (tests pass their own).
        clock: seconds (tests pass a fake one).
    """

    def __init__(self, owners: Sequence[tuple[str, Owner]], before_ready: str = "first",
                 first: Callable[[str, tuple], bool] = is_first, clock: Callable[[], float] = time.perf_counter) -> None:
        if before_ready not in ("first", "all"):
            raise ValueError(f"graphs_before_ready must be 'first' or 'all', got {before_ready!r}")
        self.owners = dict(owners)
        self.before_ready = before_ready
        self.clock = clock
        self.first: list[Task] = []
        self.rest: list[Task] = []
        for i, (name, owner) in enumerate(owners):
            for key in owner.graph_keys():
                now = before_ready == "all" or not owner.background_safe or first(name, key)
                (self.first if now else self.rest).append(Task(name, key))
        order = {name: i for i, (name, _) in enumerate(owners)}
        # the smallest batches first, whichever owner: light load meets them next; long calls' last.
        # A capture holds its owner's replay lock, which a waiting replay need not get next: the
        # long calls' flow graphs at batch 1 first kept a fresh replica's first request waiting
        # 5 s behind 56 captures of the pass it needed (H100 2026-12-07, cold3)
        self.rest.sort(key=lambda t: (t.owner.endswith(LONG), t.key[0], order[t.owner]))
        self.captured = 0
        self.first_s: float | None = None
        # graphs and seconds of each owner before ready: what the start's graph phase is made of
        # (111 graphs took 9.8 s on one H100 and 15.6 s on another, 2026-12-07; which owner, unknown)
        self.first_by_owner: dict[str, tuple[int, float]] = {}
        self.background_s: float | None = None
        self.state = "pending" if self.rest else "done"  # of the background: pending, running, done, failed, stopped
        self.error: str | None = None
        self.done = threading.Event()
        if not self.rest:
            self.done.set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for _, owner in owners:  # a shape without its graph runs eagerly until the background captured it
            owner.deferred = False
        for task in self.rest:
            self.owners[task.owner].deferred = True

    @property
    def total(self) -> int:
        return len(self.first) + len(self.rest)

    def capture_first(self) -> int:
        """Capture the graphs needed before ready, here; how many."""
        started = at = self.clock()
        for task in self.first:
            self.owners[task.owner].capture_key(task.key)
            self.captured += 1
            now = self.clock()
            count, seconds = self.first_by_owner.get(task.owner, (0, 0.0))
            self.first_by_owner[task.owner] = (count + 1, seconds + now - at)
            at = now
        self.first_s = at - started
        if self.total:
            logger.info("captured %d of %d CUDA graphs before ready in %.1f s (%d left for the background)",
                        len(self.first), self.total, self.first_s, len(self.rest))
        return len(self.first)

    def start_background(self) -> None:
        """Capture the rest in a daemon thread (once the replica serves); no-op if nothing is left."""
        if self.state != "pending":
            return
        self.state = "running"
        self._thread = threading.Thread(target=self._run_background, name="graph-capture", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the background capture after the graph in progress (replica shutdown)."""
        self._stop.set()

    @property
    def busy(self) -> bool:
        """Whether the background capture is running (a caller may hold off device-wide work meanwhile)."""
        return self.state == "running"

    def _run_background(self) -> None:
        started = self.clock()
        try:
            for task in self.rest:
                if self._stop.is_set():
                    self.state = "stopped"
                    return
                self.owners[task.owner].capture_key(task.key)
                self.captured += 1
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            logger.exception("background CUDA graph capture failed after %d of %d graphs; the shapes left run "
                             "eagerly", self.captured, self.total)
        else:
            for owner in self.owners.values():  # every start-up shape has its graph: capture on first use again
                owner.deferred = False
            self.state = "done"
            logger.info("captured the %d remaining CUDA graphs in the background in %.1f s", len(self.rest),
                        self.clock() - started)
        finally:
            self.background_s = self.clock() - started
            self.done.set()

    def snapshot(self) -> dict[str, Any]:
        """Progress for ``/health`` and the replica's stats."""
        return {"before_ready": self.before_ready, "captured": self.captured, "total": self.total,
                "captured_before_ready": len(self.first), "background": self.state,
                "before_ready_s": _round(self.first_s), "background_s": _round(self.background_s),
                "before_ready_by_owner": {name: {"graphs": n, "s": _round(sec)}
                                          for name, (n, sec) in self.first_by_owner.items()},
                "error": self.error}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
