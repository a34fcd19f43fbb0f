"""Report of ``bench/gpu_bench.py``: a markdown table, two plots and ``latest.json``
(``<family>-latest.json`` for CosyVoice3); the plots and :func:`slug` serve the other tools too."""
from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path


def slug(name: str) -> str:
    """``name`` as a file-name part: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["throughput_x_realtime"])


def _at(rows: list[dict], arm: str, c: int) -> dict | None:
    return next((r for r in rows if r["arm"] == arm and r["concurrency"] == c), None)


def plots(out: Path, stem: str, rows: list[dict], baseline: dict | None, key: str = "arm") -> list[str]:
    """Latency and throughput against concurrency, one line per ``row[key]`` (the arm, or the
    serve load's label); PNG names written to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r[key] for r in rows})
    names = []
    for figure, ylabel, fname, logy in (
        ("ttfa", "time to first audio (ms)", "latency", True),
        ("throughput_x_realtime", "aggregate throughput (x real time)", "throughput", False),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mode in modes:
            rs = sorted((r for r in rows if r[key] == mode), key=lambda r: r["concurrency"])
            cs = [r["concurrency"] for r in rs]
            if figure == "ttfa":
                ax.plot(cs, [r["ttfa_p50_ms"] for r in rs], marker="o", label=f"{mode} p50")
                ax.plot(cs, [r["ttfa_p99_ms"] for r in rs], marker="x", linestyle="--", label=f"{mode} p99")
            else:
                ax.plot(cs, [r[figure] for r in rs], marker="o", label=mode)
        if figure == "throughput_x_realtime" and baseline is not None:
            ax.axhline(baseline["throughput_x_realtime"], color="gray", linestyle=":", label="sequential baseline")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"{stem}-{fname}.png"
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
        names.append(name)
    return names


def latest_path(out: Path, family: str) -> Path:
    """``latest.json`` for CosyVoice2, ``<family>-latest.json`` for another family: one family's
    run never replaces the other's figures (the benchmarks and the capacity tool share the files)."""
    return out / ("latest.json" if family == "cosyvoice2" else f"{family}-latest.json")


def latest_for(out: Path, family: str) -> tuple[Path, str]:
    """The family's latest file a run written to ``out`` updates, and the prefix of the run's
    report names in it: ``out``'s own file (a device call's staging folder, imported later by
    ``bench/import_results.py``), else, for a run folder inside ``bench/results``
    (bench/results/INDEX.md), the file beside that folder with names ``<folder>/<file>``."""
    here = latest_path(out, family)
    above = latest_path(out.parent, family)
    if not here.exists() and above.exists():
        return above, f"{out.name}/"
    return here, ""


def write_report(out: Path, device: str, family: str, n_tokens: int, baseline: dict | None, rows: list[dict],
                 arms: dict[str, dict], model: str, config: str, date: str | None = None, notes: str = "",
                 tag: str = "") -> Path:
    """The report of a run so far; ``arms``: each arm's ``overrides`` (as given) and, once it
    has started, the ``plan`` its replica resolved (``deployments/execution_plan.py``)."""
    out.mkdir(parents=True, exist_ok=True)
    date = date or dt.date.today().isoformat()
    stem = f"{slug(device)}-{date}" + (f"-{slug(tag)}" if tag else "")
    pngs = plots(out, stem, rows, baseline)
    best = _best(rows)
    c1 = _at(rows, best["arm"], 1) or {}
    c16 = _at(rows, best["arm"], 16) or {}
    base_x = baseline["throughput_x_realtime"] if baseline else None
    lines = [
        f"# Streaming benchmark: {family}, {device}, {date}, fixed-length workload",
        "",
        (f"Model: {model}; {n_tokens} speech tokens per request ({n_tokens / 25:.1f} s of audio), zero-shot prompt "
         "shapes (87 prompt speech tokens, 14 prompt text tokens), streaming. Each arm is one synthesizer replica "
         f"built by the product from `{config}`'s synthesizer with the arm's overrides (its plan below), in this "
         "process. Closed loop: `concurrency` streams in flight, at least 2x that many requests per row. Baseline: "
         "one request at a time, eager fp32, single-request reference pipeline."),
        "",
        (f"Sequential baseline: {base_x:.2f}x real time, first audio p50 {baseline['ttfa_p50_ms']:.0f} ms."
         if baseline else "No sequential baseline in this run."),
        "",
        "| arm | overrides | plan |",
        "|---|---|---|",
        *[f"| {name} | {a['overrides']} | {_plan_cell(a.get('plan'))} |" for name, a in arms.items()],
        "",
        "| arm | conc. | TTFA p50 ms | TTFA p95 ms | TTFA p99 ms | RTF p50 | x real time | vs baseline | underruns | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['throughput_x_realtime'] / base_x:.1f}x" if base_x else "-"
        mem = "" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.1f}"
        lines.append(
            f"| {r['arm']} | {r['concurrency']} | {r['ttfa_p50_ms']:.0f} | {r['ttfa_p95_ms']:.0f} | {r['ttfa_p99_ms']:.0f} "
            f"| {r['rtf_p50']:.3f} | {r['throughput_x_realtime']:.1f} | {ratio} | {r['underruns']} | {mem} |"
        )
    lines += ["", *[f"![{p}]({p})" for p in pngs], ""]
    if notes:
        lines += [notes, ""]
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines))
    latest = {
        "device": device, "date": date, "family": family, "arm": best["arm"], "arms": arms,
        "throughput_x_realtime": best["throughput_x_realtime"], "best_concurrency": best["concurrency"],
        "baseline_x_realtime": base_x,
        "speedup_vs_baseline": best["throughput_x_realtime"] / base_x if base_x else None,
        "ttfb_p50_ms_c1": c1.get("ttfa_p50_ms"), "ttfb_p99_ms_c16": c16.get("ttfa_p99_ms"),
        "underruns_c16": c16.get("underruns"), "report": None, "rows": rows, "baseline": baseline,
    }
    path, prefix = latest_for(out, family)
    latest["report"] = prefix + md.name
    kept = json.loads(path.read_text()) if path.exists() else {}  # other tools' keys (capacity) stay
    kept.pop("mode", None)  # the name of the best arm before arms were config overrides
    path.write_text(json.dumps({**kept, **latest}, indent=1))
    return md


def _plan_cell(plan: dict | None) -> str:
    """The plan's choices that differ between arms, in one table cell."""
    if not plan:
        return "not built"
    llm, t2w = plan["llm"], plan["token2wav"]
    flow = {k: t2w[k]["streamed"] for k in ("cv2", "cv3")}
    return (f"{plan['mode']}, {plan['dtype']}, {plan['device']}; LLM graphs {llm['cuda_graphs']}, compiled "
            f"{llm['compile_backend'] or 'no'}, fused norms {llm['fused_norms']}, run-ahead {llm['run_ahead']}; "
            f"token2wav {t2w['scheduler']}, graphs {t2w['cuda_graphs']}, first chunk {t2w['first_chunk_min_tokens']}, "
            f"flow cv2 {flow['cv2']} / cv3 {flow['cv3']}, cv3 vocoder {t2w['cv3_vocoder']}, "
            f"passes in flight {t2w['passes_in_flight']}")
