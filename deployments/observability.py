"""Metric exporters of the deployments (``ray.serve.metrics``: deployment/replica tags added).

The runtime returns numbers; this module exports them (house style §2.7 rule 26). Outside a
replica (unit tests) :meth:`ReplicaMetrics.for_replica` returns a recorder that only keeps the
values in memory, so deployment classes can be built without Ray.
"""
from __future__ import annotations

from collections.abc import Sequence

from deployments import constants


class Durations:
    """Durations (s) counted into cumulative buckets (``bounds``), with their sum and how many
    passed ``slow_s``; :meth:`snapshot` is JSON-able and becomes one Prometheus histogram series.

    NOTE: no lock. The garbage collector's pauses are added from inside a collection, which any
    allocation of any thread may start, also one inside :meth:`snapshot`: a lock held there would
    deadlock that thread (a synthesizer's /metrics hung so in CI). The GIL orders the updates; a
    snapshot taken across one may be one duration behind, never torn within a number.
    """

    def __init__(self, bounds: Sequence[float], slow_s: float) -> None:
        self.bounds = list(bounds)
        self.slow_s = slow_s
        self.count = 0
        self.seconds = 0.0
        self.buckets = [0] * len(self.bounds)  # per bound, durations <= it
        self.slow = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        self.slow += seconds > self.slow_s
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.buckets[i] += 1

    def snapshot(self) -> dict:
        """``{"count", "seconds", "buckets", "bounds", "slow"}``."""
        return {"count": self.count, "seconds": self.seconds, "buckets": list(self.buckets),
                "bounds": list(self.bounds), "slow": self.slow}


class ReplicaMetrics:
    """Replica-side metrics: TTFA, RTF, request outcomes, batch sizes, engine occupancy."""

    def __init__(self, component: str, exporters: dict | None = None) -> None:
        self.component = component
        self._ex = exporters
        # Kept in memory only without exporters (unit tests), so a replica never grows them.
        self.recorded: dict[str, list] = {"ttfa": [], "rtf": [], "batch": [], "status": []}

    @classmethod
    def for_replica(cls, component: str) -> ReplicaMetrics:
        try:
            from ray import serve
            from ray.serve.metrics import Counter, Gauge, Histogram

            serve.get_replica_context()  # raises outside a replica
        except Exception:  # noqa: BLE001 - whatever it raises, we are not in a replica
            return cls(component)
        return cls(component, {
            "ttfa": Histogram("tts_replica_time_to_first_audio_s", "Replica time to first audio chunk (s)",
                              boundaries=constants.TTFA_BUCKETS_S),
            "rtf": Histogram("tts_replica_rtf", "Replica real-time factor (compute s / audio s)",
                             boundaries=constants.RTF_BUCKETS),
            "batch": Histogram("tts_token2wav_batch_size", "Chunk jobs per flow+HiFT batch",
                               boundaries=constants.BATCH_SIZE_BUCKETS),
            "requests": Counter("tts_replica_requests_total", "Synthesis requests by outcome", tag_keys=("status",)),
            "running": Gauge("tts_engine_running", "Sequences holding a decode slot"),
            "waiting": Gauge("tts_engine_waiting", "Sequences waiting for a decode slot"),
            "util": Gauge("tts_device_utilization_pct", "Measured device utilisation (%)"),
            "margin": Gauge("tts_first_audio_margin_s", "First-audio SLO less the predicted first audio of a "
                            "request admitted now (s; negative: admission refuses)"),
        })

    def observe_ttfa(self, seconds: float) -> None:
        if not self._ex:
            self.recorded["ttfa"].append(seconds)
        else:
            self._ex["ttfa"].observe(seconds)

    def observe_rtf(self, rtf: float) -> None:
        if not self._ex:
            self.recorded["rtf"].append(rtf)
        else:
            self._ex["rtf"].observe(rtf)

    def observe_batch(self, size: int) -> None:
        if not self._ex:
            self.recorded["batch"].append(size)
        else:
            self._ex["batch"].observe(size)

    def count_request(self, status: str) -> None:
        if not self._ex:
            self.recorded["status"].append(status)
        else:
            self._ex["requests"].inc(tags={"status": status})

    def set_engine(self, running: int, waiting: int, util_pct: float) -> None:
        if self._ex:
            self._ex["running"].set(running)
            self._ex["waiting"].set(waiting)
            self._ex["util"].set(util_pct)

    def set_admission(self, margin_s: float | None) -> None:
        """The predicted first-audio margin (not set while the replica has no reading to predict from)."""
        if self._ex and margin_s is not None:
            self._ex["margin"].set(margin_s)


def replica_id() -> str:
    """The Serve replica this code runs in ("local" outside one: unit tests, in-process apps)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - whatever it raises, we are not in a replica
        return "local"
