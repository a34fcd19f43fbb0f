import math

import pytest

from bench.metrics import RequestTrace, summarize


def _trace(times, seconds, submitted=0.0):
    tr = RequestTrace(submitted_s=submitted)
    for t, s in zip(times, seconds):
        tr.add_chunk(t, int(s * tr.sample_rate))
    return tr


def test_no_underrun_when_chunks_arrive_before_playback_ends():
    tr = _trace([0.1, 1.0, 2.9], [1.0, 2.0, 4.0])
    assert tr.underruns() == 0
    assert tr.ttfa_s == pytest.approx(0.1)
    assert tr.audio_s == pytest.approx(7.0)
    assert tr.rtf == pytest.approx(2.9 / 7.0)


def test_late_chunk_is_one_underrun_and_playback_rebuffers():
    # chunk 1 due at 1.1 (0.1 + 1 s of audio) arrives at 1.5 -> stall; playback resumes at 1.5,
    # so chunk 2 is due at 1.5 + 0.5 = 2.0 and arrives at 1.9: no second underrun.
    tr = _trace([0.1, 1.5, 1.9], [1.0, 0.5, 1.0])
    assert tr.underruns() == 1
    tr2 = _trace([0.1, 1.5, 2.1], [1.0, 0.5, 1.0])
    assert tr2.underruns() == 2


def test_summary_counts_errors_and_throughput():
    ok = _trace([0.2, 0.9], [1.0, 1.0])
    bad = RequestTrace(submitted_s=0.0, error="503")
    s = summarize([ok, bad], wall_s=1.0)
    assert s["requests"] == 2 and s["errors"] == 1
    assert s["throughput_x_realtime"] == pytest.approx(2.0)
    assert s["ttfa_p50_ms"] == pytest.approx(200.0)
    assert not math.isnan(s["rtf_p50"])


def test_playback_deadline_follows_the_playback_model():
    assert RequestTrace(submitted_s=3.0).playback_deadline_s() == 3.0  # first audio is due at once
    assert _trace([0.1, 1.0], [1.0, 2.0]).playback_deadline_s() == pytest.approx(3.1)
    assert _trace([0.1, 1.5], [1.0, 0.5]).playback_deadline_s() == pytest.approx(2.0)  # re-buffered at 1.5


def test_a_run_folder_updates_the_latest_file_beside_it_with_the_folder_in_the_name(tmp_path):
    from bench.report import latest_for

    results = tmp_path / "results"
    run = results / "2026-12-07-h100-capacity"
    run.mkdir(parents=True)
    (results / "latest.json").write_text("{}")
    assert latest_for(run, "cosyvoice2") == (results / "latest.json", "2026-12-07-h100-capacity/")
    assert latest_for(run, "cosyvoice3") == (run / "cosyvoice3-latest.json", "")  # none beside: its own
    (run / "latest.json").write_text("{}")  # a device call's staging folder holds its own copy
    assert latest_for(run, "cosyvoice2") == (run / "latest.json", "")
