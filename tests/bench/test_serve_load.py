"""bench.serve_load end to end on the CPU: the real app from configs/local.yaml on local Ray
(tiny model), one closed-loop level over HTTP, report files written, nothing lost."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # ~20-35 s of a local Ray cluster; bench/capacity.py's serve level has its own default-run test
@pytest.mark.ray
def test_serve_load_runs_the_app_and_writes_its_report(tmp_path):
    out = tmp_path / "serve-local"
    res = subprocess.run([sys.executable, "-m", "bench.serve_load", "--config", "configs/local.yaml",
                          "--concurrency", "2", "--min-requests", "2", "--warmup", "1", "--text", "Hi.",
                          "--num-cpus", "4", "--no-progress", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
                         env={**__import__("os").environ, "RAY_AUTH_MODE": "disabled"})
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    (row,) = result["rows"]
    assert row["concurrency"] == 2 and row["requests"] == 4 and row["ok"] == 4 and row["lost"] == 0
    assert row["ttfa_p50_ms"] > 0 and row["throughput_x_realtime"] > 0
    assert result["replica"]["runtime"]["family"] == "cosyvoice2" and result["replica"]["mode"] == "pytorch"
    assert row["mode"] == "serve-pytorch-float32"
    md = out.with_suffix(".md").read_text()
    assert "| 2 | 4 | 4 | 0 |" in md
    assert all((tmp_path / p).stat().st_size > 0 for p in result["plots"])
