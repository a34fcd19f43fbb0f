"""bench.ramp without a service: phase parsing, per-phase figures from a sampled series, report files."""
from __future__ import annotations

import pytest

from bench.ramp import Phase, markdown, phase_figures, plot


def test_phase_parse_and_bad_phases():
    assert Phase.parse("high:2.5:120") == Phase("high", 2.5, 120.0)
    for bad in ("high:2", "high:x:10", "low:0:10", "low:1:-5"):
        with pytest.raises(ValueError):
            Phase.parse(bad)


def _summary(requests: int) -> dict:
    return {"requests": requests, "ok": requests, "lost": 0, "rejected_429": 0, "ttfa_p50_ms": 120.0,
            "ttfa_p99_ms": 300.0, "throughput_x_realtime": 1.5}


def test_phase_figures_and_report(tmp_path):
    series = [{"t_s": 1.0, "replicas": 1, "utilization_pct": {"a": 20.0}, "queue": {"a": 0}},
              {"t_s": 12.0, "replicas": 1, "utilization_pct": {"a": 95.0}, "queue": {"a": 4}},
              {"t_s": 15.0, "replicas": 2, "utilization_pct": {"a": 85.0, "b": 60.0}, "queue": {"a": 3, "b": 2}},
              {"t_s": 16.0, "error": "ConnectError"},  # a failed poll is kept but not counted
              {"t_s": 25.0, "replicas": 1, "utilization_pct": {"a": 10.0}, "queue": {"a": 0}}]
    phases = [{"phase": "low", "rate_rps": 0.5, "duration_s": 10, "start_s": 0.0, "end_s": 10.0, "summary": _summary(5)},
              {"phase": "high", "rate_rps": 2, "duration_s": 10, "start_s": 10.0, "end_s": 20.0, "summary": _summary(20)},
              {"phase": "low", "rate_rps": 0.5, "duration_s": 10, "start_s": 20.0, "end_s": 30.0, "summary": _summary(5)}]
    low, high, low2 = phase_figures(phases, series)
    assert low["replicas_min_max"] == [1, 1] and low["utilization_pct_median"] == 20.0
    assert high["replicas_min_max"] == [1, 2] and high["replicas_at_end"] == 2
    assert high["utilization_pct_median"] == 85.0  # median of 95, 85, 60
    assert low2["replicas_at_end"] == 1
    result = {"phases": phases, "series": series, "target": "cfg.yaml", "date": "2026-12-03", "machine": "test",
              "sample_s": 2.0, "band_pct": [70.0, 80.0], "plot": "ramp.png"}
    plot(result, tmp_path / "ramp.png", "test")
    assert (tmp_path / "ramp.png").stat().st_size > 10_000
    md = markdown(result)
    assert "| high | 2 | 10 | 20 | 20 | 0 | 0 | 120 / 300 | 1.50 | 1-2 (2) | 85 | 0 |" in md


def test_sampler_keeps_only_answers_of_this_poll(monkeypatch):
    import httpx

    from bench.ramp import HealthSampler

    body = {"synthesizer_running_replicas": 2, "probes_failed": 3,
            "synthesizer_replicas": {"fresh": {"utilization_pct": 77.0, "engine": {"running": 2, "waiting": 1}}},
            "synthesizer_replicas_unreached": {"stale": {"age_s": 40.0, "utilization_pct": 99.0,
                                                         "engine": {"running": 4}}}}

    class _R:
        def json(self):
            return body

    monkeypatch.setattr(httpx, "get", lambda *a, **k: _R())
    row = HealthSampler("http://x", every_s=2.0).sample()
    assert row["replicas"] == 2 and row["probes_failed"] == 3
    assert row["utilization_pct"] == {"fresh": 77.0} and row["queue"] == {"fresh": 3}
