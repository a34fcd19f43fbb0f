"""Serve's count of RUNNING replicas of a deployment, read off the event loop for ``/health``.

``serve.status()`` is a blocking call to the Serve controller (a ``ray.get`` under the hood).
Made inline in a handler it would stall every stream of the ingress replica for as long as the
controller takes to answer (seconds when it is busy or restarting). Instead a background task
reads it in a worker thread every ``period_s`` and ``/health`` answers from the last count read,
never waiting on the control plane: before the first read lands the count is 0 ("unknown"), and
readiness then rests on the replicas' own health answers, as when the status is unavailable.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine

from ray import serve

logger = logging.getLogger(__name__)

STATUS_REFRESH_S = 2.0  # how often the background task asks Serve's controller
# A count not refreshed for this long (the controller hangs or is gone) is no longer trusted: 0.
STATUS_MAX_AGE_S = 30.0


def serve_running_replicas(deployment: str) -> int:
    """RUNNING replicas of ``deployment`` in this replica's application; 0 outside Serve or when the
    controller cannot say. Blocking (a controller round trip): call it off the event loop."""
    try:
        ctx = serve.get_replica_context()
        status = serve.status().applications[ctx.app_name].deployments[deployment]
        return int(status.replica_states.get("RUNNING", 0))
    except Exception:  # noqa: BLE001 - outside Serve or status unavailable
        return 0


class RunningReplicas:
    """The last count of running replicas of one deployment, kept fresh by a background task.

    Args:
        deployment: the deployment's name in this application.
        read: blocking reader of the count (default :func:`serve_running_replicas`); run in a
            worker thread, one read at a time.
        period_s: pause between reads.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, deployment: str, read: Callable[[str], int] = serve_running_replicas,
                 period_s: float = STATUS_REFRESH_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.deployment = deployment
        self._read = read
        self.period_s = period_s
        self._clock = clock
        self._count = 0
        self._read_at: float | None = None  # clock time of the last read that answered
        self.reads = 0  # reads that answered (tests wait on it through `refresh`)
        self._task: asyncio.Task | None = None

    def current(self) -> int:
        """The last count read (0 before the first or when older than ``STATUS_MAX_AGE_S``), and the
        background reader started on the running loop if it is not running. Never blocks."""
        self.start()
        if self._read_at is None or self._clock() - self._read_at > STATUS_MAX_AGE_S:
            return 0
        return self._count

    def start(self) -> None:
        """Start the background reader on the running event loop (no-op without one, or when it runs).

        A reader whose loop ended (each ``asyncio.run`` of a test) is done and gets replaced."""
        self._task = background_task(self._task, self._refresh_forever, f"running-replicas-{self.deployment}")

    async def refresh(self) -> int:
        """Read the count once now, in a worker thread, and keep it."""
        try:
            count = await asyncio.to_thread(self._read, self.deployment)
        except Exception:  # a reader that raises counts as "status unavailable"
            logger.warning("running replicas of %s unavailable", self.deployment, exc_info=True)
            count = 0
        self._count, self._read_at = int(count), self._clock()
        self.reads += 1
        return self._count

    async def _refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.period_s)  # a periodic refresh, not a wait on a condition


def background_task(task: asyncio.Task | None, make: Callable[[], Coroutine], name: str) -> asyncio.Task | None:
    """``task`` while it runs, else a new task of ``make()`` on the running loop; None without a
    running loop (constructed outside one: the first request starts it). A task whose loop ended
    (each ``asyncio.run`` of a test) is done and gets replaced."""
    if task is not None and not task.done():
        return task
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return task
    return loop.create_task(make(), name=name)
