"""bench/cold_start.py: a new replica's start, process start -> first request served."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from bench import cold_start
from cosyvoice_runtime.tiny_model import write_tiny_model

PRODUCT_MODULES = ["deployments/frontend.py", "deployments/runtime_adapter.py", "deployments/assembler.py", "deployments/warmup.py",
                   "deployments/synthesizer.py", "cosyvoice_runtime/model.py", "cosyvoice_runtime/graph_schedule.py"]


def test_every_phase_template_is_a_log_line_the_product_still_writes():
    # a reworded log line would silently drop its phase from every report
    source = "".join(Path(p).read_text() for p in PRODUCT_MODULES)
    for template in [*cold_start.PHASES, *cold_start.BESIDE, cold_start.READY]:
        assert f'"{template}"' in source, template


def test_the_handler_keeps_only_phase_lines_with_their_time_since_process_start():
    log = cold_start.StartLog(process_start=100.0)
    record = logging.LogRecord("deployments.warmup", logging.INFO, __file__, 1, "warmup: %d tokens in %.2f s",
                               (80, 0.5), None)
    record.created = 112.5
    other = logging.LogRecord("x", logging.INFO, __file__, 1, "something else %d", (1,), None)
    log.emit(record)
    log.emit(other)
    assert log.lines == [{"phase": "warmed_up", "at_s": 12.5, "line": "warmup: 80 tokens in 0.50 s"}]
    beside = logging.LogRecord("deployments.frontend", logging.INFO, __file__, 1, "frontend ready (%s) in %.1f s",
                               ("cosyvoice2", 3.0), None)
    beside.created = 103.0
    log.emit(beside)  # the frontend is built before the replica: not a phase of its start
    assert len(log.lines) == 1 and log.beside == [{"phase": "frontend_ready", "at_s": 3.0,
                                                   "line": "frontend ready (cosyvoice2) in 3.0 s"}]


def test_work_left_out_moves_the_origin_of_every_later_line():
    log = cold_start.StartLog(process_start=100.0)
    log.leave_out(8.0)  # the frontend's build: not the replica's
    record = logging.LogRecord("deployments.warmup", logging.INFO, __file__, 1, "warmup: %d tokens in %.2f s",
                               (80, 0.5), None)
    record.created = 120.5
    log.emit(record)
    assert log.lines[0]["at_s"] == 12.5 and log.left_out_s == 8.0


def test_phases_run_from_one_line_to_the_next_and_end_at_the_first_audio():
    lines = [{"phase": "imports", "at_s": 4.0}, {"phase": "model_loaded", "at_s": 10.0},
             {"phase": "t2w_graphs_captured", "at_s": 80.5}]
    assert cold_start.phases(lines, 81.0) == {"imports": 4.0, "model_loaded": 6.0, "t2w_graphs_captured": 70.5,
                                              "first_request": 0.5}


@pytest.fixture
def steps_config(tmp_path):
    """configs/local.yaml on a tiny model, with the stepped token2wav (the in-process level needs it)."""
    raw = yaml.safe_load(Path("configs/local.yaml").read_text())
    args = raw["applications"][0]["args"]
    args["model_dir"] = str(write_tiny_model(tmp_path / "tiny-cosyvoice2", "cosyvoice2"))
    args["synthesizer"]["token2wav"]["scheduler"] = "steps"
    path = tmp_path / "steps.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_tiny_replica_is_measured_to_its_first_audio(steps_config, tmp_path):
    result = cold_start.main(["--config", str(steps_config), "--out", str(tmp_path / "out"), "--tag", "t"])
    written = json.loads(next((tmp_path / "out").glob("cold-start-*-t.json")).read_text())
    assert written["cold_start_s"] == result["cold_start_s"]
    phases = written["phases_s"]
    assert list(phases)[-1] == "first_request"
    assert {"imports", "bench_imports", "model_loaded", "warmed_up", "synthesizer_ready"} <= set(phases)
    assert "graphs_before_ready" not in phases  # no CUDA graphs on the CPU
    assert [line["phase"] for line in written["beside"]] == ["frontend_ready"]
    # the frontend was built before the replica's start and left out of its timeline
    assert written["frontend_built_s"] > 0 and written["beside"][0]["at_s"] > phases["imports"]
    assert sum(phases.values()) == pytest.approx(written["cold_start_s"], abs=0.05)
    assert written["replica_cold_start_s"] == pytest.approx(written["cold_start_s"] - phases["bench_imports"], abs=0.01)
    assert 0 < written["first_request_ttfa_s"] <= phases["first_request"] + 0.01
    assert written["ready_s"] <= written["cold_start_s"] <= written["all_graphs_s"]  # no graphs: all there at once
    graphs = written["replica"]["cuda_graphs"]  # the CPU's schedule: nothing to capture, nothing left
    assert (graphs["total"], graphs["background"]) == (0, "done") and "runtime" in written["replica"]["phases_s"]


def test_a_replica_whose_graphs_are_still_captured_in_the_background_is_not_settled():
    from bench.soak import graphs_settled

    def entry(background):
        return {"runtime": {"cold_start": {"cuda_graphs": {"background": background}}}}

    assert not graphs_settled(entry("running")) and not graphs_settled(entry("pending"))
    assert graphs_settled(entry("done")) and graphs_settled(entry("failed"))  # failed: nothing more will come
    assert graphs_settled({"runtime": {"cold_start": {"cuda_graphs": None}}}) and graphs_settled({})
