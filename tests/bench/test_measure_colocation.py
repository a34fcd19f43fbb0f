"""The one-vs-two deployments measurement (bench/measure_colocation.py) runs end to end
on the CPU with the tiny model: every layout reports its timings (the GPU numbers come from a lease)."""
from __future__ import annotations

import pytest

from bench.measure_colocation import Setup, measure


@pytest.mark.slow  # ~8 s of every layout on the CPU
def test_every_layout_is_measured():
    res = measure(Setup(device="cpu", size="tiny", steps=6, flow_jobs=2))
    assert res["gpu"] == "cpu" and res["steps"] == 6
    assert res["llm_alone"]["step_ms_median"] > 0 and res["flow_alone"]["job_ms_median"] > 0
    assert res["serial_one_thread"]["step_ms_p95"] >= res["serial_one_thread"]["step_ms_median"] > 0
    assert res["two_threads_one_process"]["job_ms_median"] > 0
    # every phase timed real decode steps: the 16 requests were still running after each
    assert [res[k]["running"] for k in ("llm_alone", "serial_one_thread", "two_threads_one_process")] == [16] * 3
    procs = res["two_processes_same_gpu"]
    assert procs["llm"]["median_ms"] > 0 and procs["flow"]["median_ms"] > 0 and procs["wall_s"] > 0
