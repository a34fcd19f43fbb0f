"""Admission by predicted first audio (deployments/admission.py), on a fake clock; and on a
Synthesizer with the fakes (time is what the fakes say it is, whatever the machine's load)."""
from __future__ import annotations

import asyncio

import pytest

from deployments.admission import EWMA_WEIGHT, RATE_WINDOW_S, Admission
from deployments.protocol import OverloadedError
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments import fakes
from tests.deployments.test_synthesizer_unit import _req


def _admission(enabled: bool = True, slo_s: float = 0.3, window_s: float = 30.0) -> tuple[Admission, fakes.FakeClock]:
    clock = fakes.FakeClock()
    return Admission(slo_s, enabled, window_s, max_load=8, retry_after_s=2, clock=clock), clock


def test_without_readings_every_request_is_admitted_and_the_margin_is_unknown():
    adm, _ = _admission()
    for load in range(1, 9):
        adm.admit(load)
        assert adm.margin_s(load) is None
    assert adm.refused == 0


def test_prediction_is_the_recent_first_audio_at_the_nearest_load_at_or_below():
    adm, _ = _admission()
    adm.first_audio(1, 0.08)
    adm.first_audio(4, 0.20)
    assert adm.model.predict(1) == pytest.approx(0.08)
    assert adm.model.predict(3) == pytest.approx(0.08)  # nearest measured load below
    assert adm.model.predict(6) == pytest.approx(0.20)
    adm.first_audio(4, 0.30)  # a moving average per load
    assert adm.model.predict(4) == pytest.approx(0.20 + EWMA_WEIGHT * 0.10)
    assert adm.margin_s(4) == pytest.approx(0.3 - 0.23)


def test_a_load_predicted_over_the_slo_is_refused_with_retry_after_and_lower_loads_are_not():
    adm, _ = _admission()
    adm.first_audio(2, 0.10)
    adm.first_audio(5, 0.45)
    adm.admit(4)  # 100 ms predicted: admitted
    with pytest.raises(OverloadedError, match="450 ms at 5 streams") as err:
        adm.admit(5)
    assert err.value.retry_after_s == 2
    with pytest.raises(OverloadedError):
        adm.admit(7)
    assert adm.refused == 2 and adm.margin_s(5) == pytest.approx(-0.15)


def test_an_idle_replica_always_admits():
    adm, _ = _admission()
    adm.first_audio(1, 5.0)  # one slow reading (a graph captured on first use)
    adm.admit(1)
    with pytest.raises(OverloadedError):
        adm.admit(2)


def test_disabled_admission_measures_and_reports_but_never_refuses():
    adm, _ = _admission(enabled=False)
    adm.first_audio(1, 2.0)
    adm.admit(1)
    assert adm.margin_s(1) == pytest.approx(-1.7) and adm.refused == 0
    assert adm.snapshot(1)["margin_ms"] == pytest.approx(-1700.0)


def test_old_readings_expire_so_a_refused_load_is_measured_again():
    adm, clock = _admission(window_s=30.0)
    adm.first_audio(1, 0.05)
    clock.advance(20)
    adm.first_audio(3, 0.50)
    with pytest.raises(OverloadedError):
        adm.admit(3)
    clock.advance(11)  # the load-1 reading is 31 s old, the load-3 one 11 s: still refused
    with pytest.raises(OverloadedError):
        adm.admit(3)
    clock.advance(20)  # both expired: no evidence, admitted (and measured again)
    adm.admit(3)
    adm.first_audio(3, 0.12)
    assert adm.margin_s(3) == pytest.approx(0.18)  # a fresh reading replaces the expired one


def test_streams_refused_is_the_refusal_rate_times_the_mean_stream_length():
    adm, clock = _admission()
    adm.stream_ended(4.0)
    adm.stream_ended(6.0)  # mean 4.0 + 0.1 * 2.0 = 4.2 s
    adm.first_audio(1, 1.0)
    for _ in range(5):
        with pytest.raises(OverloadedError):
            adm.admit(2)
    assert adm.refused_per_s() == pytest.approx(5 / RATE_WINDOW_S)
    assert adm.streams_refused() == pytest.approx(5 / RATE_WINDOW_S * 4.2)
    clock.advance(RATE_WINDOW_S + 1)  # the refusals leave the rate window
    assert adm.streams_refused() == 0.0 and adm.refused == 5


def _synth(slo_ms: float, enabled: bool = True) -> Synthesizer:
    cfg = SynthesizerConfig(max_running=4, max_ongoing_requests=4, token2wav={"max_batch_size": 2},
                            admission={"enabled": enabled, "slo_first_audio_ms": slo_ms, "window_s": 30},
                            retry_after_s=3, warmup=False)
    clock = fakes.FakeClock()
    s = Synthesizer(cfg, runtime_factory=fakes.fake_runtime_on(clock), clock=clock)

    async def direct(job):
        return (await s.jobs.run([job]))[0]

    s._token2wav = direct
    return s


async def _chunks(s: Synthesizer, rid: str, seed: int | None = None):
    return [c async for c in s.synthesize(_req(rid, 20, stream=True, seed=seed))]


def test_a_replica_refuses_what_it_measured_it_cannot_start_within_the_slo():
    # The fakes spend STEP_S per decode step and BATCH_S per flow batch: a first chunk of one hop
    # (12 tokens) takes ~12 steps + a batch = ~58 ms of fake time, over a 20 ms SLO.
    s = _synth(slo_ms=20)
    seed = fakes.hold_seed()

    async def main():
        held = s.synthesize(_req("a", 20, stream=True, seed=seed))  # open after its first chunk until released
        await held.__anext__()  # no reading before it: admitted at load 1, and measured
        assert s.admission.margin_s(2) < 0 and s.stats()["admission"]["margin_ms"] < 0
        with pytest.raises(OverloadedError, match="first-audio SLO") as err:
            await _chunks(s, "b")  # load 2, predicted from load 1's reading
        fakes.release(seed)
        rest = [c async for c in held]
        return err.value, rest

    try:
        err, rest = asyncio.run(main())
    finally:
        fakes.release(seed)
    fakes.forget(seed)
    assert rest and rest[-1].is_last and err.retry_after_s == 3
    assert s.metrics.recorded["status"] == ["refused", "ok"]
    assert s._active == 0 and s.loop.stats().open_streams == 0  # a refusal holds nothing
    assert s.health().detail["admission"]["refused_total"] == 1
    assert s.record_autoscaling_stats()["streams_refused"] > 0


@pytest.mark.parametrize("slo_ms, enabled", [(1000, True), (20, False)])
def test_within_the_slo_or_disabled_nothing_is_refused(slo_ms, enabled):
    s = _synth(slo_ms=slo_ms, enabled=enabled)
    seed = fakes.hold_seed()

    async def main():
        held = s.synthesize(_req("a", 20, stream=True, seed=seed))
        await held.__anext__()  # measured at load 1 (~58 ms)
        assert await _chunks(s, "b")  # load 2: admitted
        fakes.release(seed)
        return [c async for c in held]

    try:
        assert asyncio.run(main())
    finally:
        fakes.release(seed)
    fakes.forget(seed)
    assert (s.admission.margin_s(2) > 0) == enabled
    assert s.admission.refused == 0 and s.metrics.recorded["status"] == ["ok", "ok"]
    assert s.record_autoscaling_stats()["streams_refused"] == 0.0
