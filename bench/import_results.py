"""Bring a device call's results (``bench/device_capacity.sh``'s ``capacity.tgz``) into ``bench/results``
as one run folder, ``<date>-<card>-<tag>`` (``bench/results_index.py``), so that a lease's reports
never overwrite an earlier lease's of the same day.

The device names reports by level, device and date only (``capacity-synth-nvidia-h100-...-2026-12-05``):
three leases on one day wrote the same names, and each import was a hand-made rename. Here every
capacity report is written again under ``<stem>-<tag>`` (markdown and plots regenerated from its
JSON), the one-stream profile's JSON and markdown likewise (its Chrome trace only with ``--trace``:
traces of several MB push a device call's tree past its 64 MiB), the GPU tests' log as
``gpu-tests-<device>-<date>-<tag>.txt``, all in the run folder with its ``run.json`` (what is known of
the run), and with ``--latest`` the device's ``latest.json`` / ``cosyvoice3-latest.json`` replace ours
(at the top of ``bench/results``) with their new reports named by path (``<run folder>/<report>.md``).
A live ramp's run folder (``AUTOSCALE_S``) comes in as the device named it, with this checkout's
commit, and with ``--latest`` its ``autoscale-latest.json`` and ``fleet-sim-latest.json``.
The index (``INDEX.md``) is written again.

    python -m bench.import_results /work/.device/4/capacity.tgz --tag late --latest
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from bench.capacity_report import write_report
from bench.report import slug
from bench.results_index import ROOT, run_folder_name, write_run_record
from bench.results_index import main as write_index

LATEST = ("latest.json", "cosyvoice3-latest.json")
RAMP_LATEST = ("autoscale-latest.json", "fleet-sim-latest.json")  # a live ramp's (bench/autoscale_live.py)


def _tagged(name: str, tag: str) -> str:
    """``<stem>-<tag>.<ext>``; a trace keeps its ``-trace`` last (``<stem>-<tag>-trace.json.gz``)."""
    stem, dot, ext = name.partition(".")
    trace = stem.endswith("-trace")
    return f"{stem.removesuffix('-trace')}-{tag}{'-trace' if trace else ''}{dot}{ext}"


def _commit() -> str:
    """This checkout's commit (the tree a device call runs is the working tree of the session that
    made it: this commit plus what was not committed yet)."""
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _call(root: Path) -> str:
    """The device call's command line as bench/device_capacity.sh wrote it (call.txt: its settings)."""
    call = root / "call.txt"
    if not call.exists():
        return "bench/device_capacity.sh (settings not recorded: a bundle from before call.txt)"
    return f"{call.read_text().strip()} (device call)"


def _run_of(root: Path, reports: list[dict]) -> tuple[str, str]:
    """The run's day and device: the capacity reports' own, else nvidia-smi's card and the day the
    GPU tests' log was written, else today (UTC) and ``unknown``."""
    gpu = root / "gpu.txt"
    card = gpu.read_text().splitlines()[1].split(",")[0] if gpu.exists() else None
    tests = root / "gpu_tests.txt"
    day = dt.datetime.fromtimestamp(tests.stat().st_mtime, dt.UTC).date().isoformat() if tests.exists() else None
    if reports:
        return reports[0]["date"], reports[0]["device"]
    return day or dt.datetime.now(dt.UTC).date().isoformat(), card or "unknown"


def import_bundle(bundle: Path, tag: str, out: Path, latest: bool = False, trace: bool = False) -> list[Path]:
    """Write the bundle's results into a new run folder of ``out`` named by its day, card and
    ``tag``; returns the files written."""
    if not tag or slug(tag) != tag:
        raise ValueError(f"tag {tag!r}: use lower-case letters, digits and dashes")
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with tarfile.open(bundle) as tar:
            tar.extractall(root, filter="data")
        results = root / "results"
        sources = sorted(results.glob("capacity-*.json"))
        docs = [json.loads(src.read_text()) for src in sources]
        day, device = _run_of(root, docs)
        run = out / run_folder_name(day, device, tag)
        ramps = sorted(p for p in results.glob("*-autoscale*") if p.is_dir())
        for taken in [run, *(out / r.name for r in ramps)]:
            if taken.exists():
                raise ValueError(f"{taken.name} exists already: import under another tag (a ramp's folder: "
                                 "rename it in the bundle)")
        run.mkdir()
        renamed: dict[str, str] = {}
        for src, doc in zip(sources, docs, strict=True):
            stem = _tagged(src.stem, tag)
            (run / f"{stem}.json").write_text(json.dumps(doc, indent=1))
            written += [run / f"{stem}.json", write_report(run, stem, doc)]
            renamed[f"{src.stem}.md"] = f"{run.name}/{stem}.md"
        for src in sorted([*results.glob("profile-first-audio-*"), *results.glob("cold-start-*.json")]):
            if src.name.endswith(".json.gz") and not trace:
                continue
            written.append(run / _tagged(src.name, tag))
            shutil.copyfile(src, written[-1])
        tests = root / "gpu_tests.txt"
        if tests.exists():  # named by the card (nvidia-smi's first row) and the day the log was written
            gpu = root / "gpu.txt"
            card = gpu.read_text().splitlines()[1].split(",")[0] if gpu.exists() else "gpu"
            log_day = dt.datetime.fromtimestamp(tests.stat().st_mtime, dt.UTC).date().isoformat()
            written.append(run / f"gpu-tests-{slug(card)}-{log_day}-{tag}.txt")
            shutil.copyfile(tests, written[-1])
        reports = sorted(p.name for p in written if p.suffix == ".md")
        written.append(write_run_record(run, {
            "date": day, "device": device,
            "what": f"device call `{tag}`: " + (", ".join(sorted({f"{d['workload']['level']} level {d['workload']['family']}"
                                                                for d in docs})) or "no capacity report"),
            "main": reports[0] if reports else (written[0].name if written else ""),
            "commit": _commit(), "command": f"{_call(root)}, then python -m bench.import_results {bundle.name} --tag {tag}",
            "config": "; ".join(sorted({str(d["workload"].get("model", "unknown")) for d in docs})) or "unknown",
            "note": "commit: the checkout that imported the call; the device ran its working tree"}))
        written += _import_ramps(ramps, results, out, latest)
        if latest:
            for name in LATEST:
                if (results / name).exists():
                    doc = json.loads((results / name).read_text())
                    for key, value in doc.items():
                        if key.startswith("capacity_report_") and value in renamed:
                            doc[key] = renamed[value]
                    (out / name).write_text(json.dumps(doc, indent=1))
                    written.append(out / name)
    return written


def _import_ramps(ramps: list[Path], results: Path, out: Path, latest: bool) -> list[Path]:
    """A live ramp's run folder (``<day>-<card>-autoscale-<tag>``, named on the device) as it is,
    its commit this checkout's (the device's git metadata is not the working tree it ran: live3's
    said 55b2604 where the tree was 881bc00); with ``latest``, its ``autoscale-latest.json`` and the
    ``fleet-sim-latest.json`` holding its sim-vs-live figure."""
    written: list[Path] = []
    commit = f"{_commit()} (the checkout that imported the call; the device ran its working tree)"
    for folder in ramps:
        dest = out / folder.name
        shutil.copytree(folder, dest)
        for name in ("run.json", "autoscale.json"):
            doc = json.loads((dest / name).read_text())
            (doc["run"] if name == "autoscale.json" else doc)["commit"] = commit
            (dest / name).write_text(json.dumps(doc, indent=1) + "\n")
        written += sorted(dest.iterdir())
    if latest and written:
        for name in RAMP_LATEST:
            if (results / name).exists():
                shutil.copyfile(results / name, out / name)
                written.append(out / name)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path, help="a device call's capacity.tgz")
    ap.add_argument("--tag", required=True, help="names the run folder and is appended to every report's name "
                                                "(e.g. late, night)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--latest", action="store_true", help="also take the bundle's latest.json files (a live "
                    "ramp's autoscale-latest.json and fleet-sim-latest.json too)")
    ap.add_argument("--trace", action="store_true", help="also take the profile's Chrome trace (several MB)")
    args = ap.parse_args(argv)
    written = import_bundle(args.bundle, args.tag, args.out, args.latest, args.trace)
    for path in written:
        print(path)
    write_index(["--results", str(args.out)])
    return written


if __name__ == "__main__":
    main()
