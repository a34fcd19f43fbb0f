"""The autoscaling policies the fleet simulation compares, each called as Serve calls a policy.

* ``queue``: Serve's default (``replica_queue_length_autoscaling_policy``), modelled from its
  documentation: the replicas that put ``target_ongoing_requests`` requests (running + queued)
  on each, ``ceil(total requests / target_ongoing_requests)``, smoothing factors at 1, with the
  config's target; ``queue_measured``: the same with the target at the band centre of the
  config's setpoint (what the load band aims at, without its hysteresis).
* ``gpu_util``: keep NVML utilisation in a band, ``ceil(n * util / centre)`` outside it, never
  under the queue answer (the sketch of ray-serve-notes.md 5.2).
* ``load_band``: the real ``deployments.autoscaling_policy.LoadBandPolicy``, imported, with the
  serve config's band and setpoint (``slo_streams``, which ``fastcosy calibrate`` wrote from the
  measurement the replica curve comes from: :func:`calibrated_setpoint` re-derives it, and the
  simulation reports whether the two agree).
* ``load_band_no_latch``: ``load_band`` without its scale-in latch (a scale-in asked under the band
  goes on until the load is back at the centre): the band's decision rule before it had one.
* ``load_band_admission``: ``load_band`` with admission at the replicas (``SimConfig.admission``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from bench.calibrate import ROOT, derive
from bench.fleet_inputs import ReplicaModel, ServeSettings
from bench.fleet_model import UTIL
from deployments.autoscaling_policy import LoadBandPolicy


def queue_length_policy(ctx: Any, target: float | None = None) -> tuple[int, dict[str, Any]]:
    """Serve's default: requests per replica held at ``target`` (default: the config's
    ``target_ongoing_requests``)."""
    target = float(target or ctx.config.get_target_ongoing_requests())
    return math.ceil(float(ctx.total_num_requests or 0) / target), dict(ctx.policy_state or {})


class GpuUtilBandPolicy:
    """Keeps the replicas' mean NVML utilisation within ``[low, high]`` %."""

    def __init__(self, low_pct: float = 70.0, high_pct: float = 80.0, metric: str = UTIL) -> None:
        self.low, self.high, self.metric = low_pct, high_pct, metric

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        n = int(ctx.current_num_replicas)
        by_queue, _ = queue_length_policy(ctx)
        readings = list(((ctx.aggregated_metrics or {}).get(self.metric) or {}).values())
        if not n or not readings:
            return max(by_queue, n), dict(ctx.policy_state or {})
        util = sum(readings) / len(readings)
        decision = n
        if util > self.high or util < self.low:
            decision = max(1, math.ceil(n * util / ((self.low + self.high) / 2)))
        return max(decision, by_queue), dict(ctx.policy_state or {}, util_pct=util)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class _Clocked:
    """Sets the policy's clock to the context's time, then calls it."""

    def __init__(self, policy: LoadBandPolicy, clock: _Clock) -> None:
        self.policy, self.clock = policy, clock

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        self.clock.now = float(ctx.current_time)
        return self.policy(ctx)


class NoLatchLoadBand(LoadBandPolicy):
    """The band's stateless rule: scale in only on the ticks whose load reads under ``low``."""

    def by_load(self, n: int, demand: float, load: float) -> int:
        at_mid = max(1, math.ceil(demand / (self.slo_streams * (self.low + self.high) / 200.0)))
        if load > self.high:
            return max(n + 1, at_mid)
        return at_mid if load < self.low and at_mid < n else n


def calibrated_setpoint(replica: ReplicaModel) -> float:
    """What ``fastcosy calibrate`` writes for the replica model's capacity reports."""
    reports = [ROOT / r for r in replica.reports]
    return derive(reports).slo_streams if reports and all(r.is_file() for r in reports) else replica.slo_streams


@dataclass(frozen=True)
class PolicySpec:
    name: str
    label: str
    make: Callable[[], Callable[[Any], tuple[float, dict[str, Any]]]]
    admission: bool = False
    setpoint: str = ""


def policies(settings: ServeSettings, replica: ReplicaModel) -> list[PolicySpec]:
    """The compared policies; ``load_band*`` read the band and its setpoint from the serve config."""
    band = dict(settings.load_band)
    low, high = float(band.get("low_pct", 70)), float(band.get("high_pct", 80))
    setpoint = float(band["slo_streams"])

    def ours(cls: type[LoadBandPolicy] = LoadBandPolicy) -> Callable[[], LoadBandPolicy]:
        # Its clock is the simulation's (``SimContext.current_time``): the rate limit of its log
        # lines runs in simulated time, so the day counts the lines a controller would write.
        def make() -> LoadBandPolicy:
            clock = _Clock()
            policy = cls(low_pct=low, high_pct=high, slo_streams=setpoint, clock=clock)
            return _Clocked(policy, clock)
        return make

    centre = (low + high) / 200 * setpoint
    configured = f"configured: slo_streams {setpoint:g} in {settings.source.split(' (')[0]}"
    band_label = f"load band {low:g}-{high:g} %"
    return [
        PolicySpec("queue", f"queue length only (target_ongoing_requests {settings.target_ongoing_requests:g})",
                   lambda: queue_length_policy),
        PolicySpec("queue_measured", f"queue length only (target {centre:.2f} = band centre x slo_streams)",
                   lambda: partial(queue_length_policy, target=centre), setpoint=configured),
        PolicySpec("gpu_util", f"GPU utilisation band {low:g}-{high:g} %", lambda: GpuUtilBandPolicy(low, high)),
        PolicySpec("load_band", f"{band_label}, slo_streams {setpoint:g} (config)", ours(), setpoint=configured),
        PolicySpec("load_band_no_latch", f"{band_label} without the scale-in latch, slo_streams {setpoint:g}",
                   ours(NoLatchLoadBand), setpoint=configured),
        PolicySpec("load_band_admission", f"{band_label} + admission (429), slo_streams {setpoint:g}", ours(),
                   admission=True, setpoint=configured),
    ]
