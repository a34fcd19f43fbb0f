"""bench/llm_decode_bench.py on the CPU (tiny architecture): the graphed engine's tokens equal the
eager one's, and with ``--compile`` every timed shape has its compiled row beside the eager and
graphed ones, in the JSON and in the markdown table (the GPU run is what times them)."""
from __future__ import annotations

import json

from bench.llm_decode_bench import main


def test_compile_variant_is_timed_beside_eager_and_graphs(tmp_path):
    out = tmp_path / "decode.json"
    # the "eager" backend: dynamo traces the step without inductor's code generation (seconds)
    result = main(["--device", "cpu", "--tiny", "--dtypes", "fp32", "--batches", "1,2", "--compile", "eager",
                   "--steps", "2", "--warmup", "1", "--prompt-len", "12", "--long-prompt-len", "16", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["errors"] == []
    assert [c["exact"] for c in result["checks"]] == [True]
    shapes = [(1, 12), (2, 12), (2, 16)]  # the long context only at the largest batch
    variants = {(r["batch"], r["prompt_len"], r["graphs"], r["compile"]) for r in result["timings"]}
    assert variants == {(b, c, g, k) for b, c in shapes for g, k in ((False, None), (True, None), (True, "eager"))}
    assert all(r["wall_ms"] > 0 for r in result["timings"])
    table = [line for line in (tmp_path / "decode.md").read_text().splitlines() if line.startswith("| fp32 |")]
    assert len(table) == len(shapes)
    for line in table:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 10 and float(cells[8]) > 0  # the compiled graphs' ms/step


def test_without_compile_the_compiled_columns_are_empty(tmp_path):
    result = main(["--device", "cpu", "--tiny", "--dtypes", "fp32", "--batches", "1", "--steps", "2", "--warmup", "1",
                   "--prompt-len", "12", "--long-prompt-len", "16", "--out", str(tmp_path / "d.json")])
    assert {r["compile"] for r in result["timings"]} == {None}
    table = [line for line in (tmp_path / "d.md").read_text().splitlines() if line.startswith("| fp32 |")]
    assert table and all(line.rstrip().endswith("| - | - |") for line in table)
