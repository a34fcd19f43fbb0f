"""Session traces for the fleet simulation: a diurnal day with bursts, or a ramp replayed as given.

A trace is the number of voice-agent sessions open each second, with the arrivals and departures
that make it (``active[t] = initial + cumsum(arrivals - departures)[t]``). A session is the
capacity benchmark's: it asks for an answer, plays it out, asks again (``bench/capacity_load.py``),
so a replica's measured capacity in sessions applies to it directly.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Trace:
    """Sessions per second. ``active[t]`` is the count open during second ``t``."""

    active: np.ndarray      # int64, sessions open during each second
    arrivals: np.ndarray    # int64, sessions opened at the start of each second
    departures: np.ndarray  # int64, sessions closed at the end of each second
    initial: int            # sessions open before the first second
    description: str

    @property
    def seconds(self) -> int:
        return len(self.active)

    def check(self) -> None:
        """Raises unless every session that arrived either left or is still open."""
        opened = self.initial + np.cumsum(self.arrivals)
        closed = np.concatenate(([0], np.cumsum(self.departures)[:-1]))
        if not np.array_equal(self.active, opened - closed) or (self.active < 0).any():
            raise AssertionError("sessions are not conserved")


def _day(h: np.ndarray) -> np.ndarray:
    def bump(centre: float, width: float) -> np.ndarray:
        d = (h - centre + 12.0) % 24.0 - 12.0  # wraps round midnight
        return np.exp(-0.5 * (d / width) ** 2)

    return 0.06 + 0.74 * bump(10.5, 2.2) + 0.94 * bump(19.5, 2.6) + 0.25 * bump(14.5, 3.0)


_DAY_TOP = float(_day(np.arange(0, 24, 1 / 3600)).max())


def diurnal_shape(t_s: np.ndarray) -> np.ndarray:
    """A day's load in [0, 1]: a night trough near 04:00 (~6 % of peak), a morning peak near 10:30
    (~80 %) and the evening peak near 19:30 (1.0). A stated shape, not a measured one."""
    return _day((np.asarray(t_s, dtype=float) / 3600.0) % 24.0) / _DAY_TOP


def diurnal_trace(hours: float, peak_sessions: int, seed: int = 0, mean_session_s: float = 180.0,
                  bursts_per_day: float = 8.0, burst_share: tuple[float, float] = (0.1, 0.3),
                  burst_span_s: float = 60.0, start_hour: float = 0.0) -> Trace:
    """Open sessions following :func:`diurnal_shape` scaled to ``peak_sessions``, plus bursts.

    Sessions arrive as a Poisson process whose rate keeps the expected count on the curve
    (``rate = dS/dt + S / mean_session_s``) and last an exponential time of mean
    ``mean_session_s``. A burst (count ``bursts_per_day`` per 24 h, at seeded times) brings a
    further ``burst_share`` (uniform in the range) of the curve's sessions within ``burst_span_s``.
    """
    if peak_sessions < 0 or hours <= 0 or mean_session_s <= 0:
        raise ValueError("need peak_sessions >= 0, hours > 0, mean_session_s > 0")
    rng = np.random.default_rng(seed)
    n = round(hours * 3600)
    t = start_hour * 3600 + np.arange(n + 1, dtype=float)
    curve = peak_sessions * diurnal_shape(t)
    rate = np.maximum(0.0, np.diff(curve) + curve[:-1] / mean_session_s)
    bursts = round(bursts_per_day * hours / 24)
    burst_log = []
    for at in np.sort(rng.uniform(0, max(1.0, n - burst_span_s), size=bursts)).astype(int):
        share = rng.uniform(*burst_share)
        span = int(max(1, min(burst_span_s, n - at)))
        rate[at:at + span] += share * curve[at] / span
        burst_log.append(f"{at / 3600:.2f} h +{share:.0%}")
    arrivals = rng.poisson(rate).astype(np.int64)
    leave_p = -math.expm1(-1.0 / mean_session_s)
    initial = int(rng.poisson(curve[0]))
    active = np.empty(n, dtype=np.int64)
    departures = np.empty(n, dtype=np.int64)
    open_now = initial
    for i in range(n):
        open_now += int(arrivals[i])
        active[i] = open_now
        departures[i] = rng.binomial(open_now, leave_p)
        open_now -= int(departures[i])
    desc = (f"diurnal, {hours:g} h from {start_hour:g}:00, peak {peak_sessions} sessions on the curve, "
            f"sessions of mean {mean_session_s:g} s (exponential), seed {seed}, bursts: "
            + (", ".join(burst_log) or "none"))
    return Trace(active, arrivals, departures, initial, desc)


def ramp_trace(points: list[tuple[float, float]]) -> Trace:
    """A ramp as the live ramp tool takes it: ``(time s, sessions)`` points, sessions linear
    between them (a step when two points share a time), held after the last point's time."""
    pts = sorted((float(t), float(s)) for t, s in points)
    if not pts or pts[0][0] != 0 or any(s < 0 for _, s in pts):
        raise ValueError(f"a ramp starts at time 0 with sessions >= 0, got {pts}")
    n = max(1, math.ceil(pts[-1][0]))
    t = np.arange(n, dtype=float)
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts]
    # np.interp takes the right-hand value at a repeated x: a step lands at its time.
    active = np.rint(np.interp(t, xs, ys, right=ys[-1])).astype(np.int64)
    before = np.concatenate(([active[0]], active[:-1]))
    change = active - before
    arrivals = np.maximum(change, 0)
    departures = np.concatenate((np.maximum(-change, 0)[1:], [0]))
    desc = "ramp " + ", ".join(f"{t:g} s: {s:g}" for t, s in pts)
    return Trace(active, arrivals, departures, int(active[0]), desc)


def parse_ramp(text: str) -> list[tuple[float, float]]:
    """``"0:0,60:200,600:200"`` or a JSON file holding ``[[t, sessions], ...]``
    (or ``{"points": [...]}``)."""
    path = Path(text)
    if path.suffix == ".json" and path.exists():
        data = json.loads(path.read_text())
        data = data["points"] if isinstance(data, dict) else data
        return [(float(t), float(s)) for t, s in data]
    out = []
    for item in text.split(","):
        t, _, s = item.strip().partition(":")
        out.append((float(t), float(s)))
    return out


def rise_within(trace: Trace, window_s: float, quantile: float = 0.99) -> float:
    """How much the sessions open can rise before capacity ordered now arrives: over the seconds
    with a session open, the ``quantile`` of ``max(active[t : t + window_s]) / active[t]``.

    A fleet that reacts in ``window_s`` (the upscale delay, a metrics push, a node and a replica
    start) serves a rise within the SLO only if each replica runs at ``1 / rise`` of its capacity
    or less: at the 0.99 quantile, the headroom that keeps about 1 % of the time over the SLO.
    """
    w = max(1, math.ceil(window_s))
    active = trace.active.astype(float)
    if len(active) <= w:
        return 1.0
    ahead = np.lib.stride_tricks.sliding_window_view(active, w + 1).max(axis=1)
    now = active[: len(ahead)]
    open_ = now > 0
    return float(np.quantile(ahead[open_] / now[open_], quantile)) if open_.any() else 1.0
