"""Admission by predicted first audio (deployments/admission.py), on a fake clock; and on a
Synthesizer with the fakes (time is what the fakes say it is, whatever the machine's load)."""
from __future__ import annotations

import asyncio

import pytest

from deployments.admission import RATE_WINDOW_S, Admission
from deployments.protocol import OverloadedError
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments import fakes
from tests.deployments.test_synthesizer_unit import _req


def _admission(enabled: bool = True, slo_s: float = 0.3, half_life_s: float = 10.0, min_samples: float = 3,
               explore_share: float = 0.0) -> tuple[Admission, fakes.FakeClock]:
    clock = fakes.FakeClock()
    return Admission(slo_s, enabled, half_life_s, max_load=8, retry_after_s=2, min_samples=min_samples,
                     explore_share=explore_share, clock=clock), clock


def _read(adm: Admission, load: int, seconds: float, times: int = 1) -> None:
    for _ in range(times):
        adm.first_audio(load, seconds)


def test_without_readings_every_request_is_admitted_and_the_margin_is_unknown():
    adm, _ = _admission()
    for load in range(1, 9):
        adm.admit(load)
        assert adm.margin_s(load) is None
    assert adm.refused == 0


def test_the_prediction_is_a_monotone_fit_over_every_load():
    adm, _ = _admission()
    _read(adm, 1, 0.08, 3)
    _read(adm, 4, 0.20, 2)
    assert adm.model.predict(1).first_audio_s == pytest.approx(0.08)
    assert adm.model.predict(3).first_audio_s == pytest.approx(0.08)  # the highest measured load below
    assert adm.model.predict(6).first_audio_s == pytest.approx(0.20)
    _read(adm, 4, 0.35)  # a weighted mean per load: (2 x 0.20 + 0.35) / 3
    assert adm.model.predict(4).first_audio_s == pytest.approx(0.25)
    assert adm.margin_s(4) == pytest.approx(0.3 - 0.25)
    # a slow load below faster ones is pooled with them: more streams never predict faster
    _read(adm, 2, 0.50)
    _read(adm, 3, 0.10, 3)
    pooled = (0.50 + 3 * 0.10) / 4
    assert adm.model.predict(2).first_audio_s == pytest.approx(pooled) == adm.model.predict(3).first_audio_s
    assert adm.model.weight_over(3, 0.15) == 4 and adm.model.weight_over(8, 0.15) == 4 + 3


def test_readings_fade_with_their_half_life():
    adm, clock = _admission(half_life_s=10.0)
    _read(adm, 2, 0.10, 4)
    clock.advance(10)
    assert adm.model.weight_over(2, 0.0) == pytest.approx(2.0)
    _read(adm, 2, 0.40, 2)  # the newer readings weigh as much as the four older ones now
    assert adm.model.predict(2).first_audio_s == pytest.approx(0.25)
    clock.advance(200)  # faded out: forgotten
    assert adm.model.predict(2) is None and adm.margin_s(2) is None


def test_a_load_predicted_over_the_slo_with_enough_readings_is_refused_with_retry_after():
    adm, _ = _admission(min_samples=3)
    _read(adm, 2, 0.10, 3)
    _read(adm, 5, 0.45, 2)
    adm.admit(5)  # 450 ms predicted, but from 2 readings: admitted (and measured)
    _read(adm, 5, 0.45)
    adm.admit(4)  # 100 ms predicted: admitted
    with pytest.raises(OverloadedError, match="450 ms at 5 streams") as err:
        adm.admit(5)
    assert err.value.retry_after_s == 2
    with pytest.raises(OverloadedError):
        adm.admit(7)
    assert adm.refused == 2 and adm.margin_s(5) == pytest.approx(-0.15)


def test_a_share_of_would_be_refusals_is_admitted_to_keep_measuring():
    adm, _ = _admission(min_samples=1, explore_share=0.25)
    _read(adm, 2, 0.50)
    outcomes = []
    for _ in range(12):
        try:
            adm.admit(3)
            outcomes.append("admitted")
        except OverloadedError:
            outcomes.append("refused")
    assert outcomes == ["refused", "refused", "refused", "admitted"] * 3
    assert (adm.refused, adm.explored) == (9, 3) and adm.snapshot(3)["explored_total"] == 3


def test_an_idle_replica_always_admits():
    adm, _ = _admission(min_samples=1)
    _read(adm, 1, 5.0)  # a slow reading (a graph captured on first use)
    adm.admit(1)
    with pytest.raises(OverloadedError):
        adm.admit(2)


def test_disabled_admission_measures_and_reports_but_never_refuses():
    adm, _ = _admission(enabled=False, min_samples=1)
    _read(adm, 1, 2.0)
    _read(adm, 2, 2.0, 5)
    adm.admit(2)
    assert adm.margin_s(1) == pytest.approx(-1.7) and adm.refused == 0
    snap = adm.snapshot(1)
    assert snap["margin_ms"] == pytest.approx(-1700.0) and snap["first_audio_ms_by_load"][2]["weight"] == 5


def test_streams_refused_is_the_refusal_rate_times_the_mean_stream_length():
    adm, clock = _admission(min_samples=1, half_life_s=1000.0)
    adm.stream_ended(4.0)
    adm.stream_ended(6.0)  # mean 4.0 + 0.1 * 2.0 = 4.2 s
    _read(adm, 1, 1.0)
    for _ in range(5):
        with pytest.raises(OverloadedError):
            adm.admit(2)
    assert adm.refused_per_s() == pytest.approx(5 / RATE_WINDOW_S)
    assert adm.streams_refused() == pytest.approx(5 / RATE_WINDOW_S * 4.2)
    clock.advance(RATE_WINDOW_S + 1)  # the refusals leave the rate window
    assert adm.streams_refused() == 0.0 and adm.refused == 5


@pytest.mark.parametrize("kwargs", [{"explore_share": 1.5}, {"half_life_s": 0.0}])
def test_invalid_arguments(kwargs):
    with pytest.raises(ValueError):
        _admission(**kwargs)


def _synth(slo_ms: float, enabled: bool = True) -> Synthesizer:
    cfg = SynthesizerConfig(max_running=4, max_ongoing_requests=4, token2wav={"max_batch_size": 2},
                            # one reading refuses (its weight fades from 1 as the fake time goes on), none explored
                            admission={"enabled": enabled, "slo_first_audio_ms": slo_ms, "half_life_s": 30,
                                       "min_samples": 0.5, "explore_share": 0.0},
                            retry_after_s=3, warmup=False)
    clock = fakes.FakeClock()
    s = Synthesizer(cfg, runtime_factory=fakes.fake_runtime_on(clock), clock=clock)

    s.outside_serve()  # no @serve.batch outside a replica
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
