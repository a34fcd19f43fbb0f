"""Continuous batching: one step thread per replica drives the token engine.

Request coroutines call :meth:`EngineLoop.generate`; it registers a per-request
:class:`Mailbox` and queues the request. The loop's step thread alternates between (a) applying
pending adds/aborts and (b) one ``engine.step()``, both on the engine's lane (the compute
executor's main lane; on a GPU replica the step thread itself, see ``__init__``), and hands each
step's tokens to the event loop (``call_soon_threadsafe``), which drops them into the mailboxes.
New requests therefore join the running batch between two decode steps, finished ones
leave at once, and a consumer that goes away (client disconnect -> ``CancelledError`` or
``GeneratorExit``) aborts its sequence in ``finally``, which frees its decode slot before the
next step. The engine is touched only from that one lane, never concurrently, so it needs no
locks; the pending adds/aborts are the only state both threads touch (a lock).

Why a thread and not an asyncio task: with a task, the next step was submitted only once the
event loop got round to the task again, after whatever else was ready (every stream's chunk
work, ``@serve.batch``, response chunks), so the serving layer's own cost was added to every
decode step. The thread submits the next step at once; the token hand-over runs on the event
loop meanwhile. What remains is mostly the GIL: the step's own Python work waits while the event
loop thread holds it (the readings, with ``bench/measure_loop.py``: docs/serving.md, "Event-loop cost
per decode step").

The per-request :class:`~deployments.engine_mailbox.Mailbox` (woken once per chunk, not per step)
and giving way to token2wav (:class:`~deployments.engine_mailbox.GiveWay`) are described in
:mod:`deployments.engine_mailbox`.

Bistream requests (:class:`~cosyvoice_runtime.lm_messages.BistreamLMRequest`) come with their text as
an async iterator (``generate(..., text=...)``): a feeder task per request queues each arrival
like an add, the step thread hands it to the engine (``feed_text``) before its next step. A
bistream request waiting for text is parked in the engine and is no work, so an idle step
thread sleeps on ``_work`` until the text comes.

Failure isolation: an error in one request fails that request only.

* The engine names a request it cannot go on with (a :class:`TokenEvent` with ``error``, e.g.
  non-finite logits): that request fails with :class:`RequestFailedError`, the others go on.
* A step that raises is retried once (a transient fault, e.g. CUDA out of memory); if it raises
  again, the newest request in the engine is the suspect (its prefill is the step's new work):
  it is aborted and fails, and the step is tried again, until a step succeeds. This can fail a
  request that was not the culprit (at most the running batch), never the replica.
* A fault that leaves the device unusable (:func:`is_fatal`: a sticky CUDA error), or steps that
  still fail after as many suspects as the batch holds were removed, stop the loop: every open request fails with
  :class:`EngineDeadError` (a clean error at the client, never silence) and ``check_health``
  raises, so Serve replaces the replica.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from cosyvoice_runtime.lm_messages import BistreamLMRequest, LMRequest, TokenEvent
from deployments.compute import MAIN, ComputeExecutor
from deployments.engine_mailbox import GiveWay, Mailbox, latest_start, need_by
from deployments.protocol import EngineDeadError, EngineStats, RequestFailedError
from deployments.runtime_protocol import TokenEngine
from deployments.thread_load import retire_thread

logger = logging.getLogger(__name__)

TextSource = AsyncIterator[tuple[list[int], bool]]  # a bistream request's text: (ids, ended) as it arrives
IDLE_EXIT_S = 5.0  # an idle step thread ends after this long (no thread per idle EngineLoop in tests)
STEP_RETRIES = 1  # a failed step is tried again this many times before a suspect is removed


def is_fatal(exc: BaseException) -> bool:
    """A fault after which the device cannot be trusted (CUDA reports errors such as an illegal
    memory access or a device-side assert as sticky: every later call fails too). CUDA out of memory
    is not one (``torch.cuda.OutOfMemoryError`` says "CUDA out of memory")."""
    return not isinstance(exc, Exception) or "CUDA error" in str(exc)


class EngineLoop:
    """Owns the engine of one replica; see the module docstring."""

    def __init__(self, engine: TokenEngine, compute: ComputeExecutor, lane: str | None = MAIN,
                 give_way: GiveWay | None = None) -> None:
        """``lane``: where the engine's calls run; None = on the step thread itself, for a
        replica whose token2wav has a lane of its own (GPU), which saves two thread hand-overs
        per step; with one lane (CPU) the main lane serialises steps with token2wav batches.
        ``give_way``: hold steps while token2wav has a job due (module docstring); None: never."""
        self.engine = engine
        self.compute = compute
        self._lane = lane
        self._give_way = give_way
        # under _lock: (when its next chunk is due, tokens it still lacks) of each consumer waiting for tokens
        self._due: dict[str, tuple[float, float]] = {}
        self._step_s = 0.0  # step thread only: recent decode step time on the GiveWay clock (moving average)
        self.gave_way = 0  # waits of the step thread for token2wav (give_way)
        self._boxes: dict[str, Mailbox] = {}  # event loop only
        self._lock = threading.Lock()  # guards the pending collections and _due (event loop <-> step thread)
        self._pending_adds: dict[str, LMRequest | BistreamLMRequest] = {}
        self._pending_aborts: set[str] = set()
        self._pending_feeds: dict[str, list[tuple[list[int], bool]]] = {}  # bistream text, in arrival order
        self._work = threading.Event()  # set when there is something for an idle step thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._dead: BaseException | None = None
        self._live: OrderedDict[str, None] = OrderedDict()  # step thread only: requests in the engine, oldest first
        self._step_failures = 0  # consecutive failed steps (step thread only)
        self._removed_in_a_row = 0  # suspects removed since the last step that succeeded (step thread only)
        self.steps = 0
        self.aborted = 0
        self.finished = 0
        self.failed = 0  # requests failed alone (their error, or suspects of a failing step)
        self.tokens = 0  # speech tokens delivered (tokens/s = rate of this counter)
        self.step_batch_sizes: list[int] = []  # sequences per step (bounded, see _record)

    # ---------------------------------------------------------------- request side
    async def generate(self, request_id: str, request: LMRequest | BistreamLMRequest,
                       need: Callable[[], int | None] | None = None, text: TextSource | None = None,
                       on_first_token: Callable[[], None] | None = None,
                       due: Callable[[], float] | None = None) -> AsyncIterator[TokenEvent]:
        """Yield this request's tokens until it finishes; abort it if abandoned.

        ``need``: how many tokens in all the consumer can use next (None from it: nothing before
        the end); each yielded event carries every token since the previous one. Without
        ``need``, an event whenever tokens arrived (one or more steps' worth). ``text``: the
        text of a bistream request (required for one, refused for others); an error while
        reading it fails the request. ``on_first_token``: called once, on the event loop, when
        the first token arrives (the consumer may sleep until ``need`` is met; stage timing).
        ``due``: when the consumer's next chunk is due to play, read whenever it starts waiting
        for tokens (for :class:`GiveWay`; without it the consumer counts as due at once).
        """
        if (text is not None) != isinstance(request, BistreamLMRequest):
            raise ValueError("a bistream request needs its text source, and only a bistream request takes one")
        self.raise_if_dead()
        if request_id in self._boxes:
            raise ValueError(f"duplicate request id {request_id}")
        box = Mailbox(need, on_first_token)
        self._boxes[request_id] = box
        # The loop of the newest request gets the hand-overs (tests run one EngineLoop under
        # several asyncio.run calls; a replica has one event loop).
        self._loop = asyncio.get_running_loop()
        with self._lock:
            self._pending_adds[request_id] = request
            self._due[request_id] = need_by(box, due)
            self._ensure_running()
        self._work.set()
        feeder = asyncio.ensure_future(self._feed(request_id, text, box)) if text is not None else None
        done = False
        try:
            while True:
                if not box.ready():
                    if self._give_way is not None:
                        with self._lock:
                            self._due[request_id] = need_by(box, due)
                        self._work.set()  # a held step thread looks again
                    box.waiter = asyncio.get_running_loop().create_future()
                    await box.waiter
                    box.waiter = None
                with self._lock:
                    self._due.pop(request_id, None)  # busy with its tokens: not waiting
                if box.error is not None:
                    done = True
                    raise box.error
                event = box.take(request_id)
                done = event.finished
                yield event
                if done:
                    return
        finally:
            if feeder is not None:
                feeder.cancel()
            self._boxes.pop(request_id, None)
            with self._lock:
                self._due.pop(request_id, None)
            if not done:
                # Abandoned (cancelled, closed, or the consumer raised): free the slot.
                with self._lock:
                    if self._pending_adds.pop(request_id, None) is None:
                        self._pending_aborts.add(request_id)
                self._work.set()
                self.aborted += 1

    async def _feed(self, request_id: str, text: TextSource, box: Mailbox) -> None:
        """A bistream request's text, handed to the step thread as it arrives."""
        try:
            async for ids, ended in text:
                with self._lock:
                    self._pending_feeds.setdefault(request_id, []).append((ids, ended))
                    self._ensure_running()
                self._work.set()
                if ended:
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the text source failed (timeout, inbox gone): this request fails
            box.fail(exc)

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.engine.num_running(), waiting=self.engine.num_waiting() + self._num_pending_adds(),
            open_streams=len(self._boxes), max_running=self.engine.max_running, steps=self.steps,
            aborted=self.aborted, finished=self.finished,
        )

    def open_entries(self) -> dict[str, int]:
        """Sizes of the loop's per-request bookkeeping, back to 0 once every request has ended
        (the step sizes are bounded: :meth:`_record`); for leak probes."""
        with self._lock:
            pending = {"loop_pending_adds": len(self._pending_adds), "loop_pending_aborts": len(self._pending_aborts),
                       "loop_pending_feeds": len(self._pending_feeds), "loop_due": len(self._due)}
        return {"loop_mailboxes": len(self._boxes), "loop_live": len(self._live), **pending,
                "step_batch_sizes": len(self.step_batch_sizes)}

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def raise_if_dead(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine loop stopped: {type(self._dead).__name__}: {self._dead}")

    def _num_pending_adds(self) -> int:
        with self._lock:
            return len(self._pending_adds)

    # ---------------------------------------------------------------- step thread
    def _ensure_running(self) -> None:
        """With the lock held: start the step thread unless one is running (it clears
        ``_thread`` under the lock when it ends idle, so a request queued now is never missed)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._drive, name="engine-step", daemon=True)
            self._thread.start()

    def _apply(self, aborts: set[str], adds: dict, feeds: dict[str, list[tuple[list[int], bool]]]) -> dict[str, Exception]:
        """On the engine's lane: aborts first (frees slots), then adds, then bistream text;
        per-request failures returned."""
        for request_id in aborts:
            self.engine.abort(request_id)
            self._live.pop(request_id, None)
        failed: dict[str, Exception] = {}
        for request_id, request in adds.items():
            try:
                if isinstance(request, BistreamLMRequest):
                    self.engine.add_bistream(request_id, request)
                else:
                    self.engine.add(request_id, request)
            except Exception as exc:  # noqa: BLE001 - bad input for this request only: its consumer gets the error
                failed[request_id] = exc
            else:
                self._live[request_id] = None
        for request_id, arrivals in feeds.items():
            if request_id in failed or request_id in aborts:
                continue
            try:
                for ids, ended in arrivals:  # False: the request ended meanwhile; its text is moot
                    self.engine.feed_text(request_id, ids, ended)
            except Exception as exc:  # noqa: BLE001 - bad text for this request only
                failed[request_id] = exc
        return failed

    def _drive(self) -> None:
        """The step thread: adds/aborts, then a step, until closed or the engine breaks."""
        try:
            while not self._closed:
                with self._lock:
                    aborts, self._pending_aborts = self._pending_aborts, set()
                    adds, self._pending_adds = self._pending_adds, {}
                    feeds, self._pending_feeds = self._pending_feeds, {}
                if aborts or adds or feeds:
                    # NOTE: building a request's prefill input touches the device, so adds run where
                    # steps do. A consumer cancelled while its add is in flight is no longer
                    # pending; its finally queues an abort for the next round.
                    failed = self.compute.call(self._apply, aborts, adds, feeds, lane=self._lane)
                    if failed:
                        self._post(self._fail_adds, failed)
                if not self.engine.has_unfinished():
                    if self._idle_too_long():
                        return
                    continue
                if self._give_way is not None and self._held():
                    continue  # adds, aborts and text that came meanwhile first, then look again
                try:
                    events = self._step()
                except Exception as exc:
                    if self._closed or is_fatal(exc):
                        raise
                    self._isolate(exc)
                    continue
                self._step_failures = self._removed_in_a_row = 0
                for event in events:
                    if event.finished:
                        self._live.pop(event.request_id, None)
                self._post(self._deliver, events)
        except BaseException as exc:  # the engine is broken: fail every open request, mark unhealthy
            if self._closed:  # the executor was shut down under a closing replica
                return
            logger.exception("engine loop crashed")
            self._dead = exc  # before the hand-over: generate() must not queue behind a dead thread
            self._post(self._fail_all, exc)
        finally:
            retire_thread()  # its CPU seconds stay in the replica's thread readings

    def _isolate(self, exc: Exception) -> None:
        """A step raised (not fatally): retry it, then remove suspects newest first (module docstring)."""
        self._step_failures += 1
        if self._step_failures <= STEP_RETRIES:
            logger.warning("engine step failed (%s: %s); trying it again", type(exc).__name__, exc)
            return
        if not self._live or self._removed_in_a_row >= self.engine.max_running:
            raise exc  # no suspect left, or every request of a full batch removed and it still fails: broken
        suspect, _ = self._live.popitem()
        self._removed_in_a_row += 1
        logger.warning("engine step failed again (%s: %s); removing the newest request %s",
                       type(exc).__name__, exc, suspect)
        self.compute.call(self.engine.abort, suspect, lane=self._lane)
        self._step_failures = 0
        error = RequestFailedError(f"speech token generation failed: {type(exc).__name__}: {exc}")
        self._post(self._fail_one, (suspect, error))

    def _step(self) -> list[TokenEvent]:
        """One engine step on its lane; with a :class:`GiveWay`, its time joins the average."""
        if self._give_way is None:
            return self.compute.call(self.engine.step, lane=self._lane)
        started = self._give_way.clock()
        events = self.compute.call(self.engine.step, lane=self._lane)
        took = self._give_way.clock() - started
        self._step_s = took if self._step_s == 0.0 else 0.9 * self._step_s + 0.1 * took
        return events

    def _held(self) -> bool:
        """Whether the step thread waited for token2wav instead of stepping (:class:`GiveWay`)."""
        gw = self._give_way
        self._work.clear()  # before the checks: work or a wake() after them ends the wait
        with self._lock:
            if self._has_pending() or self._closed:
                return False
            latest = latest_start(self._due.values(), self._step_s)
        if latest - gw.clock() < gw.slack_s or not gw.overdue():
            return False
        self.gave_way += 1
        gw.wait(self._work, gw.max_s)
        return True

    def wake(self) -> None:
        """From any thread: token2wav's due jobs are done; a held step thread looks again."""
        self._work.set()

    def _has_pending(self) -> bool:
        """With the lock held: adds, aborts or bistream text wait for the step thread."""
        return bool(self._pending_adds or self._pending_aborts or self._pending_feeds)

    def _idle_too_long(self) -> bool:
        """Nothing to step: wait for work. True when none came within IDLE_EXIT_S and the thread
        has ended itself (``_thread`` cleared under the lock: the next request starts a new one)."""
        self._work.clear()
        with self._lock:  # a request queued after the swap in _drive set _work before or after clear
            if self._has_pending():
                return False
        if self._closed or self._work.wait(IDLE_EXIT_S):
            return False
        with self._lock:
            if self._has_pending():
                return False
            self._thread = None
            return True

    def _post(self, fn, arg) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # that event loop is closed: its requests and mailboxes are gone too
            pass

    # ---------------------------------------------------------------- event loop side
    def _deliver(self, events: list[TokenEvent]) -> None:
        self.steps += 1
        self._record(len(events))  # sequences advanced by this step (decode batch + prefills)
        for event in events:
            self.tokens += len(event.tokens)
            if event.error is not None:
                self.failed += 1
            elif event.finished:
                self.finished += 1
            box = self._boxes.get(event.request_id)
            if box is not None:
                box.put(event)

    def _fail_adds(self, failed: dict[str, Exception]) -> None:
        for request_id, exc in failed.items():
            box = self._boxes.get(request_id)
            if box is not None:
                box.fail(exc)

    def _fail_one(self, failure: tuple[str, Exception]) -> None:
        request_id, exc = failure
        self.failed += 1
        box = self._boxes.get(request_id)
        if box is not None:
            box.fail(exc)

    def _fail_all(self, exc: BaseException) -> None:
        dead = EngineDeadError(f"engine loop stopped: {type(exc).__name__}")
        for box in self._boxes.values():
            box.fail(dead)

    def _record(self, size: int) -> None:
        self.step_batch_sizes.append(size)
        if len(self.step_batch_sizes) > 4096:
            del self.step_batch_sizes[:2048]

    def kill(self, exc: BaseException) -> None:
        """On the event loop: the replica broke outside the engine (a fatal token2wav fault): fail
        every open request, refuse new ones (``check_health`` raises), end the step thread."""
        if self._dead is None:
            self._dead = exc
        self._fail_all(exc)
        self.stop()

    def stop(self) -> None:
        """Ask the step thread to end after its current call (no wait; safe from ``__del__``)."""
        self._closed = True
        self._work.set()

    async def close(self) -> None:
        """Stop the step thread and wait until it has ended."""
        self.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
