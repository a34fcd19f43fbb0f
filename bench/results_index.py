"""The record of ``bench/results``: one folder per run, each with a ``run.json`` saying what was run,
and ``INDEX.md``, one line per run grouped by topic, written from those records.

A run folder is named ``<date>-<card>-<what>`` (``2026-12-06-h100-capacity-synth-rate``) and holds
every file of one run: the report (``.md``), its data (``.json``), plots and logs. Its ``run.json``
names the date, the device, the commit, the command and the configuration, each ``"unknown"`` where
the run did not record it. Only ``latest.json``, ``cosyvoice3-latest.json``, ``fleet-sim-latest.json``,
``autoscale-latest.json`` and ``INDEX.md`` lie at the top; the latest files name their reports by path from there
(``<run folder>/<report>.md``).

    python -m bench.results_index           # rewrite bench/results/INDEX.md from the run records
    python -m bench.results_index --check   # exit 1 when INDEX.md is not what the records give
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUN_RECORD = "run.json"
TOP_LEVEL = ("latest.json", "cosyvoice3-latest.json", "fleet-sim-latest.json", "autoscale-latest.json", "INDEX.md")
UNKNOWN = "unknown"

# (topic, heading, what the run folder's name has after its date and card); first match wins
TOPICS = (
    ("capacity", "Capacity at the SLO (`bench/capacity.py`, day summaries)", ("capacity", "trace-capacity")),
    ("throughput", "Throughput benchmark (`bench/gpu_bench.py`, `bench/serve_load.py`) and stage timings",
     ("throughput", "serve", "variants", "colocation", "llm-decode")),
    ("profiles", "Kernel and first-audio profiles, flow checks",
     ("kernel-profile", "profile-first-audio", "stepper-check", "incremental-flow", "cv3-vocoder")),
    ("gpu-tests", "GPU tests (`bench/device_gpu_tests.sh`)", ("gpu-tests",)),
    ("fleet", "Fleet simulation (`bench/fleet_sim.py`)", ("fleet-sim",)),
    ("autoscale", "Live autoscaling ramps, timed replicas (`bench/autoscale_live.py`)", ("autoscale",)),
    ("reliability", "Soak, load and fuzz runs, serving layer", ("soak", "fuzz", "loaded", "ramp", "serving-layer")),
    ("tools", "Other tools", ("normalize",)),
)
_CARDS = re.compile(r"(h100|h200|h20|a100|a10g|l40s|l4|b200|rtx-?\d{4})")


def short_device(device: str) -> str:
    """The card as run folders name it: ``NVIDIA H100 80GB HBM3`` -> ``h100``; ``cpu`` for none."""
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    if not slug or slug == "cpu":
        return "cpu"
    found = _CARDS.search(slug)
    return found.group(1) if found else slug.removeprefix("nvidia-")


def run_folder_name(date: str, device: str, what: str) -> str:
    """``<date>-<card>-<what>``: sorts by date, and two runs of one day differ by card or ``what``."""
    return f"{date}-{short_device(device)}-{what}"


def topic_of(folder: str) -> str:
    """The index section of a run folder, from what its name says after the date and card."""
    what = re.sub(r"^\d{4}-\d{2}-\d{2}-", "", folder)
    what = re.sub(r"^(h100|h200|cpu|vm)-", "", what)
    if folder.startswith("fleet-sim"):
        return "fleet"
    for topic, _, prefixes in TOPICS:
        if what.startswith(prefixes):
            return topic
    return "tools"


def write_run_record(folder: Path, record: dict) -> Path:
    """Write ``run.json`` into a run folder; the files listed are the folder's own."""
    record = {"run": folder.name, **record,
              "files": sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != RUN_RECORD)}
    path = folder / RUN_RECORD
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def read_runs(results: Path = RESULTS) -> list[dict]:
    """Every run folder's record (a folder without ``run.json`` is an error: the record is the point)."""
    runs = []
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        path = folder / RUN_RECORD
        if not path.exists():
            raise FileNotFoundError(f"{folder.name}: no {RUN_RECORD}")
        runs.append(json.loads(path.read_text()) | {"run": folder.name})
    return runs


def _cited(runs: list[dict], root: Path) -> dict[str, list[str]]:
    """Which of README.md and docs/*.md name each run folder."""
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    texts = {str(p.relative_to(root)): p.read_text() for p in docs if p.exists()}
    return {r["run"]: [name for name, text in texts.items() if f"{r['run']}/" in text] for r in runs}


def render(results: Path = RESULTS, root: Path = ROOT) -> str:
    runs = read_runs(results)
    cited = _cited(runs, root)
    lines = [
        "# Benchmark results: the index",
        "",
        "Written by `python -m bench.results_index` from each run folder's `run.json` (do not edit by",
        "hand; `--check` says whether it is current). One folder per run, named `<date>-<card>-<what>`,",
        "holding the report (`.md`), its data (`.json`), plots and logs; `run.json` names the commit that",
        "added the files, the device, the command and the configuration (`unknown` where the run did not",
        "record it). `bench/import_results.py` writes a device call's results into a new run folder;",
        "`bench/capacity.py` and `bench/gpu_bench.py` still write their reports next to `latest.json`",
        "(`--out bench/results`): move those into a run folder with a `run.json` (`tests/test_doc_links.py`",
        "fails on loose files).",
        "",
        "At the top level only: `latest.json` (CosyVoice2) and `cosyvoice3-latest.json`, the figures the",
        "README quotes, naming their reports as `<run folder>/<report>.md`; `fleet-sim-latest.json`, the",
        "last fleet simulation's summary (`bench/fleet_sim.py --latest`; its full output is in its own",
        "folder); `autoscale-latest.json`, the last live autoscaling ramp's summary and series",
        "(`bench/autoscale_live.py --latest`); and this index.",
        "",
        "Readings no document, test or other reading named were removed from the tree. Their history",
        "stays: `git log --all --format='%h %ad' -- 'bench/results/<name>'` finds the commit that removed",
        "one, and `git show <commit>^:bench/results/<name>` prints it.",
        "",
        "`cited in`: the README and docs pages that link the run.",
    ]
    for topic, heading, _ in TOPICS:
        mine = [r for r in runs if r.get("topic", topic_of(r["run"])) == topic]
        if not mine:
            continue
        lines += ["", f"## {heading}", "", "| date | device | what | reading | cited in |", "|---|---|---|---|---|"]
        for r in sorted(mine, key=lambda r: (r.get("date", ""), r["run"])):
            main = r.get("main") or (r.get("files") or [""])[0]
            link = f"[{r['run']}]({r['run']}/{main})" if main else f"[{r['run']}]({r['run']}/)"
            what = str(r.get("what", UNKNOWN)).replace("|", "/")
            where = ", ".join(cited.get(r["run"], [])) or "-"
            lines.append(f"| {r.get('date', UNKNOWN)} | {r.get('device', UNKNOWN)} | {what} | {link} | {where} |")
    return "\n".join(lines) + "\n"


def loose_files(results: Path = RESULTS) -> list[str]:
    """Files at the top of the results folder that belong in a run folder."""
    return sorted(p.name for p in results.iterdir() if p.is_file() and p.name not in TOP_LEVEL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--check", action="store_true", help="compare INDEX.md with the records; exit 1 if it differs")
    args = ap.parse_args(argv)
    text = render(args.results, args.results.resolve().parent.parent)
    index = args.results / "INDEX.md"
    loose = loose_files(args.results)
    if args.check:
        stale = not index.exists() or index.read_text() != text
        for problem in (["INDEX.md is stale: run python -m bench.results_index"] if stale else []) + \
                [f"loose file (move it into its run folder): {name}" for name in loose]:
            print(problem, file=sys.stderr)
        return 1 if stale or loose else 0
    index.write_text(text)
    print(index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
