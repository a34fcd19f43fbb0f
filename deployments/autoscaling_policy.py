"""Custom Serve autoscaling policy: keep measured GPU utilisation within a band (70-80 %).

Configured by ``AutoscalingKnobs.serve_config()`` as
``autoscaling_config.policy = {"policy_function": "deployments.autoscaling_policy:GpuUtilizationPolicy",
"policy_kwargs": {...}}``. Serve instantiates the class once on the controller and calls it every
control-loop tick with an ``AutoscalingContext``; it still applies ``upscale_delay_s`` /
``downscale_delay_s`` and the replica bounds to what we return. Replicas report the metric from
``Synthesizer.record_autoscaling_stats`` (NVML utilisation, or the compute busy fraction).

Decision per tick, with ``n`` running replicas, mean utilisation ``u`` and ``mid`` the band centre:

* ``u > high``: ``max(n + 1, ceil(n * u / mid))`` (scale out, proportionally when far above);
* ``u < low``:  ``min(n - 1, ceil(n * u / mid))`` (scale in), never below 1;
* otherwise ``n``;
* the result is never below the queue-length answer ``ceil(total_requests / target_ongoing)``,
  so a backlog scales out even when utilisation looks low, and scale-in needs both signals.

Serve cloudpickles this module by value onto the controller: it imports only the stdlib.
"""
from __future__ import annotations

import math
from typing import Any


class GpuUtilizationPolicy:
    def __init__(self, low_pct: float = 70.0, high_pct: float = 80.0, metric: str = "gpu_utilization_pct") -> None:
        if not 0 <= low_pct < high_pct <= 100:
            raise ValueError(f"need 0 <= low_pct < high_pct <= 100, got {low_pct}, {high_pct}")
        self.low = float(low_pct)
        self.high = float(high_pct)
        self.metric = metric

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        n = int(ctx.current_num_replicas)
        target_ongoing = float(ctx.config.get_target_ongoing_requests()) if ctx.config is not None else 1.0
        by_queue = math.ceil(float(ctx.total_num_requests or 0) / target_ongoing)
        util = self.mean_utilization(ctx)
        state = dict(ctx.policy_state or {})
        state.update(by_queue=by_queue, mean_util=util)
        if n == 0 or util is None:
            # No replicas (scale from zero) or no readings yet: the queue decides alone.
            decision = max(by_queue, n if util is None else 0)
        else:
            decision = max(self.by_utilization(n, util), by_queue)
        lo, hi = int(ctx.capacity_adjusted_min_replicas), int(ctx.capacity_adjusted_max_replicas)
        decision = max(lo, min(hi, decision))
        state["decision"] = decision
        return decision, state

    def by_utilization(self, n: int, util: float) -> int:
        mid = (self.low + self.high) / 2.0
        proportional = math.ceil(n * util / mid)
        if util > self.high:
            return max(n + 1, proportional)
        if util < self.low:
            return max(1, min(n - 1, proportional))
        return n

    def mean_utilization(self, ctx: Any) -> float | None:
        per_replica = (ctx.aggregated_metrics or {}).get(self.metric) or {}
        running = set(ctx.running_replicas or [])
        values = [float(v) for rid, v in per_replica.items() if not running or rid in running]
        return sum(values) / len(values) if values else None
