"""Load and search of ``bench/capacity.py``: voice-agent sessions (closed loop) or Poisson
arrivals (open loop) with the requests of a workload (``bench/workload.py``), the SLO verdict of
one load level (a probe), and the doubling-then-bisection search for the largest load that meets
the SLO.

A probe judges the requests submitted in a window of steady load (after every session has
started, or after the open loop's warm-up); it stops at the first failed or underrun request in
the window, since the SLO allows none, else judges p99 time to first audio at its end.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from bench.metrics import RequestTrace, percentile
from bench.workload import RequestSource, SyntheticSource, Utterance, length_summary
from serve_app.stage_timing import NOT_STAGES

logger = logging.getLogger("bench.capacity")


@dataclass(frozen=True)
class Mix:
    """Utterance lengths: buckets of (weight, shortest s, longest s), uniform inside a bucket."""

    buckets: tuple[tuple[float, float, float], ...]

    @classmethod
    def parse(cls, text: str) -> Mix:
        """``"40:1-3,40:3-8,20:8-20"`` -> weights 40/40/20 over those second ranges."""
        buckets = []
        for part in text.split(","):
            weight, _, span = part.partition(":")
            lo, _, hi = span.partition("-")
            w, a, b = float(weight), float(lo), float(hi)
            if not (w > 0 and 0 < a <= b):
                raise ValueError(f"bad mix bucket {part!r}: want WEIGHT:LO-HI with 0 < LO <= HI seconds")
            buckets.append((w, a, b))
        if not buckets:
            raise ValueError("empty mix")
        return cls(tuple(buckets))

    def draw(self, rng: random.Random) -> float:
        total = sum(w for w, _, _ in self.buckets)
        x = rng.random() * total
        for w, lo, hi in self.buckets:
            if x < w:
                return rng.uniform(lo, hi)
            x -= w
        return rng.uniform(*self.buckets[-1][1:])

    @property
    def longest_s(self) -> float:
        return max(hi for _, _, hi in self.buckets)

    def describe(self) -> str:
        total = sum(w for w, _, _ in self.buckets)
        return ", ".join(f"{100 * w / total:.0f} % {lo:g}-{hi:g} s" for w, lo, hi in self.buckets)


@dataclass(frozen=True)
class Slo:
    """Every request served, no more than ``max_underruns``, first audio p99 (and p95) within bounds."""

    ttfa_p99_ms: float = 300.0
    max_underruns: int = 0
    ttfa_p95_ms: float = math.inf  # the Poisson target of issue 39: p95 <= 150 ms (Run.slo_p95)

    def meets(self, row: dict) -> bool:
        """The verdict on a probe's summary row."""
        return (row["requests"] > row["errors"] and row["errors"] == 0 and row["underruns"] <= self.max_underruns
                and row["ttfa_p99_ms"] <= self.ttfa_p99_ms and row["ttfa_p95_ms"] <= self.ttfa_p95_ms
                and row["aborted"] is None)


@dataclass(frozen=True)
class Workload:
    mix: Mix | None = None  # the synthetic workload's lengths (when no source is given)
    seed: int = 0
    window_s: float = 60.0  # steady-load window whose requests are judged
    ramp_s: float = 5.0  # mean span over which session starts (or the open loop's warm-up) spread
    # A session waits out its answer's playback before the next request, as a voice agent does;
    # False sends them back to back (the one-session latency probe: waiting, a 15 s window held
    # two requests, H100 2026-12-06).
    wait_playback: bool = True
    source: RequestSource | None = None  # what each request says, in which voice (None: synthetic over mix)

    def __post_init__(self) -> None:
        if self.source is None:
            if self.mix is None:
                raise ValueError("a workload needs a mix or a request source")
            object.__setattr__(self, "source", SyntheticSource(self.mix))


SLOWEST = 5  # requests a probe's summary names with their stages (``slowest``)


class Target(Protocol):
    """Where requests go. ``synthesize`` returns the request's trace (``error`` set on failure);
    chunk times are ``time.perf_counter`` seconds, the driver's clock. ``add_voice`` /
    ``remove_voice`` register a voice and take it away (the production workload's pool and cold
    voices; a synthetic workload calls neither)."""

    async def synthesize(self, rid: str, request: Utterance, submitted_s: float) -> RequestTrace: ...


@dataclass
class Probe:
    """One load level: the judged requests and what the SLO says of them."""

    load: float  # sessions (closed loop) or requests/s (open loop)
    traces: list[RequestTrace] = field(default_factory=list)
    window_s: float = 0.0
    aborted: str | None = None  # why the probe stopped early
    span: tuple[float, float] = (0.0, 0.0)  # the window, in the driver's clock (for target-side stats)
    extra: dict = field(default_factory=dict)  # target-side stats (GPU utilisation, lane times)

    def summary(self, slo: Slo) -> dict:
        ok = [t for t in self.traces if t.error is None and t.chunk_times_s]
        ttfa = [t.ttfa_s * 1e3 for t in ok]
        cold = [t.ttfa_s * 1e3 for t in ok if t.cold_voice]
        audio = sum(t.audio_s for t in ok)
        lengths = length_summary([(t.drawn_s, t.audio_s) for t in ok])
        row = {"load": self.load, "requests": len(self.traces), "errors": len(self.traces) - len(ok),
               "ttfa_p50_ms": percentile(ttfa, 50), "ttfa_p95_ms": percentile(ttfa, 95),
               "ttfa_p99_ms": percentile(ttfa, 99), "ttfa_max_ms": max(ttfa, default=math.nan),
               "cold_voice_requests": len(cold), "ttfa_cold_p95_ms": percentile(cold, 95) if cold else None,
               "drawn_s_p50": lengths["drawn_s"]["p50"] if lengths else None,
               "served_s_p50": lengths["served_s"]["p50"] if lengths else None,
               "served_over_drawn_p50": lengths["served_over_drawn"]["p50"] if lengths else None,
               "underruns": sum(t.underruns() for t in ok), "requests_with_underrun": sum(1 for t in ok if t.underruns()),
               "audio_s": audio, "window_s": self.window_s,
               # Little's law: mean requests open at once (what the autoscaler's load signal counts)
               "streams_in_flight_mean": (sum(t.latency_s for t in ok) / self.window_s if self.window_s > 0
                                          else math.nan),
               "throughput_x_realtime": audio / self.window_s if self.window_s > 0 else math.nan,
               "aborted": self.aborted}
        return {**row, "meets_slo": slo.meets(row), "stages_ms": stage_summary(ok),
                "stages_ms_cold": stage_summary([t for t in ok if t.cold_voice]), "slowest": slowest(ok), **self.extra}


def slowest(traces: list[RequestTrace], n: int = SLOWEST) -> list[dict]:
    """The ``n`` requests of latest first audio, each with what may explain it: a cold voice, its
    prompt's and its answer's length, the stages the server reported (a p99 is a few requests:
    at 40 sessions two of 197 made it, H100 2026-12-07)."""
    out = []
    for t in sorted(traces, key=lambda t: -t.ttfa_s)[:n]:
        out.append({"ttfa_ms": round(t.ttfa_s * 1e3, 1), "cold_voice": t.cold_voice, "prompt_s": t.prompt_s,
                    "drawn_s": t.drawn_s, "underruns": t.underruns(),
                    "stages_ms": {k: round(v, 1) for k, v in t.stages_ms.items()}})
    return out


def stages_with_proxy(trace: RequestTrace) -> dict[str, float]:
    """The first-audio stages the server reported for ``trace`` (Server-Timing, ms) and ``proxy``:
    the client's time to first audio less the ingress's (``first-audio``), i.e. Serve's HTTP proxy
    hops and the connection. ``trace`` must have its first chunk."""
    if "first-audio" not in trace.stages_ms:
        return dict(trace.stages_ms)
    return {**trace.stages_ms, "proxy": trace.ttfa_s * 1e3 - trace.stages_ms["first-audio"]}


def stage_summary(traces: list[RequestTrace]) -> dict[str, list[float]]:
    """[p50, p99] ms of every first-audio stage of :func:`stages_with_proxy`, by stage."""
    per_trace = [stages_with_proxy(t) for t in traces]
    out = {}
    for name in dict.fromkeys(name for stages in per_trace for name in stages if name not in NOT_STAGES):
        values = [stages[name] for stages in per_trace if name in stages]
        out[name] = [round(percentile(values, 50), 2), round(percentile(values, 99), 2)]
    return out


class _Judge:
    """Collects finished requests; stops the probe at the first in-window failure or underrun."""

    def __init__(self, slo: Slo) -> None:
        self.slo = slo
        self.window: tuple[float, float] = (math.inf, math.inf)
        self.judged: list[RequestTrace] = []
        self.stop = asyncio.Event()
        self.reason: str | None = None

    def in_window(self, t_s: float) -> bool:
        return self.window[0] <= t_s < self.window[1]

    def done(self, trace: RequestTrace) -> None:
        if not self.in_window(trace.submitted_s):
            return
        self.judged.append(trace)
        if self.reason is None and trace.error is not None:
            self.reason = f"request failed: {trace.error}"
        elif self.reason is None and trace.underruns() > self.slo.max_underruns:
            self.reason = f"underrun ({trace.underruns()}) at {trace.audio_s:.1f} s of audio"
        if self.reason is not None:
            self.stop.set()


class Clock:
    """The driver's time: ``perf_counter`` seconds (the targets' chunk times use it too). The
    waits are the workload's think time, not synchronisation; tests pass a fake clock."""

    def now(self) -> float:
        return time.perf_counter()

    async def wait_until(self, stop: asyncio.Event, until_s: float) -> bool:
        """Sleep until ``until_s`` or the stop, whichever comes first; True if stopped."""
        delay = until_s - self.now()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
        return stop.is_set()


def exponential_starts(n: int, span_s: float, rng: random.Random, t0: float = 0.0) -> list[float]:
    """The start times of ``n`` sessions from ``t0``: exponential gaps at rate ``n / span_s``, so
    the last starts ~``span_s`` later on average; all at ``t0`` when ``span_s`` is 0."""
    starts, t = [], t0
    for _ in range(n):
        t += rng.expovariate(n / span_s) if span_s > 0 else 0.0
        starts.append(t)
    return starts


async def closed_loop(target: Target, sessions: int, work: Workload, slo: Slo, clock: Clock | None = None) -> Probe:
    """``sessions`` voice-agent sessions; the window opens once the last session has started."""
    clock = clock or Clock()
    rng = random.Random(work.seed)
    starts = exponential_starts(sessions, work.ramp_s, rng, clock.now())
    judge = _Judge(slo)
    judge.window = (starts[-1], starts[-1] + work.window_s)
    session_rngs = [random.Random(f"{work.seed}/{i}") for i in range(sessions)]

    async def session(i: int) -> None:
        at, n = starts[i], 0
        # a session whose next request would fall after the window is done (no wait for it)
        while at < judge.window[1] and not await clock.wait_until(judge.stop, at):
            trace = await serve_one(target, f"s{i}-{n}", work.source.draw(session_rngs[i], i), clock)
            judge.done(trace)
            n += 1
            at = trace.playback_deadline_s() if trace.chunk_times_s and work.wait_playback else clock.now()

    await asyncio.gather(*(session(i) for i in range(sessions)))
    return Probe(sessions, judge.judged, window_s=work.window_s, aborted=judge.reason, span=judge.window)


async def open_loop(target: Target, rate_rps: float, work: Workload, slo: Slo, clock: Clock | None = None) -> Probe:
    """Poisson arrivals at ``rate_rps``; requests of the first ``ramp_s`` are not judged."""
    clock = clock or Clock()
    rng = random.Random(work.seed)
    judge = _Judge(slo)
    t0 = clock.now()
    judge.window = (t0 + work.ramp_s, t0 + work.ramp_s + work.window_s)
    running: set[asyncio.Task] = set()
    at, n = t0, 0

    async def one(rid: str, request: Utterance) -> None:
        judge.done(await serve_one(target, rid, request, clock))

    while True:
        at += rng.expovariate(rate_rps)
        if at >= judge.window[1] or await clock.wait_until(judge.stop, at):
            break
        task = asyncio.create_task(one(f"p{n}", work.source.draw(rng, None)))
        running.add(task)
        task.add_done_callback(running.discard)
        n += 1
    if running:
        await asyncio.gather(*running)
    return Probe(rate_rps, judge.judged, window_s=work.window_s, aborted=judge.reason, span=judge.window)


async def serve_one(target: Target, rid: str, request: Utterance, clock: Clock) -> RequestTrace:
    """One request; a cold voice is registered first (its time is not first audio's: the request is
    submitted once the voice exists) and removed after, so the voice store does not grow by a run's
    cold voices. A failed registration is a failed request."""
    if request.cold:
        try:
            await target.add_voice(request.voice)
        except Exception as exc:  # noqa: BLE001 - the service's failure is the probe's result
            return RequestTrace(submitted_s=clock.now(), error=f"registering cold voice: {exc!r}",
                                drawn_s=request.drawn_s, cold_voice=True)
    trace = await target.synthesize(rid, request, clock.now())
    trace.drawn_s, trace.cold_voice = request.drawn_s, request.cold
    trace.prompt_s = request.voice.prompt_s if request.voice is not None else None
    if request.cold:
        try:
            await target.remove_voice(request.voice.voice_id)
        except Exception as exc:  # noqa: BLE001 - left behind in the store, the request was served
            logger.warning("removing cold voice %s: %r", request.voice.voice_id, exc)
    return trace


def search(probe: Callable[[float], Awaitable[Probe]], slo: Slo, start: float, step: Callable[[float, bool], float],
           converged: Callable[[float, float], bool], floor: float, ceiling: float,
           on_probe: Callable[[Probe], None] | None = None) -> tuple[float, list[Probe]]:
    """Largest load meeting the SLO, assuming it holds at every load below one that meets it.

    From ``start``: ``step(load, up)`` while the answer stays the same (up while it meets, down
    while it fails), then bisection between the last load that met it and the first that did
    not until ``converged(lo, hi)``. Returns (capacity, probes in the order run); capacity is 0
    when even ``floor`` fails.
    """
    probes: dict[float, Probe] = {}

    def run(load: float) -> bool:
        if load not in probes:
            probes[load] = asyncio.run(probe(load))
            if on_probe is not None:
                on_probe(probes[load])
        return probes[load].summary(slo)["meets_slo"]

    lo, hi = None, None
    load = start
    if run(load):
        lo = load
        while lo < ceiling:
            nxt = min(ceiling, step(lo, True))
            if not run(nxt):
                hi = nxt
                break
            lo = nxt
        if hi is None:
            return lo, list(probes.values())
    else:
        hi = load
        while hi > floor:
            nxt = max(floor, step(hi, False))
            if run(nxt):
                lo = nxt
                break
            hi = nxt
        if lo is None:
            return 0, list(probes.values())
    while not converged(lo, hi):
        mid = _midpoint(lo, hi)
        if run(mid):
            lo = mid
        else:
            hi = mid
    return lo, list(probes.values())


def _midpoint(lo: float, hi: float) -> float:
    if isinstance(lo, int) and isinstance(hi, int):
        return (lo + hi) // 2
    return round((lo + hi) / 2, 3)


def sessions_search(probe, slo: Slo, start: int = 4, ceiling: int = 256, tolerance: float = 0.1,
                    on_probe=None) -> tuple[int, list[Probe]]:
    """Integer sessions: doubling / halving, then bisection to within ``tolerance`` of the answer."""
    return search(probe, slo, start, step=lambda n, up: n * 2 if up else max(1, n // 2),
                  converged=lambda lo, hi: hi - lo <= max(1, math.floor(lo * tolerance)),
                  floor=1, ceiling=ceiling, on_probe=on_probe)


def rate_search(probe, slo: Slo, start: float = 1.0, tolerance: float = 0.1, ceiling: float = 200.0,
                on_probe=None) -> tuple[float, list[Probe]]:
    """Requests per second: doubling / halving, then bisection to ``tolerance`` (relative)."""
    return search(probe, slo, start, step=lambda r, up: round(r * 2 if up else r / 2, 3),
                  converged=lambda lo, hi: hi - lo <= lo * tolerance, floor=0.05, ceiling=ceiling,
                  on_probe=on_probe)
