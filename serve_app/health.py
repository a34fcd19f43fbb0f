"""``GET /health``: a status kept fresh by one background task, and the live probe behind a key.

Anonymous ``GET /health`` answers from the last status a background task of the ingress replica
computed (every ``ingress.health_refresh_s``): ``{"status": "ok" | "degraded" | "unavailable", ...}``
with counts only, 503 when unavailable. It makes no handle call, so a flood of health calls takes
no synthesizer or frontend slot, adds nothing to the queue lengths Serve's autoscaling policy reads
(``total_num_requests`` counts handle calls in flight) and answers from memory while the replicas
are saturated. Before, every call sent 2 probes per running synthesizer replica, up to 4 rounds, and
a frontend ping: anonymous callers could push real requests into 429s and the fleet into scale-out.

``GET /health?detail=1`` runs the probe now and answers every replica's detail (device, GPU memory,
engine occupancy, mode, what it loaded). With keys configured it needs a ``metrics`` or ``admin``
key (serve_app/auth.py, ``auth.health_details``); concurrent detail calls share one probe in flight,
so even an allowed caller costs at most one probe at a time.

The probe: synthesizer replicas are reached through the handle, which routes each call to a replica
of its choice, so one round of 2 probes per replica can miss one (2 replicas, 4 probes: 1 in 8 when
idle); another round is sent only while every probe of the last one was answered (a failed probe
means busy replicas). Probes queue behind synthesis work: under overload they fail, and a replica
heard from within ``HEALTH_MEMORY_S`` but not reached now is kept with its last answer and age;
readiness then rests on Serve's own count of running replicas (its controller health-checks them
outside the request queue), so a busy service is not reported down. The frontend counts as ready
when a replica answers (its status also says whether the voice store accepts writes: a read-only
store makes the status ``degraded``) or Serve counts a
running one; without that check a service whose frontend was still loading said ready.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from deployments.protocol import ReplicaHealth
from serve_app.running_replicas import RunningReplicas, background_task

logger = logging.getLogger(__name__)

HEALTH_MEMORY_S = 60.0  # how long a replica's last answer is kept when probes cannot reach it
HEALTH_PROBE_ROUNDS = 4  # idle misses compound to (1/8)^4 for 2 replicas
DETAIL_PARAM = "detail"
_TRUE = frozenset({"1", "true", "yes", "on", ""})


def wants_detail(query_string: bytes | str) -> bool:
    """Whether a ``/health`` query asks for the detailed probe (``?detail``, ``?detail=1``, ...)."""
    from urllib.parse import parse_qs

    text = query_string.decode("latin-1") if isinstance(query_string, bytes) else query_string
    values = parse_qs(text, keep_blank_values=True).get(DETAIL_PARAM)
    return bool(values) and values[-1].strip().lower() in _TRUE


class HealthMonitor:
    """The ingress replica's view of the synthesizer and frontend replicas.

    Args:
        synth, frontend: deployment handles (or in-process stand-ins).
        timeout_s: how long one probe call may take.
        refresh_s: pause between background probes.
        clock: monotonic clock (tests pass a fake one).
    """

    def __init__(self, synth: Any, frontend: Any, timeout_s: float, refresh_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.synth, self.frontend = synth, frontend
        self.timeout_s, self.refresh_s = timeout_s, refresh_s
        self._clock = clock
        # Serve's running counts, read off the event loop by their own background readers.
        self.running_synthesizers = RunningReplicas("Synthesizer")
        self.running_frontends = RunningReplicas("TextFrontend")
        self._memory: dict[str, tuple[float, dict]] = {}  # replica id -> (clock time, last answer)
        self._last: tuple[float, dict] | None = None  # (clock time, detailed body) of the last probe
        self._inflight: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self.probes = 0  # probes completed (tests wait on the first one)

    # ------------------------------------------------------------------ background task
    def start(self) -> None:
        """Start the background probe (and Serve-count readers) on the running loop; no-op without
        one or while it runs. A task whose loop ended (each ``asyncio.run`` of a test) is replaced."""
        self.running_synthesizers.start()
        self.running_frontends.start()
        self._task = background_task(self._task, self._refresh_forever, "health-refresh")

    async def _refresh_forever(self) -> None:
        while True:
            try:
                await self.probe()
            except Exception:  # keep refreshing; the status ages meanwhile
                logger.warning("health probe failed", exc_info=True)
            await asyncio.sleep(self.refresh_s)  # a periodic refresh, not a wait on a condition

    # ------------------------------------------------------------------ answers
    def summary(self) -> tuple[dict, int]:
        """Anonymous ``/health``: the last status and counts (no replica detail), and its HTTP status.

        Never calls a replica. Before the first probe has finished: ``unavailable`` (503)."""
        self.start()
        if self._last is None:
            return {"status": "unavailable", "reason": "starting"}, 503
        at, body = self._last
        out = {"status": body["status"],
               "synthesizer_running_replicas": body["synthesizer_running_replicas"],
               "synthesizer_replicas_ready": sum(1 for r in (*body["synthesizer_replicas"].values(),
                                                               *body["synthesizer_replicas_unreached"].values())
                                                 if r["ready"]),
               "frontend_running_replicas": body["frontend"]["running_replicas"],
               "voice_store_writable": body["frontend"]["voice_store_writable"],
               "pronunciation_store_writable": body["frontend"]["pronunciation_store_writable"],
               "checked_age_s": round(self._clock() - at, 1)}
        return out, _http_status(body["status"])

    async def detail(self) -> tuple[dict, int]:
        """``/health?detail=1``: a probe now (shared with any probe already in flight)."""
        self.start()
        body = await self.probe()
        return body, _http_status(body["status"])

    async def probe(self) -> dict:
        """Probe the replicas once and keep the result; callers arriving meanwhile share it."""
        if self._inflight is not None and not self._inflight.done():
            return await asyncio.shield(self._inflight)
        self._inflight = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._inflight)

    async def _probe(self) -> dict:
        now = self._clock()
        ready_replicas = self.running_synthesizers.current()  # cached: no controller call on the loop
        frontend_running = self.running_frontends.current()
        # side by side: a busy frontend's late answer does not add to the synthesizers' probes
        (seen, failed), frontend = await asyncio.gather(self._probe_synthesizers(ready_replicas),
                                                        self._frontend_status())
        self._memory.update({rid: (now, entry) for rid, entry in seen.items()})
        for rid in [rid for rid, (t, _) in self._memory.items() if now - t > HEALTH_MEMORY_S]:
            del self._memory[rid]
        unreached = {rid: {**entry, "age_s": round(now - t, 1)} for rid, (t, entry) in self._memory.items()
                     if rid not in seen}
        # Ready: no replica says otherwise, and one answered now or Serve counts running ones; the
        # same for the frontend.
        answered_by = frontend.get("replica_id") if frontend else None
        ready = (all(r["ready"] for r in (*seen.values(), *unreached.values()))
                 and (bool(seen) or ready_replicas > 0) and (answered_by is not None or frontend_running > 0))
        store = (frontend or {}).get("voice_store") or {}
        writable = store.get("writable")  # None: unknown (no frontend answered)
        lexicons = (frontend or {}).get("pronunciation_store") or {}
        # Probes that failed: replicas too busy to answer (readiness then rests on memory and Serve's
        # count). A read-only voice store: synthesis with the stored voices works, registration not.
        # A replica only remembered (unreached, no probe failed) is one that went away or that the
        # handle's routing missed: not a degradation of the service.
        degraded = failed > 0 or writable is False or lexicons.get("writable") is False
        body = {"status": "unavailable" if not ready else "degraded" if degraded else "ok",
                "synthesizer_replicas": seen, "synthesizer_replicas_unreached": unreached,
                "synthesizer_running_replicas": ready_replicas, "probes_failed": failed,
                "frontend": {"answered_by": answered_by, "running_replicas": frontend_running,
                             "voice_store_writable": writable, "voice_store": store or None,
                             "pronunciation_store_writable": lexicons.get("writable"),
                             "pronunciation_store": lexicons or None}}
        self._last = (self._clock(), body)
        self.probes += 1
        return body

    async def _frontend_status(self) -> dict | None:
        """A frontend replica's status (its id; whether the voice store accepts writes), None when
        none answered in time."""
        try:
            return await asyncio.wait_for(self.frontend.status.remote(), self.timeout_s)
        except Exception:  # noqa: BLE001 - busy, starting or gone: readiness falls back on Serve's count
            return None

    async def _probe_synthesizers(self, running: int) -> tuple[dict[str, dict], int]:
        """Health answers by replica id, and how many probes failed (module docstring)."""
        seen: dict[str, dict] = {}
        failed = 0
        for _ in range(HEALTH_PROBE_ROUNDS):
            results = await asyncio.gather(
                *(asyncio.wait_for(self.synth.health.remote(), self.timeout_s) for _ in range(2 * max(running, 1))),
                return_exceptions=True)
            for res in results:
                if isinstance(res, BaseException):
                    failed += 1
                else:
                    seen[res.replica_id] = _health_entry(res)
            if failed or len(seen) >= running:
                break
        return seen, failed

    def runtime_detail(self) -> dict | None:
        """What a synthesizer replica last said it loaded (family, ``random_weights``...), from the
        last probe; None before one answered."""
        if self._last is None:
            return None
        _, body = self._last
        for entry in (*body["synthesizer_replicas"].values(), *body["synthesizer_replicas_unreached"].values()):
            return entry["runtime"]
        return None


def _http_status(status: str) -> int:
    return 503 if status == "unavailable" else 200


def _health_entry(res: ReplicaHealth) -> dict:
    """One replica's detailed entry from its health answer."""
    detail = res.detail or {}
    return {
        "ready": res.ready, "device": res.device,
        "gpu_memory_allocated_bytes": res.gpu_memory_allocated_bytes,
        "gpu_memory_total_bytes": res.gpu_memory_total_bytes,
        "utilization_pct": res.gpu_utilization_pct,
        "engine": res.engine.__dict__ if res.engine else None,
        # the execution mode and where it came from (config / FAST_COSY_MODE / default)
        "mode": detail.get("mode"), "mode_source": detail.get("mode_source"),
        # what the replica loaded: family, dtype, estimator, CUDA graphs captured, flow limits
        "runtime": {k: v for k, v in detail.items() if k not in ("mode", "mode_source")},
    }
