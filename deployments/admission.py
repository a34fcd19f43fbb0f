"""Admission by deadline: refuse a request whose first audio this replica cannot make within the SLO.

A refused request gets :class:`~deployments.protocol.OverloadedError` at once (the ingress answers
429 with ``Retry-After`` in the OpenAI shape, a WebSocket closes with 1013) instead of a late first
chunk, so the client can go elsewhere and the autoscaler sees the shortfall (below).

The prediction is the replica's own measurement, kept simple enough to explain in one line:

    predicted first audio at load L = the recent first audio of requests admitted at load L'
                                      (the nearest load at or below L measured within window_s)

where a request's *load* is the streams open on the replica once it is admitted (itself
included), and "recent" a moving average per load (weight ``EWMA_WEIGHT`` on the newest reading)
of readings no older than ``window_s``. The *margin* is ``slo - predicted`` for a request
admitted now; a request is refused when it is negative. Everything that makes first audio slow
under load (decode steps shared by more rows, the token2wav queue ahead, the GIL) is in the
measurement, whatever the scheduler. No reading at or below a load: no evidence, the request is
admitted (and measured). A replica with no other stream open always admits: its first audio is
not slow for load, and refusing could not make it faster (one slow reading, e.g. a CUDA graph
captured on first use, must not turn an idle replica away). A load refused for a while is measured again once its readings are older
than ``window_s`` (the prediction then falls back to a lower load's, which admits).

What the autoscaler reads: ``streams_refused``, the streams this replica would have in flight had
it admitted what it refused, by Little's law: refusals per second (over the last
``RATE_WINDOW_S``) times the mean length of the streams it served. The load-band policy adds it to
the demand (``deployments/autoscaling_policy.py``), so refusals raise the replica count as queued
requests would.

No Ray import: the clock is injected (tests use a fake one).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from deployments.protocol import OverloadedError

EWMA_WEIGHT = 0.3  # weight of the newest first-audio reading of a load
RATE_WINDOW_S = 10  # refusals per second are counted over this many whole seconds
DURATION_WEIGHT = 0.1  # weight of the newest stream length in the mean one


@dataclass
class _Reading:
    first_audio_s: float
    at: float  # clock time of the newest reading


class FirstAudioModel:
    """Recent first-audio time per load (see the module docstring). Bounded: one entry per load,
    and a replica never holds more than ``max_load`` streams (Serve's ``max_ongoing_requests``)."""

    def __init__(self, window_s: float, max_load: int, clock: Callable[[], float]) -> None:
        self.window_s = window_s
        self.max_load = max_load
        self.clock = clock
        self._by_load: dict[int, _Reading] = {}

    def record(self, load: int, first_audio_s: float) -> None:
        load = min(max(load, 1), self.max_load)
        now = self.clock()
        old = self._by_load.get(load)
        if old is None or now - old.at > self.window_s:
            self._by_load[load] = _Reading(first_audio_s, now)
        else:
            old.first_audio_s += EWMA_WEIGHT * (first_audio_s - old.first_audio_s)
            old.at = now

    def predict(self, load: int) -> float | None:
        """First audio of a request admitted at ``load``; None without a fresh reading at or below it."""
        now = self.clock()
        fresh = [lo for lo, r in self._by_load.items() if lo <= load and now - r.at <= self.window_s]
        return self._by_load[max(fresh)].first_audio_s if fresh else None

    def snapshot(self) -> dict[int, float]:
        now = self.clock()
        return {lo: round(r.first_audio_s * 1e3, 1) for lo, r in sorted(self._by_load.items())
                if now - r.at <= self.window_s}


class Admission:
    """The replica's admission by predicted first audio, its margin and its refusals.

    Args:
        slo_s: first audio the replica must make (its share of the end-to-end SLO).
        enabled: refuse when the prediction exceeds ``slo_s``; off: measure and report only.
        window_s: readings older than this are not used.
        max_load: the most streams the replica holds.
        retry_after_s: the ``Retry-After`` of a refusal.
        clock: seconds (monotonic).
    """

    def __init__(self, slo_s: float, enabled: bool, window_s: float, max_load: int, retry_after_s: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slo_s = slo_s
        self.enabled = enabled
        self.retry_after_s = retry_after_s
        self.clock = clock
        self.model = FirstAudioModel(window_s, max_load, clock)
        self.refused = 0  # requests refused (a counter)
        self._refusals: dict[int, int] = {}  # whole second -> refusals in it (the last RATE_WINDOW_S only)
        self._mean_stream_s = 0.0

    def margin_s(self, load: int) -> float | None:
        """``slo - predicted`` first audio of a request admitted at ``load``; None without evidence."""
        predicted = self.model.predict(load)
        return None if predicted is None else self.slo_s - predicted

    def admit(self, load: int) -> None:
        """Raise :class:`OverloadedError` when a request admitted at ``load`` would miss the SLO."""
        margin = self.margin_s(load)
        if not self.enabled or load <= 1 or margin is None or margin >= 0:
            return
        self.refused += 1
        second = math.floor(self.clock())
        self._refusals[second] = self._refusals.get(second, 0) + 1
        for old in [s for s in self._refusals if s <= second - RATE_WINDOW_S]:
            del self._refusals[old]
        predicted_ms = (self.slo_s - margin) * 1e3
        raise OverloadedError(f"this replica would start the audio in ~{predicted_ms:.0f} ms at {load} streams, over "
                              f"its {self.slo_s * 1e3:.0f} ms first-audio SLO; retry after {self.retry_after_s} s",
                              retry_after_s=self.retry_after_s)

    def first_audio(self, load: int, seconds: float) -> None:
        """A request admitted at ``load`` made its first audio after ``seconds``."""
        self.model.record(load, seconds)

    def stream_ended(self, seconds: float) -> None:
        """A served stream lasted ``seconds`` (for :meth:`streams_refused`)."""
        m = self._mean_stream_s
        self._mean_stream_s = seconds if m == 0.0 else m + DURATION_WEIGHT * (seconds - m)

    def refused_per_s(self) -> float:
        now = math.floor(self.clock())
        return sum(n for s, n in self._refusals.items() if s > now - RATE_WINDOW_S) / RATE_WINDOW_S

    def streams_refused(self) -> float:
        """Streams refused demand would hold in flight (Little's law: rate x mean stream length)."""
        return self.refused_per_s() * self._mean_stream_s

    def snapshot(self, load: int) -> dict:
        margin = self.margin_s(load)
        return {"enabled": self.enabled, "slo_first_audio_ms": round(self.slo_s * 1e3, 1),
                "margin_ms": None if margin is None else round(margin * 1e3, 1),
                "refused_total": self.refused, "refused_per_s": self.refused_per_s(),
                "streams_refused": round(self.streams_refused(), 3),
                "first_audio_ms_by_load": self.model.snapshot()}
