"""The fleet simulation's core: GPU nodes, synthesizer replicas, Serve's autoscaler, one second a tick.

Modelled (each a stated simplification of Ray Serve 2.60 and the Ray autoscaler):

* **Routing**: Serve's router spreads each request over the running replicas (power of two
  choices), so every running replica carries ``served / running`` sessions; a replica's first
  audio p99 is the measured curve at that load (``bench/fleet_inputs.py``). No replica is slower
  than another.
* **Metrics**: replicas record their streams in flight (and NVML utilisation, for the
  utilisation policy) every second and push every ``metrics_push_s``; the controller averages each
  replica's samples over ``look_back_period_s`` before the last push, from the replica's start
  (a replica that has not pushed yet reports nothing). The handles' request counts (running +
  queued) are averaged the same way. Streams in flight each second are drawn binomially from the
  sessions served and the measured share of a session spent in synthesis at that load.
* **Decisions**: the policy runs every ``policy_period_s`` (1 s, not Serve's 0.1 s: its inputs
  change only at a push or when a replica starts, so the finer period changes a decision's time
  by under a second). Serve's delay rule is applied to its answer as Serve documents it: the
  target moves up only once the policy has asked for more than the target for
  ``upscale_delay_s`` without a break, down after ``downscale_delay_s``; then
  ``[min_replicas, max_replicas]``.
* **Capacity**: a new replica takes an idle GPU node if one is up, else the Ray autoscaler starts
  a node (``node_start_s``); the replica serves ``replica_start_s`` after it has a node. A replica
  removed frees its node at once (the drain of a few seconds is not modelled); a node idle for
  ``node_idle_timeout_s`` is released. GPU-hours count every node up: starting, serving or idle.
* **Admission** (optional): requests a replica could not start within the SLO are refused
  (HTTP 429) instead of served late: each running replica serves at most the curve's
  ``max_sessions``, the rest of the sessions' requests are refused and never reach a replica's
  count. Refused requests are not retried in the model.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.fleet_inputs import ReplicaModel, ServeSettings
from bench.fleet_workload import Trace

STREAMS = "streams_in_flight"
UTIL = "gpu_util_pct"


@dataclass
class SimConfig:
    settings: ServeSettings
    replica: ReplicaModel
    replica_start_s: float
    node_start_s: float
    metrics_push_s: float = 10.0
    policy_period_s: float = 1.0
    admission: bool = False
    seed: int = 0
    initial_replicas: int | None = None  # None: the first minute's peak at the config's band centre


class ServeConfigView:
    """What a policy reads from ``ctx.config`` (Serve's ``AutoscalingConfig``)."""

    def __init__(self, s: ServeSettings) -> None:
        self.min_replicas, self.max_replicas = s.min_replicas, s.max_replicas
        self.target_ongoing_requests = s.target_ongoing_requests
        self.upscale_delay_s, self.downscale_delay_s = s.upscale_delay_s, s.downscale_delay_s
        self.look_back_period_s = s.look_back_period_s

    def get_target_ongoing_requests(self) -> float:
        return self.target_ongoing_requests


@dataclass
class SimContext:
    """The fields of Serve's ``AutoscalingContext`` a policy reads, built from the simulated fleet."""

    deployment_name: str
    app_name: str
    current_num_replicas: int
    target_num_replicas: int
    running_replicas: list[str]
    total_num_requests: float
    total_queued_requests: float
    aggregated_metrics: dict[str, dict[str, float]]
    raw_metrics: dict[str, Any]
    capacity_adjusted_min_replicas: int
    capacity_adjusted_max_replicas: int
    policy_state: dict[str, Any]
    last_scale_up_time: float | None
    last_scale_down_time: float | None
    current_time: float
    config: ServeConfigView

    @property
    def total_running_requests(self) -> float:
        return max(0.0, self.total_num_requests - self.total_queued_requests)


class DelayRule:
    """Serve's upscale / downscale delay, as documented: a change of the target needs the policy
    to ask for it without a break for the delay. Written from the docs, not Ray's code."""

    def __init__(self, up_s: float, down_s: float) -> None:
        self.up_s, self.down_s = up_s, down_s
        self.direction = 0
        self.since = 0.0

    def __call__(self, desired: int, target: int, now: float) -> int:
        direction = (desired > target) - (desired < target)
        if direction == 0:
            self.direction = 0
            return target
        if direction != self.direction:
            self.direction, self.since = direction, now
        if now - self.since + 1e-9 >= (self.up_s if direction > 0 else self.down_s):
            self.direction = 0
            return desired
        return target


@dataclass
class _Replica:
    rid: str
    ready_at: float  # math.inf until it has a node


@dataclass
class Run:
    """Per-second series of one simulated policy."""

    name: str
    seconds: int
    running: np.ndarray = field(init=False)
    replicas: np.ndarray = field(init=False)  # running + starting + waiting for a node
    nodes: np.ndarray = field(init=False)
    target: np.ndarray = field(init=False)
    served: np.ndarray = field(init=False)
    rejected: np.ndarray = field(init=False)
    late: np.ndarray = field(init=False)  # sessions on replicas past the SLO (or with none running)
    in_flight: np.ndarray = field(init=False)
    queued: np.ndarray = field(init=False)
    p99_ms: np.ndarray = field(init=False)
    audio_s: np.ndarray = field(init=False)
    policy_calls: int = 0
    asks_other_than_running: int = 0  # policy answers that differ from the running count

    def __post_init__(self) -> None:
        for name in ("running", "replicas", "nodes", "target", "served", "rejected", "late", "in_flight", "queued"):
            setattr(self, name, np.zeros(self.seconds, dtype=np.int64))
        self.p99_ms = np.zeros(self.seconds)
        self.audio_s = np.zeros(self.seconds)


class Fleet:
    """Replicas and nodes; :meth:`reconcile` moves them towards Serve's target."""

    def __init__(self, cfg: SimConfig, initial: int) -> None:
        self.cfg = cfg
        self.replicas: list[_Replica] = [_Replica(f"r{i}", 0.0) for i in range(initial)]
        self._next_id = initial
        self.busy_nodes = initial
        self.idle_nodes: deque[float] = deque()  # the times they went idle, oldest first
        self.booting: deque[float] = deque()     # the times they come up, earliest first
        self.waiting: deque[_Replica] = deque()  # replicas without a node, oldest first
        self._running: list[_Replica] = list(self.replicas)
        self._fresh_until = math.inf  # the running list holds until a replica starts or one goes

    def running(self, now: float) -> list[_Replica]:
        if now >= self._fresh_until:
            self._running = [r for r in self.replicas if r.ready_at <= now]
            self._fresh_until = min((r.ready_at for r in self.replicas if r.ready_at > now), default=math.inf)
        return self._running

    def nodes(self) -> int:
        return self.busy_nodes + len(self.idle_nodes) + len(self.booting)

    def step(self, now: float) -> None:
        """Nodes that came up take waiting replicas (or go idle); idle nodes time out."""
        while self.booting and self.booting[0] <= now:
            self.booting.popleft()
            self._node_free(now)
        timeout = self.cfg.settings.node_idle_timeout_s
        while self.idle_nodes and now - self.idle_nodes[0] >= timeout:
            self.idle_nodes.popleft()

    def _node_free(self, now: float) -> None:
        if self.waiting:
            self._start(self.waiting.popleft(), now)
        else:
            self.idle_nodes.append(now)

    def reconcile(self, target: int, now: float) -> None:
        while len(self.replicas) < target:
            r = _Replica(f"r{self._next_id}", math.inf)
            self._next_id += 1
            self.replicas.append(r)
            if self.idle_nodes:
                self.idle_nodes.pop()  # the most recently idle node: the others time out first
                self._start(r, now)
            else:
                self.waiting.append(r)
                # The Ray autoscaler starts a node per replica it cannot place, counting those booting.
                if len(self.booting) < len(self.waiting):
                    self.booting.append(now + self.cfg.node_start_s)
        if len(self.replicas) > target:
            # Serve stops replicas that do not serve yet first (those without a node, then those
            # starting), then the youngest running ones.
            for r in sorted(self.replicas, key=lambda r: r.ready_at, reverse=True)[: len(self.replicas) - target]:
                self.replicas.remove(r)
                if r in self.waiting:
                    self.waiting.remove(r)
                else:
                    self.busy_nodes -= 1
                    self.idle_nodes.append(now)
            self._fresh_until = now

    def _start(self, r: _Replica, now: float) -> None:
        r.ready_at = now + self.cfg.replica_start_s
        self.busy_nodes += 1
        self._fresh_until = min(self._fresh_until, r.ready_at)


Policy = Callable[[Any], tuple[float, dict[str, Any]]]


def simulate(trace: Trace, policy: Policy, cfg: SimConfig, name: str = "policy",
             progress: Callable[[int], None] | None = None) -> Run:
    """Runs ``policy`` (called as Serve calls it, with a context per decision) over ``trace``."""
    s, rep = cfg.settings, cfg.replica
    rng = np.random.default_rng(cfg.seed)
    n_s = trace.seconds
    run = Run(name, n_s)
    cap = rep.max_sessions
    initial = cfg.initial_replicas
    if initial is None:  # a fleet at rest for the first minute's load, not one still scaling
        mid = (float(s.load_band.get("low_pct", 70)) + float(s.load_band.get("high_pct", 80))) / 200
        initial = max(s.min_replicas, math.ceil(trace.active[:60].max() / (mid * cap)))
    fleet = Fleet(cfg, min(max(initial, s.min_replicas), s.max_replicas))
    target = len(fleet.replicas)
    delay = DelayRule(s.upscale_delay_s, s.downscale_delay_s)
    serve_cfg = ServeConfigView(s)
    # Running sums (index t holds the sum over seconds < t) for the look-back windows.
    cs = {k: np.zeros(n_s + 1) for k in ("streams", "util", "requests", "queued")}
    snapshot: dict[str, Any] = {"metrics": {STREAMS: {}, UTIL: {}}, "requests": 0.0, "queued": 0.0}
    policy_state: dict[str, Any] = {}
    push, look_back = int(cfg.metrics_push_s), s.look_back_period_s
    period = max(1, int(cfg.policy_period_s))
    for t in range(n_s):
        now = float(t)
        fleet.step(now)
        running = fleet.running(now)
        n = len(running)
        active = int(trace.active[t])
        served = min(active, int(n * cap)) if cfg.admission else active
        per = served / n if n else 0.0
        p99 = rep.p99_ms(per) if n else math.inf
        streams = rng.binomial(served, min(1.0, max(0.0, rep.streams_per_session(per)))) if served and n else 0
        slots = n * s.max_ongoing_requests
        in_flight, queued = min(streams, slots), max(0, streams - slots)
        if served and not n:
            queued = served  # nothing to run on: every session waits
        run.running[t], run.replicas[t], run.nodes[t], run.target[t] = n, len(fleet.replicas), fleet.nodes(), target
        run.served[t], run.rejected[t], run.in_flight[t], run.queued[t] = served, active - served, in_flight, queued
        run.late[t] = served if served and p99 > rep.slo_p99_ms else 0
        run.p99_ms[t] = p99 if served else 0.0
        run.audio_s[t] = served * rep.audio_per_session(per) if n else 0.0
        per_replica = in_flight / n if n else 0.0
        cs["streams"][t + 1] = cs["streams"][t] + per_replica
        cs["util"][t + 1] = cs["util"][t] + (rep.util_pct(per_replica) if n else 0.0)
        cs["requests"][t + 1] = cs["requests"][t] + in_flight + queued
        cs["queued"][t + 1] = cs["queued"][t] + queued
        if (t + 1) % push == 0:  # a push at the end of this second
            _push(snapshot, cs, running, t + 1, look_back)
        if t % period == 0 and t >= push:  # from the first push on: before it Serve knows no load
            ctx = SimContext(
                deployment_name=name, app_name="sim", current_num_replicas=n, target_num_replicas=target,
                running_replicas=[r.rid for r in running], total_num_requests=snapshot["requests"],
                total_queued_requests=snapshot["queued"],
                aggregated_metrics=snapshot["metrics"], raw_metrics={},
                capacity_adjusted_min_replicas=s.min_replicas, capacity_adjusted_max_replicas=s.max_replicas,
                policy_state=policy_state, last_scale_up_time=None, last_scale_down_time=None,
                current_time=now, config=serve_cfg)
            desired, policy_state = policy(ctx)
            run.policy_calls += 1
            run.asks_other_than_running += math.ceil(desired) != n
            desired = min(s.max_replicas, max(s.min_replicas, math.ceil(desired)))
            target = min(s.max_replicas, max(s.min_replicas, delay(desired, target, now)))
        fleet.reconcile(target, now)
        if progress is not None and t % 3600 == 3599:
            progress(3600)
    return run


def _push(snapshot: dict[str, Any], cs: dict[str, np.ndarray], running: list[_Replica], end: int,
          look_back: float) -> None:
    """The controller's view after a push at second ``end``: look-back means per replica and of
    the handles' counts. A replica started within the window averages only its own seconds."""
    start = max(0, int(end - look_back))
    streams, util = {}, {}
    for r in running:
        a = max(start, math.ceil(r.ready_at))
        if a >= end:
            continue  # started this second: nothing recorded yet
        streams[r.rid] = (cs["streams"][end] - cs["streams"][a]) / (end - a)
        util[r.rid] = (cs["util"][end] - cs["util"][a]) / (end - a)
    span = end - start
    snapshot["metrics"] = {STREAMS: streams, UTIL: util}
    snapshot["requests"] = (cs["requests"][end] - cs["requests"][start]) / span
    snapshot["queued"] = (cs["queued"][end] - cs["queued"][start]) / span


def oracle_replicas(trace: Trace, replica: ReplicaModel, min_replicas: int = 1, minute_s: int = 60) -> np.ndarray:
    """Per minute: the fewest replicas that hold that minute's peak sessions within the SLO,
    started the instant they are needed (no start time, no delay)."""
    n = trace.seconds
    minutes = math.ceil(n / minute_s)
    peak = np.array([trace.active[m * minute_s:(m + 1) * minute_s].max() for m in range(minutes)])
    return np.maximum(min_replicas, np.ceil(peak / replica.max_sessions)).astype(np.int64)
