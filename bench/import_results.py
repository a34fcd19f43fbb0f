"""Bring a device call's results (``bench/device_capacity.sh``'s ``capacity.tgz``) into ``bench/results``
under a tag, so that a lease's reports never overwrite an earlier lease's of the same day.

The device names reports by level, device and date only (``capacity-synth-nvidia-h100-...-2026-12-05``):
three leases on one day wrote the same names, and each import was a hand-made rename. Here every
capacity report is written again under ``<stem>-<tag>`` (markdown and plots regenerated from its
JSON), the one-stream profile's JSON and markdown likewise (its Chrome trace only with ``--trace``:
traces of several MB push a device call's tree past its 64 MiB), the GPU tests' log as
``gpu-tests-<device>-<date>-<tag>.txt``, and with ``--latest`` the device's ``latest.json`` /
``cosyvoice3-latest.json`` replace ours with their report names tagged too.

    python -m bench.import_results /work/.device/4/capacity.tgz --tag late --latest
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

from bench.capacity_report import write_report
from bench.report import _slug

LATEST = ("latest.json", "cosyvoice3-latest.json")


def _tagged(name: str, tag: str) -> str:
    """``<stem>-<tag>.<ext>``; a trace keeps its ``-trace`` last (``<stem>-<tag>-trace.json.gz``)."""
    stem, dot, ext = name.partition(".")
    trace = stem.endswith("-trace")
    return f"{stem.removesuffix('-trace')}-{tag}{'-trace' if trace else ''}{dot}{ext}"


def import_bundle(bundle: Path, tag: str, out: Path, latest: bool = False, trace: bool = False) -> list[Path]:
    """Write the bundle's results into ``out`` under ``tag``; returns the files written."""
    if not tag or _slug(tag) != tag:
        raise ValueError(f"tag {tag!r}: use lower-case letters, digits and dashes")
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with tarfile.open(bundle) as tar:
            tar.extractall(root, filter="data")
        results = root / "results"
        renamed: dict[str, str] = {}
        for src in sorted(results.glob("capacity-*.json")):
            stem = _tagged(src.stem, tag)
            doc = json.loads(src.read_text())
            (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
            written += [out / f"{stem}.json", write_report(out, stem, doc)]
            renamed[f"{src.stem}.md"] = f"{stem}.md"
        for src in sorted(results.glob("profile-first-audio-*")):
            if src.name.endswith(".json.gz") and not trace:
                continue
            written.append(out / _tagged(src.name, tag))
            shutil.copyfile(src, written[-1])
        tests = root / "gpu_tests.txt"
        if tests.exists():  # named by the card (nvidia-smi's first row) and the day the log was written
            gpu = root / "gpu.txt"
            device = gpu.read_text().splitlines()[1].split(",")[0] if gpu.exists() else "gpu"
            day = dt.datetime.fromtimestamp(tests.stat().st_mtime, dt.UTC).date().isoformat()
            written.append(out / f"gpu-tests-{_slug(device)}-{day}-{tag}.txt")
            shutil.copyfile(tests, written[-1])
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


def main(argv: list[str] | None = None) -> list[Path]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", type=Path, help="a device call's capacity.tgz")
    ap.add_argument("--tag", required=True, help="appended to every report's name (e.g. late, h200-night)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--latest", action="store_true", help="also take the bundle's latest.json files")
    ap.add_argument("--trace", action="store_true", help="also take the profile's Chrome trace (several MB)")
    args = ap.parse_args(argv)
    written = import_bundle(args.bundle, args.tag, args.out, args.latest, args.trace)
    for path in written:
        print(path)
    return written


if __name__ == "__main__":
    main()
