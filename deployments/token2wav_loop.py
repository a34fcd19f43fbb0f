"""Token2wav solved pass by pass, most urgent first (``token2wav.scheduler: steps``, issue 14).

With ``@serve.batch`` a flow batch is one whole solve (ten estimator passes): a new stream's
first chunk that arrives while a batch with a late chunk of a long CosyVoice2 utterance runs
waits for all of it. Here every chunk job becomes a flow row
(:mod:`cosyvoice_runtime.flow.stepper`) and one driver thread, on the replica's token2wav lane,
repeats: start the jobs that arrived (one encoder batch), run one pass over the rows
:func:`~cosyvoice_runtime.stream_schedule.pick_rows` picks (earliest playback deadline first; a
first chunk is due at once), queue the vocoder for the rows whose solve is done (the wait for
their audio runs in the event loop's executor, which hands it back: the driver does not wait for
the GPU there). A first chunk joins at the next pass and long jobs with audio to spare wait,
which raised the sessions at the SLO in the benchmark's replica simulation (docs/tuning.md §2,
``scheduler``).
The runtime keeps ``token2wav.passes_in_flight`` passes queued on the GPU (default 2): the next
pass is picked and prepared while one runs, so the "next pass" a new job joins starts after the
one queued now, which still lowered first audio against 1 (docs/tuning.md, ``passes_in_flight``).

A pass runs as soon as rows are in hand: holding passes of rows with slack for more streams' rows
to share them did not fill the passes (the rows left out are urgent rows' longer neighbours,
kept out by design) and was removed (docs/tuning.md §2, ``gather_ms``).

:meth:`SteppedToken2Wav.overdue` tells the LLM's step thread whether a job in hand is due already
(``token2wav.give_way_ms``, :class:`~deployments.engine_loop.GiveWay`); ``on_rows_left`` wakes it
when rows leave.

Failure isolation as the batch path's: a step that raises is retried per job, a job that fails
alone fails its request only (:class:`RequestFailedError`), a fatal device error kills the
replica through ``on_fatal``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cosyvoice_runtime.stream_schedule import pick_rows
from deployments.compute import ComputeExecutor
from deployments.engine_loop import is_fatal
from deployments.protocol import EngineDeadError, RequestFailedError

logger = logging.getLogger(__name__)

LENGTH_RATIO = 2.0  # a pass pads to at most this many times the frames of its most urgent row


@dataclass(eq=False)
class _Pending:
    job: Any
    deadline_s: float
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    marks: dict[str, float] | None = None  # TOKEN2WAV_MARKS stamped here, on the clock (first stamp kept)
    row: Any = None


class SteppedToken2Wav:
    """Chunk jobs in (:meth:`run`), audio out; see the module docstring.

    Args:
        t2w: the runtime's token2wav with ``start_solves`` / ``advance`` / ``finish`` / ``n_steps``.
        compute: the replica's executor; the driver runs on ``lane`` while there is work.
        clock: the clock deadlines are read on (the synthesizer's).
        slack_s: rows due within this many seconds have the pass to themselves (and short riders).
        max_batch: rows per pass and jobs per encoder batch.
        on_fatal: called with a fatal device error (the synthesizer marks the replica dead).
        on_rows_left: called whenever rows leave (solved, failed or abandoned) or a solved job's
            audio is back (any thread): what may end an LLM wait for an overdue job.
        rider_ratio: riders of an urgent pass may have up to this many times the urgent rows'
            frames (:func:`~cosyvoice_runtime.stream_schedule.pick_rows`).
    """

    def __init__(self, t2w, compute: ComputeExecutor, lane: str, clock: Callable[[], float], slack_s: float,
                 max_batch: int, on_fatal: Callable[[BaseException], None],
                 on_rows_left: Callable[[], None] | None = None, rider_ratio: float = 1.0) -> None:
        self.t2w = t2w
        self.compute = compute
        self.lane = lane
        self.clock = clock
        self.slack_s = slack_s
        self.max_batch = max_batch
        self.on_fatal = on_fatal
        self._lock = threading.Lock()
        self._new: list[_Pending] = []
        self._rows: list[_Pending] = []  # driver thread only; replaced through _set_rows
        self._first_due = math.inf  # under _lock: the earliest deadline among _rows
        self._collecting: list[_Pending] = []  # under _lock: solved jobs whose audio is on its way back
        self.on_rows_left = on_rows_left
        self.rider_ratio = rider_ratio
        self._running = False
        self._driver: asyncio.Future | None = None
        self.passes = 0
        self.rows_in_passes = 0
        self.rows_ready = 0  # rows in hand when each pass was picked: above rows_in_passes, pick_rows split them
        self.failed_jobs = 0

    async def run(self, job: Any, deadline_s: float, marks: dict[str, float] | None = None) -> np.ndarray | Exception:
        """The audio of ``job`` (due at ``deadline_s`` on the clock), or the error it failed with alone.
        ``marks``: where the driver stamps :data:`~deployments.protocol.TOKEN2WAV_MARKS` (setdefault:
        a request's first job keeps them)."""
        loop = asyncio.get_running_loop()
        pending = _Pending(job, deadline_s, loop, loop.create_future(), marks)
        with self._lock:
            self._new.append(pending)
            start = not self._running
            self._running = True
        if start:
            self._driver = asyncio.ensure_future(self.compute.run(self._drive, lane=self.lane))
        return await pending.future  # cancelled with its request: the driver drops the row

    def overdue(self) -> bool:
        """From any thread: whether a job in hand (arrived or being solved) is due already."""
        now = self.clock()
        with self._lock:
            return self._first_due <= now or any(p.deadline_s <= now for p in (*self._new, *self._collecting))

    # -- driver thread ---------------------------------------------------------------------
    def _set_rows(self, rows: list[_Pending]) -> None:
        left = len(rows) < len(self._rows)
        with self._lock:
            self._rows = rows
            self._first_due = min((p.deadline_s for p in rows), default=math.inf)
        if left and self.on_rows_left is not None:
            self.on_rows_left()

    def _drive(self) -> None:
        try:
            while True:
                with self._lock:
                    new, self._new = self._new, []
                    if not new and not self._rows:
                        self._running = False
                        return
                for start in range(0, len(new), self.max_batch):
                    self._isolated(self._start, new[start:start + self.max_batch])
                self._set_rows([p for p in self._rows if not p.future.cancelled()])
                if self._rows:
                    self._pass()
        except BaseException as exc:  # fatal (on_fatal was called) or a bug: fail everything in hand
            if not is_fatal(exc):
                logger.exception("token2wav driver failed")
            with self._lock:
                hand, self._new, self._rows = self._new + self._rows, [], []
                self._first_due = math.inf
                self._running = False
            for p in hand:
                self._resolve(p, EngineDeadError(f"token2wav failed: {type(exc).__name__}"))

    def _start(self, batch: list[_Pending]) -> None:
        now = self.clock()  # taken in: what follows (the encoder batch) is the solve's
        rows = self.t2w.start_solves([p.job for p in batch])
        for p, row in zip(batch, rows):
            p.row = row
            if p.marks is not None:
                p.marks.setdefault("t2w_started", now)
        self._set_rows(self._rows + batch)

    def _pass(self) -> None:
        by_row = {id(p.row): p for p in self._rows}
        rows = pick_rows([p.row for p in self._rows], {k: p.deadline_s for k, p in by_row.items()}, self.clock(),
                         self.slack_s, self.max_batch, LENGTH_RATIO, self.rider_ratio)
        # rows advance only when their pass succeeded, so a retry is exact
        self._isolated(lambda part: self.t2w.advance([p.row for p in part]), [by_row[id(r)] for r in rows])
        self.passes += 1
        self.rows_in_passes += len(rows)
        self.rows_ready += len(by_row)
        done = [p for p in self._rows if p.row.step >= self.t2w.n_steps]
        if done:
            self._isolated(self._finish, done)  # takes the done rows out (failed ones too)

    def _finish(self, done: list[_Pending]) -> None:
        """Queue the vocoder for solved rows and hand the wait for their audio to the event loop's
        executor: the driver goes on with new jobs and passes meanwhile."""
        collect = self.t2w.finish([p.row for p in done])
        with self._lock:  # overdue until their audio is back: the vocoder runs meanwhile
            self._collecting += done
        self._set_rows([p for p in self._rows if p not in done])
        for loop in {p.loop for p in done}:  # the replica's one event loop (tests may run several)
            loop.call_soon_threadsafe(self._collect, loop, collect, done)

    def _collect(self, loop: asyncio.AbstractEventLoop, collect: Callable[[], list], done: list[_Pending]) -> None:
        """On the event loop: wait for ``collect`` in the default executor, then deliver."""
        loop.run_in_executor(None, collect).add_done_callback(lambda f: self._deliver(f, done, loop))

    def _deliver(self, collected: asyncio.Future, done: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: the audio of its jobs of ``done`` (or the error of the wait for it)."""
        with self._lock:
            self._collecting = [p for p in self._collecting if p not in done or p.loop is not loop]
        if self.on_rows_left is not None:
            self.on_rows_left()
        now = self.clock()
        exc = collected.exception()
        if exc is not None:  # the copy back failed: a device fault (fatal) or the batch's own error
            mine = sum(p.loop is loop for p in done)
            logger.warning("token2wav audio of %d jobs failed (%s: %s)", mine, type(exc).__name__, exc)
            self.failed_jobs += mine
            if is_fatal(exc):
                self.on_fatal(exc)
            error = (EngineDeadError if is_fatal(exc) else RequestFailedError)(
                f"audio generation failed: {type(exc).__name__}: {exc}")
        for p, audio in zip(done, collected.result() if exc is None else [error] * len(done)):
            if p.loop is not loop:
                continue
            if p.marks is not None:
                p.marks.setdefault("t2w_solved", now)
            if not p.future.done():
                p.future.set_result(audio)

    def _isolated(self, step: Callable[[list[_Pending]], None], batch: list[_Pending]) -> None:
        """``step(batch)``. On a model error: a fatal one goes up (the replica is dead); otherwise
        each job is retried alone and one that fails alone fails its request. Retries are exact:
        a pass advances rows only when it succeeded, and ``Token2Wav.finish`` puts the stream
        states back if it raises."""
        try:
            step(batch)
        except Exception as exc:  # any model error: isolated per job
            if is_fatal(exc):
                logger.exception("token2wav failed fatally; the replica is unhealthy")
                self.on_fatal(exc)
                raise
            if len(batch) > 1:
                logger.warning("token2wav step over %d jobs failed (%s); retrying them one by one", len(batch),
                               type(exc).__name__)
                for p in batch:
                    self._isolated(step, [p])
                return
            p = batch[0]
            self.failed_jobs += 1
            logger.warning("token2wav failed for one job (%s: %s); failing its request", type(exc).__name__, exc)
            self._set_rows([q for q in self._rows if q is not p])
            self._resolve(p, RequestFailedError(f"audio generation failed: {type(exc).__name__}: {exc}"))

    @staticmethod
    def _resolve(p: _Pending, result: np.ndarray | Exception) -> None:
        def deliver():
            if not p.future.done():
                p.future.set_result(result)
        p.loop.call_soon_threadsafe(deliver)
