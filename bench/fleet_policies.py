"""The autoscaling policies the fleet simulation compares, each called as Serve calls a policy.

* ``queue``: Serve's default (``replica_queue_length_autoscaling_policy``), modelled from its
  documentation: the replicas that put ``target_ongoing_requests`` requests (running + queued)
  on each, ``ceil(total requests / target_ongoing_requests)``, smoothing factors at 1.
* ``gpu_util``: keep NVML utilisation in a band, ``ceil(n * util / centre)`` outside it, never
  under the queue answer (the sketch of ray-serve-notes.md 5.2).
* ``load_band``: the real ``deployments.autoscaling_policy.LoadBandPolicy``, imported, with the
  setpoint measured by the Serve capacity report (``slo_streams`` = its streams in flight at
  capacity); ``load_band_config``: the same with the setpoint the configs type (12).
* ``load_band_admission``: ``load_band`` with admission at the replicas (``SimConfig.admission``).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.fleet_inputs import ReplicaModel, ServeSettings
from bench.fleet_model import UTIL
from deployments.autoscaling_policy import LoadBandPolicy


def queue_length_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve's default: requests per replica held at ``target_ongoing_requests``."""
    target = float(ctx.config.get_target_ongoing_requests())
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


@dataclass(frozen=True)
class PolicySpec:
    name: str
    label: str
    make: Callable[[], Callable[[Any], tuple[float, dict[str, Any]]]]
    admission: bool = False
    setpoint: str = ""


def policies(settings: ServeSettings, replica: ReplicaModel) -> list[PolicySpec]:
    """The compared policies; ``load_band*`` read the band from the serve config."""
    band = dict(settings.load_band)
    low, high = float(band.get("low_pct", 70)), float(band.get("high_pct", 80))
    measured = replica.slo_streams
    configured = float(band.get("slo_streams", 12))

    def ours(slo_streams: float) -> Callable[[], LoadBandPolicy]:
        # A long log interval: the simulated day would otherwise log to a logger nobody reads.
        return lambda: LoadBandPolicy(low_pct=low, high_pct=high, slo_streams=slo_streams, log_interval_s=3600)

    return [
        PolicySpec("queue", f"queue length only (target_ongoing_requests {settings.target_ongoing_requests:g})",
                   lambda: queue_length_policy),
        PolicySpec("gpu_util", f"GPU utilisation band {low:g}-{high:g} %", lambda: GpuUtilBandPolicy(low, high)),
        PolicySpec("load_band", f"load band {low:g}-{high:g} %, slo_streams {measured:.1f} (measured)",
                   ours(measured), setpoint=f"measured: {replica.source}"),
        PolicySpec("load_band_config", f"load band {low:g}-{high:g} %, slo_streams {configured:g} (config)",
                   ours(configured), setpoint=f"configured: {settings.source}"),
        PolicySpec("load_band_admission", f"load band {low:g}-{high:g} % + admission (429), slo_streams "
                   f"{measured:.1f}", ours(measured), admission=True, setpoint=f"measured: {replica.source}"),
    ]
