"""Decisions of the GPU-utilisation autoscaling policy, on Serve's real AutoscalingContext."""
from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling_policy import GpuUtilizationPolicy

DEP = DeploymentID(name="Synthesizer", app_name="tts")


def _ctx(utils: list[float] | None, requests: float = 0.0, target_ongoing: float = 24, lo: int = 1, hi: int = 8,
         state: dict | None = None) -> AutoscalingContext:
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(len(utils or [1]))]
    metrics = {"gpu_utilization_pct": {r: u for r, u in zip(replicas, utils, strict=True)}} if utils is not None else {}
    return AutoscalingContext(
        deployment_id=DEP, deployment_name="Synthesizer", app_name="tts", current_num_replicas=len(replicas),
        target_num_replicas=len(replicas), running_replicas=replicas, total_num_requests=requests,
        total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state=state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=lo, max_replicas=hi, target_ongoing_requests=target_ongoing),
    )


policy = GpuUtilizationPolicy(low_pct=70, high_pct=80)


@pytest.mark.parametrize("utils, expected", [
    ([75, 75], 2),          # inside the band: hold
    ([70, 80], 2),          # band edges are inside
    ([81, 85], 3),          # just above: one more
    ([100, 100], 3),        # ceil(2 * 100 / 75) = 3
    ([100, 100, 100, 100], 6),  # proportional when far above: ceil(4 * 100 / 75)
    ([60, 60], 1),          # below: one fewer
    ([10, 10, 10, 10], 1),  # far below: proportional, ceil(4 * 10 / 75) = 1
    ([65, 65, 65, 65], 3),  # min(n - 1, ceil(4 * 65 / 75) = 4) = 3
    ([50], 1),              # never below one replica by utilisation
])
def test_band_decisions(utils, expected):
    decision, state = policy(_ctx(utils))
    assert decision == expected
    assert state["mean_util"] == pytest.approx(sum(utils) / len(utils))


def test_queue_backlog_overrides_low_utilisation():
    # 100 requests at target 24 per replica -> 5 replicas although utilisation says scale in.
    decision, state = policy(_ctx([40, 40], requests=100))
    assert decision == 5 and state["by_queue"] == 5


def test_bounds_are_applied():
    assert policy(_ctx([100] * 8, hi=8))[0] == 8
    assert policy(_ctx([10, 10], lo=2))[0] == 2


def test_no_readings_keeps_current_or_follows_queue():
    assert policy(_ctx(None))[0] == 1
    assert policy(_ctx(None, requests=50))[0] == 3


def test_policy_state_is_carried():
    _, state = policy(_ctx([75], state={"previous": 1}))
    assert state["previous"] == 1 and state["decision"] == 1


def test_invalid_band():
    with pytest.raises(ValueError):
        GpuUtilizationPolicy(low_pct=80, high_pct=70)
