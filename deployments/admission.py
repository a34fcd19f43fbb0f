"""Admission by deadline: refuse a request whose first audio this replica cannot make within the SLO.

A refused request gets :class:`~deployments.protocol.OverloadedError` at once (the ingress answers
429 with ``Retry-After`` in the OpenAI shape, a WebSocket closes with 1013) instead of a late first
chunk, so the client can go elsewhere and the autoscaler sees the shortfall (below).

The prediction is the replica's own measurement: a curve of first audio against *load* (the
streams open on the replica once a request is admitted, itself included) fitted over every load
it has readings of:

* each load keeps a weighted mean of its readings, and every weight halves each ``half_life_s``
  (readings fade; none is cut off at an age);
* the curve is the weighted **monotone** (non-decreasing) fit of those means across loads (pool
  adjacent violators): more streams never predict faster first audio, so a slow reading at a low
  load is pooled with the faster ones above it instead of standing alone;
* the prediction at load L is the fitted value of the highest load measured at or below L.

The *margin* is ``slo - predicted``. A request is refused only when the margin is negative **and**
at least ``min_samples`` (faded) readings at loads up to L sit on the curve past the SLO (on a
non-decreasing curve each of them says L is past it too); even then a share ``explore_share`` of those
requests is admitted (deterministically: one in ``1 / explore_share``), so a refused load keeps
being measured and a prediction cannot outlive the conditions that made it. A replica with no
other stream open always admits (a slow reading there is not load: a graph captured on first use).

Why: the first design predicted from the newest reading of the nearest load at or below, and a
load it refused was measured again only after its reading expired: one slow reading during a
start-up burst held a GPU replica below its capacity and refused most requests at a load the same
replica served without admission (the reading: docs/tuning.md, "Admission").
``tests/deployments/test_admission_replay.py`` replays that sequence against both designs.

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

RATE_WINDOW_S = 10  # refusals per second are counted over this many whole seconds
DURATION_WEIGHT = 0.1  # weight of the newest stream length in the mean one
NEGLIGIBLE_WEIGHT = 0.01  # a load whose readings weigh less than this is forgotten


@dataclass
class _Load:
    weight: float  # decayed count of readings
    mean_s: float  # their weighted mean first audio
    at: float  # clock time the weight was last decayed to


@dataclass(frozen=True)
class Prediction:
    first_audio_s: float
    load: int  # the measured load it comes from


class FirstAudioModel:
    """First audio against load (see the module docstring). Bounded: one entry per load, and a
    replica never holds more than ``max_load`` streams (Serve's ``max_ongoing_requests``)."""

    def __init__(self, half_life_s: float, max_load: int, clock: Callable[[], float]) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = half_life_s
        self.max_load = max_load
        self.clock = clock
        self._by_load: dict[int, _Load] = {}

    def _decayed(self, entry: _Load, now: float) -> float:
        return entry.weight * 0.5 ** (max(0.0, now - entry.at) / self.half_life_s)

    def record(self, load: int, first_audio_s: float) -> None:
        load = min(max(load, 1), self.max_load)
        now = self.clock()
        entry = self._by_load.get(load)
        if entry is None:
            self._by_load[load] = _Load(1.0, first_audio_s, now)
            return
        w = self._decayed(entry, now)
        entry.mean_s = (entry.mean_s * w + first_audio_s) / (w + 1.0)
        entry.weight, entry.at = w + 1.0, now

    def fit(self) -> dict[int, tuple[float, float]]:
        """``{load: (fitted first audio s, weight of its own readings)}`` over the loads with readings."""
        now = self.clock()
        points = []
        for load in sorted(self._by_load):
            w = self._decayed(self._by_load[load], now)
            if w < NEGLIGIBLE_WEIGHT:
                del self._by_load[load]
                continue
            points.append((load, w, self._by_load[load].mean_s))
        blocks: list[list] = []  # [sum of weights, weighted sum, [(load, its weight)]]
        for load, w, mean in points:
            blocks.append([w, w * mean, [(load, w)]])
            while len(blocks) > 1 and blocks[-2][1] / blocks[-2][0] > blocks[-1][1] / blocks[-1][0]:
                w2, s2, l2 = blocks.pop()
                blocks[-1][0] += w2
                blocks[-1][1] += s2
                blocks[-1][2] += l2
        return {load: (s / w, own) for w, s, members in blocks for load, own in members}

    def predict(self, load: int) -> Prediction | None:
        """First audio of a request admitted at ``load``; None without a reading at or below it."""
        fitted = self.fit()
        below = [lo for lo in fitted if lo <= load]
        if not below:
            return None
        at = max(below)
        return Prediction(fitted[at][0], at)

    def weight_over(self, load: int, threshold_s: float) -> float:
        """The weight of the readings at loads at or below ``load`` whose fitted first audio
        exceeds ``threshold_s``: on a non-decreasing curve each says ``load`` exceeds it too."""
        return sum(w for lo, (v, w) in self.fit().items() if lo <= load and v > threshold_s)

    def snapshot(self) -> dict[int, dict[str, float]]:
        return {lo: {"fit_ms": round(v * 1e3, 1), "mean_ms": round(self._by_load[lo].mean_s * 1e3, 1),
                     "weight": round(self._decayed(self._by_load[lo], self.clock()), 2)}
                for lo, (v, _) in sorted(self.fit().items())}


class Admission:
    """The replica's admission by predicted first audio, its margin and its refusals.

    Args:
        slo_s: first audio the replica must make (its share of the end-to-end SLO).
        enabled: refuse when the prediction exceeds ``slo_s``; off: measure and report only.
        half_life_s: a reading's weight halves every this many seconds.
        max_load: the most streams the replica holds.
        retry_after_s: the ``Retry-After`` of a refusal.
        min_samples: the least weight of readings behind a prediction that refuses.
        explore_share: the share of would-be refusals admitted anyway, to keep measuring.
        clock: seconds (monotonic).
    """

    def __init__(self, slo_s: float, enabled: bool, half_life_s: float, max_load: int, retry_after_s: int,
                 min_samples: float = 5.0, explore_share: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.0 <= explore_share <= 1.0:
            raise ValueError(f"explore_share must lie in [0, 1], got {explore_share}")
        self.slo_s = slo_s
        self.enabled = enabled
        self.retry_after_s = retry_after_s
        self.min_samples = min_samples
        self.explore_share = explore_share
        self.clock = clock
        self.model = FirstAudioModel(half_life_s, max_load, clock)
        self.refused = 0  # requests refused (a counter)
        self.explored = 0  # requests admitted at a load predicted past the SLO (to measure it)
        self._credit = 0.0  # explore_share accumulated per would-be refusal; one admission per unit
        self._refusals: dict[int, int] = {}  # whole second -> refusals in it (the last RATE_WINDOW_S only)
        self._mean_stream_s = 0.0

    @classmethod
    def from_config(cls, cfg, max_load: int, retry_after_s: int, clock: Callable[[], float]) -> Admission:
        """From ``synthesizer.admission`` (``deployments.synthesizer_config.AdmissionConfig``)."""
        return cls(cfg.slo_first_audio_ms / 1e3, cfg.enabled, cfg.half_life_s, max_load, retry_after_s,
                   min_samples=cfg.min_samples, explore_share=cfg.explore_share, clock=clock)

    def margin_s(self, load: int) -> float | None:
        """``slo - predicted`` first audio of a request admitted at ``load``; None without evidence."""
        predicted = self.model.predict(load)
        return None if predicted is None else self.slo_s - predicted.first_audio_s

    def admit(self, load: int) -> None:
        """Raise :class:`OverloadedError` when a request admitted at ``load`` would miss the SLO."""
        if not self.enabled or load <= 1:
            return
        predicted = self.model.predict(load)
        if predicted is None or predicted.first_audio_s <= self.slo_s:
            return
        if self.model.weight_over(load, self.slo_s) < self.min_samples:
            return  # too few readings say so: admitted, and measured
        self._credit += self.explore_share
        if self._credit >= 1.0:
            self._credit -= 1.0
            self.explored += 1
            return
        self.refused += 1
        second = math.floor(self.clock())
        self._refusals[second] = self._refusals.get(second, 0) + 1
        for old in [s for s in self._refusals if s <= second - RATE_WINDOW_S]:
            del self._refusals[old]
        raise OverloadedError(f"this replica would start the audio in ~{predicted.first_audio_s * 1e3:.0f} ms at "
                              f"{load} streams, over its {self.slo_s * 1e3:.0f} ms first-audio SLO; retry after "
                              f"{self.retry_after_s} s", retry_after_s=self.retry_after_s)

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
                "refused_total": self.refused, "explored_total": self.explored, "refused_per_s": self.refused_per_s(),
                "streams_refused": round(self.streams_refused(), 3),
                "first_audio_ms_by_load": self.model.snapshot()}
