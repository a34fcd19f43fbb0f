"""Decisions of the load-band autoscaling policy, on Serve's real AutoscalingContext."""
from __future__ import annotations

import itertools
import logging

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.autoscaling_policy import LoadBandPolicy
from deployments.options import AutoscalingKnobs

DEP = DeploymentID(name="Synthesizer", app_name="tts")
SLO = 8.0  # streams per replica at the SLO: 6 streams per replica is the band centre (75 %)


def _ctx(streams: list[float] | None, queued: float = 0.0, requests: float | None = None, target_ongoing: float = 24,
         lo: int = 1, hi: int = 8, n: int | None = None, state: dict | None = None) -> AutoscalingContext:
    count = n if n is not None else len(streams or [1])
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=DEP) for i in range(count)]
    metrics = ({"streams_in_flight": {r: s for r, s in zip(replicas, streams, strict=True)}}
               if streams is not None else {})
    total = requests if requests is not None else sum(streams or []) + queued
    return AutoscalingContext(
        deployment_id=DEP, deployment_name="Synthesizer", app_name="tts", current_num_replicas=count,
        target_num_replicas=count, running_replicas=replicas, total_num_requests=total,
        total_queued_requests=queued, aggregated_metrics=metrics, raw_metrics={}, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state=state or {}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=0.0,
        config=AutoscalingConfig(min_replicas=lo, max_replicas=hi, target_ongoing_requests=target_ongoing),
    )


policy = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO)


@pytest.mark.parametrize("streams, queued, expected", [
    ([6, 6], 0, 2),            # 75 %: inside the band, hold
    ([5.6, 5.6], 0, 2),        # 70 %: band edges are inside
    ([6.4, 6.4], 0, 2),        # 80 %
    ([7, 7], 0, 3),            # 87.5 %: one more (ceil(14 / 6) = 3)
    ([8, 8], 8, 4),            # 150 %: proportional, ceil(24 / 6) = 4
    ([8, 8, 8, 8], 16, 8),     # ceil(48 / 6) = 8
    ([4, 4], 0, 2),            # 50 %: ceil(8 / 6) = 2, no fewer replicas keep load under the band centre
    ([2, 2], 0, 1),            # 25 %: ceil(4 / 6) = 1
    ([1, 1, 1, 1], 0, 1),      # far below: proportional
    ([5, 5, 5, 5], 0, 4),      # 62.5 %: ceil(20 / 6) = 4 = n, hold (3 would be 83 %, above the band)
    ([0], 0, 1),               # idle: never below one replica by load
])
def test_band_decisions(streams, queued, expected):
    decision, state = policy(_ctx(streams, queued=queued))
    assert decision == expected
    assert state["load_pct"] == pytest.approx(100 * (sum(streams) + queued) / (len(streams) * SLO))


def test_the_signal_rises_with_offered_load_and_does_not_saturate():
    # One replica, offered load from 1 stream to 4x capacity: the signal grows in proportion
    # (unlike NVML's utilisation, ~88 % at one stream and ~96 % beyond), and so do the decisions.
    loads, decisions = [], []
    for offered in range(1, 33):
        in_flight = min(offered, SLO)  # the replica admits up to its capacity, the rest queues
        decision, state = policy(_ctx([in_flight], queued=offered - in_flight, requests=offered))
        loads.append(state["load_pct"])
        decisions.append(decision)
    assert all(b > a for a, b in itertools.pairwise(loads))
    assert loads[0] == pytest.approx(100 / SLO) and loads[-1] == pytest.approx(400)
    assert decisions == sorted(decisions) and decisions[0] == 1 and decisions[-1] == 6  # ceil(32 / 6)


def test_a_decision_never_undoes_itself():
    # Whatever the load, the replica count chosen puts the next tick's load inside or under the band
    # (no flapping between scale-in and scale-out at the same demand).
    for demand10 in range(1, 400):
        demand = demand10 / 10
        for n in range(1, 8):
            decided, _ = policy(_ctx([demand / n] * n, hi=100))
            _, after = policy(_ctx([demand / decided] * decided, hi=100))
            assert after["load_pct"] <= 80 + 1e-9 or decided == 1, (demand, n, decided)
            again, _ = policy(_ctx([demand / decided] * decided, hi=100))
            assert again == decided, (demand, n, decided)


def test_a_scale_in_goes_on_until_the_load_is_back_at_the_band_centre():
    # Serve scales in only after the policy asked for fewer replicas without a break for
    # downscale_delay_s: a demand hovering at the lower edge must not break that wait.
    latch = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO)
    hovering = [_ctx([5.4] * 10, hi=100), _ctx([5.7] * 10, hi=100), _ctx([5.5] * 10, hi=100),
                _ctx([5.8] * 10, hi=100)]  # 67.5-72.5 %
    decisions = [latch(ctx)[0] for ctx in hovering]
    assert decisions == [9, 10, 10, 10]  # 57 streams need 10 replicas at the centre: the ceil holds n
    wider = [_ctx([v] * 30, hi=100) for v in (5.3, 5.7, 5.5, 5.75)]  # 66.25-71.9 %
    # 30 replicas: ceil(171 / 6) = 29 < 30 at 71.25 %: the scale-in asked at 66.25 % goes on
    assert [latch(ctx)[0] for ctx in wider] == [27, 29, 28, 29]
    assert latch(wider[1])[1]["scaling_in"]
    # the stateless rule would have held 30 whenever the load read above 70 %
    fresh = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO)
    assert [fresh(ctx)[0] for ctx in wider[1:2] + wider[3:]] == [30, 30]
    # back at the centre (75 %): the scale-in is over, and the band holds n again
    decision, state = latch(_ctx([6.0] * 30, hi=100))
    assert decision == 30 and not state["scaling_in"]
    assert latch(_ctx([5.7] * 30, hi=100))[0] == 30
    # above the band: scale out, and no scale-in carries over
    assert latch(_ctx([5.3] * 30, hi=100))[0] == 27 and latch(_ctx([7.0] * 30, hi=100))[0] == 35
    assert not latch(_ctx([5.7] * 35, hi=100))[1]["scaling_in"]


def test_queue_length_is_a_floor():
    # 100 requests at target 24 per replica -> 5 replicas although the replicas' load says scale in.
    decision, state = policy(_ctx([1, 1], requests=100))
    assert decision == 5 and state["by_queue"] == 5 and state["reason"] == "queue length"


def test_bounds_are_applied():
    assert policy(_ctx([8] * 8, queued=40, hi=8))[0] == 8
    assert policy(_ctx([1, 1], lo=2))[0] == 2


def test_without_replica_readings_serve_request_count_stands_in():
    assert policy(_ctx(None, requests=0))[0] == 1
    decision, state = policy(_ctx(None, requests=20, target_ongoing=24))  # 20 / 8 = 250 %: ceil(20 / 6) = 4
    assert decision == 4 and state["demand_streams"] == 20


def test_replicas_no_longer_running_are_ignored():
    ctx = _ctx([6, 6])
    stale = ReplicaID(unique_id="gone", deployment_id=DEP)
    ctx.aggregated_metrics["streams_in_flight"][stale] = 100.0
    assert policy(ctx)[1]["demand_streams"] == 12


def test_streams_refused_by_admission_count_as_demand():
    # Two replicas inside the band (75 %) that refuse requests (429, deployments/admission.py):
    # the refused streams they report (refusals/s x mean stream length) join the demand, so the
    # policy scales out although the streams in flight alone would hold.
    ctx = _ctx([6, 6])
    assert policy(ctx)[0] == 2
    ctx.aggregated_metrics["streams_refused"] = {r: 3.0 for r in ctx.running_replicas}
    decision, state = policy(ctx)
    assert state["demand_streams"] == 18 and decision == 3  # ceil(18 / 6)
    stale = ReplicaID(unique_id="gone", deployment_id=DEP)
    ctx.aggregated_metrics["streams_refused"][stale] = 50.0  # a replica no longer running: ignored
    assert policy(ctx)[1]["demand_streams"] == 18


def test_decisions_are_logged_with_their_inputs(caplog):
    policy = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        policy(_ctx([6, 6]))  # hold: nothing logged
        assert not caplog.records
        policy(_ctx([8, 8], queued=8))
    (record,) = caplog.records
    message = record.getMessage()
    assert "2 -> 4 replicas" in message and "load band" in message and "load 150 %" in message


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _decision_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "replicas (" in r.getMessage()]


def test_the_same_decision_is_logged_once_over_many_ticks(caplog):
    # Replicas still starting (or a scale-in waiting out downscale_delay_s): the decision differs
    # from the running count on every 0.1 s tick. One line, not one per tick.
    clock = FakeClock()
    policy = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO, log_interval_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for _ in range(400):  # 40 s of ticks
            assert policy(_ctx([8, 8], queued=8))[0] == 4
            clock.now += 0.1
    (line,) = _decision_lines(caplog)
    assert "2 -> 4 replicas" in line


def test_a_changed_decision_is_logged_again(caplog):
    clock = FakeClock()
    policy = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO, log_interval_s=10, clock=clock)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        policy(_ctx([8, 8], queued=8))  # -> 4
        clock.now = 11
        policy(_ctx([8, 8], queued=8))  # same: nothing
        policy(_ctx([8, 8, 8, 8], queued=16))  # -> 8
    assert [line.split(" (")[0] for line in _decision_lines(caplog)] == [
        "autoscaling Synthesizer: 2 -> 4 replicas", "autoscaling Synthesizer: 4 -> 8 replicas"]


def test_the_rate_limit_holds_and_the_latest_change_is_logged_when_it_ends(caplog):
    clock = FakeClock()
    policy = LoadBandPolicy(low_pct=70, high_pct=80, slo_streams=SLO, log_interval_s=10, clock=clock)
    flapping = [_ctx([8, 8], queued=8), _ctx([8, 8, 8, 8], queued=16), _ctx([7, 7])]  # -> 4, 8, 3
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        for tick in range(99):  # 9.9 s of a decision that changes every tick
            policy(flapping[tick % 3])
            clock.now += 0.1
        assert len(_decision_lines(caplog)) == 1  # the first, then quiet for 10 s
        clock.now = 10.0
        policy(_ctx([7, 7]))  # 10 s after the first line: the current decision (3), with the count
    lines = _decision_lines(caplog)
    assert len(lines) == 2 and "2 -> 3 replicas" in lines[1] and "98 changes since the last line" in lines[1]


def test_policy_state_is_carried():
    _, state = policy(_ctx([6], state={"previous": 1}))
    assert state["previous"] == 1 and state["decision"] == 1


@pytest.mark.parametrize("kwargs", [{"low_pct": 80, "high_pct": 70}, {"slo_streams": 0}, {"log_interval_s": -1}])
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        LoadBandPolicy(**kwargs)


def test_config_passes_the_band_and_capacity_to_serve():
    knobs = AutoscalingKnobs(max_replicas=4, load_band={"enabled": True, "slo_streams": 12})
    policy_cfg = knobs.serve_config()["policy"]
    assert policy_cfg["policy_function"] == "deployments.autoscaling_policy:LoadBandPolicy"
    built = LoadBandPolicy(**policy_cfg["policy_kwargs"])
    assert (built.low, built.high, built.slo_streams, built.metric) == (70, 80, 12, "streams_in_flight")
    assert "policy" not in AutoscalingKnobs(max_replicas=4).serve_config()
