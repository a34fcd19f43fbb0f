"""Custom Serve autoscaling policy: keep each replica's load within a band (70-80 %).

The load signal is offered load against measured capacity, not device utilisation:

    load_pct = 100 * (streams in flight + streams queued) / (n * slo_streams)

``slo_streams`` is how many concurrent streams one replica serves within its latency SLO
(measured with ``bench/capacity.py``; config key ``autoscaling.load_band.slo_streams``). The
signal rises in proportion to offered load and does not saturate: NVML's ``utilization.gpu``
is near its top from the first stream on (issue 17; docs/tuning.md §5, "Why not GPU
utilisation"), so it is exported for dashboards only (``deployments.gpu_stats``).

Streams in flight are the replicas' own count (``record_autoscaling_stats`` reports
``streams_in_flight``, time-averaged by Serve over ``look_back_period_s``); streams queued are the
requests waiting at handles (``ctx.total_queued_requests``). Streams refused by the replicas'
admission by deadline (``deployments/admission.py``: 429 when a replica predicts it would start a
stream's audio past the SLO) count as demand too: each replica reports ``streams_refused``, the
streams its refusals would hold in flight (refusals per second x mean stream length, Little's
law), and the policy adds them, so refused requests raise the replica count as queued ones would.
Before any replica has reported, Serve's ``total_num_requests`` (running + queued) stands in.

Decision per tick, with ``n`` running replicas and ``mid`` the band centre:

* ``load > high``: ``max(n + 1, ceil(demand / (slo_streams * mid)))`` (proportional when far above);
* ``load < low``: ``ceil(demand / (slo_streams * mid))`` if that is below ``n`` (the result sits at
  or under ``mid``, so it cannot bounce back above ``high``), never below 1; else ``n``;
* a scale-in, once started (load under ``low``), goes on until the load is back at ``mid``: while
  the load stays between ``low`` and ``mid`` the policy keeps asking for
  ``ceil(demand / (slo_streams * mid))`` (when below ``n``). Serve scales in only after the policy has
  asked for fewer replicas without a break for ``downscale_delay_s``; a demand that hovers at the
  band's lower edge (streams in flight are noisy) would otherwise break that wait on every tick
  it reads just above ``low`` and hold a fleet that should shrink (the fleet simulation's day:
  bench/fleet_sim.py, docs/tuning.md);
* otherwise ``n``;
* never below the queue-length answer ``ceil(total_num_requests / target_ongoing_requests)``, so
  scale-in needs both signals to agree.

Serve applies ``upscale_delay_s`` / ``downscale_delay_s`` and the replica bounds to the answer.
A decision is logged with its inputs (controller log, ``ray.serve``) when it changes, at most once
per ``log_interval_s``: Serve calls the policy every 0.1 s, and a decision that waits out
``downscale_delay_s`` or replicas still starting would otherwise repeat one line thousands of times.
A change made during the quiet interval is logged once it ends, with the count of changes since
the last line.

Configured by ``AutoscalingKnobs.serve_config()`` as ``autoscaling_config.policy =
{"policy_function": "deployments.autoscaling_policy:LoadBandPolicy", "policy_kwargs": {...}}``;
Serve instantiates the class once on the controller. Serve cloudpickles this module by value
onto the controller: it imports only the stdlib.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

# The controller's Serve logger, so decisions land in the controller log next to Serve's own.
logger = logging.getLogger("ray.serve")

STREAMS_METRIC = "streams_in_flight"
REFUSED_METRIC = "streams_refused"  # demand refused by admission (deployments/admission.py)


class LoadBandPolicy:
    """Keeps ``load_pct`` (see the module docstring) within ``[low_pct, high_pct]``.

    Args:
        low_pct: scale in below this load.
        high_pct: scale out above this load.
        slo_streams: concurrent streams one replica serves within the SLO (the 100 % mark).
        metric: the replicas' autoscaling metric counting streams in flight.
        log_interval_s: least time between two decision log lines.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, low_pct: float = 70.0, high_pct: float = 80.0, slo_streams: float = 12.0,
                 metric: str = STREAMS_METRIC, log_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < low_pct < high_pct:
            raise ValueError(f"need 0 < low_pct < high_pct, got {low_pct}, {high_pct}")
        if slo_streams <= 0:
            raise ValueError(f"slo_streams must be positive, got {slo_streams}")
        if log_interval_s < 0:
            raise ValueError(f"log_interval_s must be >= 0, got {log_interval_s}")
        self.low = float(low_pct)
        self.high = float(high_pct)
        self.slo_streams = float(slo_streams)
        self.metric = metric
        self.log_interval_s = float(log_interval_s)
        self._clock = clock
        self._logged: int | None = None  # the last decision logged
        self._logged_at = -math.inf
        self._changes = 0  # changes of decision since the last line (some held back by the rate limit)
        self._seen: int | None = None  # the previous tick's decision
        self._scaling_in = False  # the load went under the band and has not come back to its centre

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        n = int(ctx.current_num_replicas)
        target_ongoing = float(ctx.config.get_target_ongoing_requests()) if ctx.config is not None else 1.0
        by_queue = math.ceil(float(ctx.total_num_requests or 0) / target_ongoing)
        demand = self.demand(ctx)
        load = self.load_pct(demand, n)
        if load is None:  # no replicas yet (scale from zero): the queue decides alone
            decision, reason = by_queue, "no running replica: queue length"
        else:
            by_load = self.by_load(n, demand, load)
            decision = max(by_load, by_queue)
            reason = "queue length" if by_queue > by_load else "load band"
        lo, hi = int(ctx.capacity_adjusted_min_replicas), int(ctx.capacity_adjusted_max_replicas)
        bounded = max(lo, min(hi, decision))
        if bounded != decision:
            reason += f", bounded to [{lo}, {hi}]"
        state = dict(ctx.policy_state or {})
        state.update(demand_streams=demand, load_pct=load, by_queue=by_queue, decision=bounded, reason=reason,
                     scaling_in=self._scaling_in)
        if self._should_log(bounded, n):
            logger.info("autoscaling %s: %d -> %d replicas (%s; load %s %% of %g SLO streams per replica, "
                        "demand %.1f streams, queue asks %d%s)", ctx.deployment_name, n, bounded, reason,
                        "n/a" if load is None else f"{load:.0f}", self.slo_streams, demand, by_queue,
                        f"; {self._changes} changes since the last line" if self._changes > 1 else "")
            self._changes = 0
        return bounded, state

    def _should_log(self, decision: int, n: int) -> bool:
        """True when ``decision`` differs from the last one logged and the quiet interval is over.

        A first decision that holds ``n`` is not news. Changes inside the interval are counted and
        the latest one is logged when the interval ends, so the log never stays on a stale answer.
        """
        self._changes += decision != self._seen and self._seen is not None
        self._seen = decision
        if decision == self._logged or (self._logged is None and decision == n):
            return False
        now = self._clock()
        if now - self._logged_at < self.log_interval_s:
            return False
        self._logged, self._logged_at = decision, now
        return True

    def demand(self, ctx: Any) -> float:
        """Streams in flight at the running replicas, plus those their admission refused, plus
        streams queued at handles."""
        metrics = ctx.aggregated_metrics or {}
        running = set(ctx.running_replicas or [])

        def of_running(name: str) -> list[float]:
            return [float(v) for rid, v in (metrics.get(name) or {}).items() if not running or rid in running]

        values = of_running(self.metric)
        if not values:
            return float(ctx.total_num_requests or 0)
        return sum(values) + sum(of_running(REFUSED_METRIC)) + float(ctx.total_queued_requests or 0)

    def load_pct(self, demand: float, n: int) -> float | None:
        """The load signal: ``100 * demand / (n * slo_streams)``; None without replicas."""
        return 100.0 * demand / (n * self.slo_streams) if n > 0 else None

    def by_load(self, n: int, demand: float, load: float) -> int:
        mid = (self.low + self.high) / 200.0
        at_mid = max(1, math.ceil(demand / (self.slo_streams * mid)))
        if load > self.high:
            self._scaling_in = False
            return max(n + 1, at_mid)
        if load < self.low:
            self._scaling_in = True
        elif load >= 100.0 * mid:  # back at the centre: the scale-in is over
            self._scaling_in = False
        if self._scaling_in and at_mid < n:
            return at_mid
        return n
