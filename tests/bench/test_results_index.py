"""bench/results_index.py: run folders named by day, card and what; the index lists every run
under its topic and says where the docs cite it; --check fails on a stale index or a loose file."""
from __future__ import annotations

import json

import pytest

from bench import results_index
from bench.results_index import run_folder_name, short_device, topic_of, write_run_record


@pytest.mark.parametrize(("device", "short"), [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                               ("cpu", "cpu"), ("", "cpu"), ("NVIDIA GeForce RTX 5090", "rtx-5090")])
def test_a_card_is_named_short(device, short):
    assert short_device(device) == short


def test_a_run_folder_sorts_by_day_and_names_its_topic():
    assert run_folder_name("2026-12-06", "NVIDIA H100 80GB HBM3", "late") == "2026-12-06-h100-late"
    assert topic_of("2026-12-06-h100-capacity-synth-rate") == "capacity"
    assert topic_of("2026-12-06-h100-kernel-profile-b1") == "profiles"
    assert topic_of("2026-12-03-soak-open") == "reliability"
    assert topic_of("2026-12-06-fleet-sim") == "fleet"


def test_the_index_lists_each_run_and_check_fails_when_stale_or_loose(tmp_path):
    results = tmp_path / "bench" / "results"
    (tmp_path / "docs").mkdir()
    for name in ("2026-12-06-h100-capacity-synth-rate", "2026-12-05-h100-gpu-tests-late"):
        (results / name).mkdir(parents=True)
        (results / name / "report.md").write_text("# r\n")
        write_run_record(results / name, {"date": name[:10], "device": "H100", "what": name[16:], "main": "report.md"})
    (tmp_path / "docs" / "tuning.md").write_text("[r](../bench/results/2026-12-06-h100-capacity-synth-rate/report.md)")
    assert json.loads((results / "2026-12-05-h100-gpu-tests-late" / "run.json").read_text())["files"] == ["report.md"]
    assert results_index.main(["--results", str(results), "--check"]) == 1  # no index yet
    assert results_index.main(["--results", str(results)]) == 0
    index = (results / "INDEX.md").read_text()
    assert "| 2026-12-06 | H100 | capacity-synth-rate | [2026-12-06-h100-capacity-synth-rate]" \
           "(2026-12-06-h100-capacity-synth-rate/report.md) | docs/tuning.md |" in index
    assert index.index("## GPU tests") > index.index("## Capacity")
    assert results_index.main(["--results", str(results), "--check"]) == 0
    (results / "capacity-loose.md").write_text("x")
    assert results_index.main(["--results", str(results), "--check"]) == 1
