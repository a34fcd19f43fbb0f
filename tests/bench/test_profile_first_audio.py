"""bench/profile_first_audio.py: the trace arithmetic on made-up kernels, and a run on the tiny
model on the CPU (no kernels there; the profiler's own span shows the request's window lands on the
trace's clock)."""
from __future__ import annotations

import gzip
import json
import threading
from pathlib import Path

import pytest

from bench.profile_first_audio import main, shared_ms, stream_lanes, summarize, thread_names, union_ms

ROOT = Path(__file__).resolve().parents[2]


def _kernel(name, stream, ts, dur, correlation=None):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream, "correlation": correlation}}


def _launch(tid, correlation, name="cudaGraphLaunch"):
    return {"cat": "cuda_runtime", "name": name, "ph": "X", "tid": tid, "ts": 0, "dur": 5,
            "args": {"cbid": 311, "correlation": correlation}}


def test_busy_time_is_the_union_of_spans():
    assert union_ms([]) == 0
    assert union_ms([(0, 1000), (500, 1500), (3000, 4000)]) == pytest.approx(2.5)
    assert union_ms([(0, 4000), (1000, 2000)]) == pytest.approx(4.0)


def test_shared_time_is_when_two_or_more_streams_run_kernels():
    assert shared_ms({"7": [(0, 1000)]}) == 0  # one stream is never shared
    assert shared_ms({"7": [(0, 1000), (500, 2000)], "13": [(1500, 3000)]}) == pytest.approx(0.5)
    # 7 with 13 from 1 to 2 ms, 7 with 21 from 1.5 to 4 ms: 1 to 4 ms
    assert shared_ms({"7": [(0, 4000)], "13": [(1000, 2000)], "21": [(1500, 5000)]}) == pytest.approx(3.0)


def test_kernels_are_counted_per_stream_and_clipped_to_the_window():
    events = [
        _kernel("gemm", 7, 0, 2000),  # 1 ms of it inside the window
        _kernel("gemm", 7, 1500, 1000),
        _kernel("softmax", 13, 2000, 3000),  # overlaps stream 7: busy once on the GPU
        _kernel("late", 13, 20000, 100),  # after the window
        {"cat": "cpu_op", "name": "aten::add", "ts": 1500, "dur": 10},  # not a kernel
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 6000, "dur": 500, "args": {"stream": 7}},
    ]
    got = summarize(events, (1000, 11000))
    assert got["window_ms"] == pytest.approx(10.0)
    assert got["streams"] == {
        "13": {"kernels": 1, "kernel_ms": pytest.approx(3.0), "busy_ms": pytest.approx(3.0), "lane": "?"},
        "7": {"kernels": 2, "kernel_ms": pytest.approx(2.0), "busy_ms": pytest.approx(1.5), "lane": "?"}}
    assert got["gpu_busy_ms"] == pytest.approx(4.0) and got["gpu_idle_ms"] == pytest.approx(6.0)
    assert got["streams_overlap_ms"] == pytest.approx(0.5)  # stream 7 until 2.5 ms, stream 13 from 2 ms
    assert [(k["name"], k["count"]) for k in got["top_kernels"]] == [("softmax", 1), ("gemm", 2)]


def test_each_stream_is_named_by_the_thread_that_launched_most_of_its_kernels():
    """An H100 trace's runtime events carry the launching thread's pthread id cut to 32 bits; the
    kernels, the correlation id of their launch. The report once took the LLM's stream (706 kernels
    per decode step) for the flow's; now each stream says whose it is."""
    llm, t2w = 641730880, 905972032  # the 2026-12-05 trace's two launching threads
    events = [_launch(llm, 1), _launch(llm, 2), _launch(t2w, 3), _launch(t2w, 4, "cudaLaunchKernel"),
              _kernel("gemv", 14, 0, 5, correlation=1), _kernel("gemv", 14, 5, 5, correlation=2),
              _kernel("sdpa", 37, 0, 9, correlation=3), _kernel("sdpa", 37, 9, 9, correlation=3),
              _kernel("add", 37, 18, 1, correlation=4),
              _kernel("stray", 14, 20, 1, correlation=4),  # one kernel of the other thread: outvoted
              _kernel("orphan", 99, 0, 1, correlation=42)]  # no launch recorded: no name
    lanes = stream_lanes(events, {llm: "engine-step", t2w: "compute-token2wav"})
    assert lanes == {"14": "engine-step", "37": "compute-token2wav"}
    got = summarize(events, (0, 100), lanes)
    assert {s: v["lane"] for s, v in got["streams"].items()} == {"14": "engine-step", "37": "compute-token2wav",
                                                                 "99": "?"}
    assert stream_lanes(events, {})["14"] == f"thread {llm}"  # an unknown thread keeps its id


def test_this_process_threads_are_found_under_each_id_a_trace_may_use():
    started, release = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), release.wait()), name="compute-token2wav")
    worker.start()
    started.wait()
    try:
        names = thread_names()
    finally:
        release.set()
        worker.join()
    for key in (worker.ident, worker.ident & 0xFFFFFFFF, worker.native_id):
        assert names[key] == "compute-token2wav"
    assert names[threading.main_thread().native_id] == threading.main_thread().name


@pytest.mark.slow  # ~20 s of a profiled replica; the GPU lease's CPU smoke runs the tool by hand
def test_a_run_on_the_tiny_model_profiles_each_request_on_the_trace_clock(tmp_path):
    text = (ROOT / "configs/local.yaml").read_text()
    assert "batch_wait_timeout_s: 0.005}" in text
    config = tmp_path / "local-steps.yaml"
    config.write_text(text.replace("batch_wait_timeout_s: 0.005}", "batch_wait_timeout_s: 0.005, scheduler: steps}"))
    doc = main(["--config", str(config), "--requests", "1", "--audio-s", "1.5", "--chrome", "--out", str(tmp_path),
                "--sessions", "2", "--load-seconds", "0.5", "--mix", "1:1-2"])
    (req,) = doc["requests"]
    assert doc["device"] == "cpu" and "random weights" in doc["model"]
    assert req["flow_passes"] > 0 and req["flow_passes"] % 10 == 0  # ten Euler passes per chunk
    assert 0 < req["ttfa_ms"] <= 1e3 * 60 and req["stages_ms"]["token2wav"] > 0
    assert req["first_audio"]["window_ms"] == pytest.approx(req["ttfa_ms"])
    assert req["first_audio"]["streams"] == {}  # a CPU run has no kernels
    # the window is on the trace's clock: the profiler (its span starts the trace) began just before
    # the submission; a clock mistake would put them hours or days apart
    trace = json.loads(gzip.decompress(next(tmp_path.glob("profile-first-audio-cpu-*-trace.json.gz")).read_bytes()))
    (span,) = [e for e in trace["traceEvents"] if e.get("cat") == "Trace"]
    assert 0 <= req["first_audio_us"][0] - span["ts"] < 60e6
    load = doc["load"]  # two sessions, their span under the profiler
    assert load["sessions"] == 2 and load["requests"] >= 1 and load["flow_passes_whole_run"] > 0
    assert load["profiled"]["window_ms"] > 0 and load["profiled"]["streams"] == {}
    md = next(tmp_path.glob("profile-first-audio-cpu-*.md")).read_text()
    assert "| profile-0 |" in md and "random weights" in md and "Under load: 2 sessions" in md
