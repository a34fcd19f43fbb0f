"""Benchmark report: a markdown table, two plots and ``latest.json`` (``<family>-latest.json`` for CosyVoice3)."""
from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _best(rows: list[dict]) -> dict:
    return max(rows, key=lambda r: r["throughput_x_realtime"])


def _at(rows: list[dict], mode: str, c: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["concurrency"] == c), None)


def plots(out: Path, stem: str, rows: list[dict], baseline: dict | None) -> list[str]:
    """Latency and throughput against concurrency, one line per mode; PNG names written to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows})
    names = []
    for key, ylabel, fname, logy in (
        ("ttfa", "time to first audio (ms)", "latency", True),
        ("throughput_x_realtime", "aggregate throughput (x real time)", "throughput", False),
    ):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for mode in modes:
            rs = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["concurrency"])
            cs = [r["concurrency"] for r in rs]
            if key == "ttfa":
                ax.plot(cs, [r["ttfa_p50_ms"] for r in rs], marker="o", label=f"{mode} p50")
                ax.plot(cs, [r["ttfa_p99_ms"] for r in rs], marker="x", linestyle="--", label=f"{mode} p99")
            else:
                ax.plot(cs, [r[key] for r in rs], marker="o", label=mode)
        if key == "throughput_x_realtime" and baseline is not None:
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


def write_report(out: Path, device: str, family: str, n_tokens: int, baseline: dict, rows: list[dict],
                 date: str | None = None, notes: str = "", tag: str = "") -> Path:
    out.mkdir(parents=True, exist_ok=True)
    date = date or dt.date.today().isoformat()
    stem = f"{_slug(device)}-{date}" + (f"-{_slug(tag)}" if tag else "")
    pngs = plots(out, stem, rows, baseline)
    best = _best(rows)
    c1 = _at(rows, best["mode"], 1) or {}
    c16 = _at(rows, best["mode"], 16) or {}
    lines = [
        f"# Streaming benchmark: {family}, {device}, {date}, fixed-length workload",
        "",
        (f"Full-size {family} architecture, random weights, {n_tokens} speech tokens per request "
         f"({n_tokens / 25:.1f} s of audio), zero-shot prompt shapes (87 prompt speech tokens, 14 prompt text "
         "tokens, 40 text tokens), streaming. Closed loop: `concurrency` streams in flight, at least 2x that many "
         "requests per row. Baseline: one request at a time, eager fp32, single-request reference pipeline."),
        "",
        (f"Sequential baseline: {baseline['throughput_x_realtime']:.2f}x real time, first audio p50 "
         f"{baseline['ttfa_p50_ms']:.0f} ms."),
        "",
        "| mode | conc. | TTFA p50 ms | TTFA p95 ms | TTFA p99 ms | RTF p50 | x real time | vs baseline | underruns | peak GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["throughput_x_realtime"] / baseline["throughput_x_realtime"]
        mem = "" if r.get("peak_mem_gib") is None else f"{r['peak_mem_gib']:.1f}"
        p95 = "-" if r.get("ttfa_p95_ms") is None else f"{r['ttfa_p95_ms']:.0f}"  # rows measured before it had one
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['ttfa_p50_ms']:.0f} | {p95} | {r['ttfa_p99_ms']:.0f} | {r['rtf_p50']:.3f} "
            f"| {r['throughput_x_realtime']:.1f} | {ratio:.1f}x | {r['underruns']} | {mem} |"
        )
    lines += ["", *[f"![{p}]({p})" for p in pngs], ""]
    if notes:
        lines += [notes, ""]
    md = out / f"{stem}.md"
    md.write_text("\n".join(lines))
    latest = {
        "device": device, "date": date, "family": family, "mode": best["mode"],
        "throughput_x_realtime": best["throughput_x_realtime"], "best_concurrency": best["concurrency"],
        "baseline_x_realtime": baseline["throughput_x_realtime"],
        "speedup_vs_baseline": best["throughput_x_realtime"] / baseline["throughput_x_realtime"],
        "ttfb_p50_ms_c1": c1.get("ttfa_p50_ms"), "ttfb_p99_ms_c16": c16.get("ttfa_p99_ms"),
        "underruns_c16": c16.get("underruns"), "report": None, "rows": rows, "baseline": baseline,
    }
    path, prefix = latest_for(out, family)
    latest["report"] = prefix + md.name
    kept = json.loads(path.read_text()) if path.exists() else {}  # other tools' keys (capacity) stay
    path.write_text(json.dumps({**kept, **latest}, indent=1))
    return md
