"""``fastcosy calibrate``: measure a node's replica capacity and write the load band's setpoint.

Either measures (``bench/capacity.py`` at the Serve level over HTTP, the production workload, on
this node's GPU; flags after ``--`` go to that tool) or reads existing measurements (``--from``),
derives ``slo_streams`` (``bench/calibrate.py``: streams in flight at the highest load that met the
SLO), writes a record of where it comes from (measurement, commit, device, date) and sets the value
with a comment naming that record in each target config. ``--check`` writes nothing and exits 1 when
a target's value is not the derived one.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fastcosy_cli.common import EXIT_PROBLEM, CliError, out

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure replica capacity (or read a measurement) and write the "
                       "load band's slo_streams into the configs, with its provenance",
                       description="Measures this node's replica capacity with bench/capacity.py (serve level, "
                       "production workload; flags after -- go to that tool) or reads --from reports, derives "
                       "slo_streams and writes it with a provenance record (docs/cli.md).")
    p.add_argument("--from", dest="reports", nargs="+", type=Path, metavar="CAPACITY_JSON",
                   help="derive from these bench/capacity.py reports (one node, one workload) instead of measuring")
    p.add_argument("--config", default="configs/single-gpu.yaml",
                   help="measuring: the serve config the node runs (default configs/single-gpu.yaml)")
    p.add_argument("--loads", default="", help="measuring: probe these session counts (comma-separated) "
                   "instead of searching (a search is the default)")
    p.add_argument("--out", default="bench/results", help="measuring: where the capacity report goes")
    p.add_argument("--write", nargs="*", type=Path, default=None, metavar="CONFIG",
                   help="configs to set (default: the GPU configs and the KubeRay manifest); none: print only")
    p.add_argument("--record", type=Path, help="the provenance record to write (default "
                   "configs/calibration/<device>-<family>.json)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a target differs")
    p.set_defaults(func=run_calibrate, forward_rest=True)


def _measure(args: argparse.Namespace) -> tuple[list[Path], str]:
    """Runs the capacity tool on this node; returns its report's JSON and the commit it ran at."""
    try:
        from bench import capacity
    except ImportError as exc:  # torch or the bench extras missing on this node
        raise CliError(f"measuring needs the benchmark's dependencies ({exc}); or pass --from a report") from None
    from bench.calibrate import head_commit

    argv = ["--level", "serve", "--config", args.config, "--workload", "production", "--out", args.out,
            "--no-open-loop", "--tag", "calibrate"]
    if args.loads:
        argv += ["--loads", args.loads]
    rest = [a for a in (args.rest or []) if a != "--"]
    commit = head_commit()
    logger.info("measuring: python -m bench.capacity %s", " ".join(argv + rest))
    _, report = capacity.measure(argv + rest)
    return [report], commit


def run_calibrate(args: argparse.Namespace) -> int:
    from bench.calibrate import GPU_TARGETS, ROOT, configured, derive, record_path, write_configs, write_record

    reports, commit = (list(args.reports), None) if args.reports else _measure(args)
    missing = [str(p) for p in reports if not p.is_file()]
    if missing:
        raise CliError(f"no such report: {', '.join(missing)}")
    try:
        cal = derive(reports, commit=commit)
    except (ValueError, KeyError) as exc:
        raise CliError(f"cannot derive slo_streams: {exc}") from None
    out(f"slo_streams {cal.slo_streams:g}: {cal.slo_streams:g} streams in flight at {cal.sessions} sessions, the "
        f"highest load that met first audio p99 <= {cal.slo_ttfa_p99_ms:g} ms"
        + (f" ({cal.capacity_below_sessions} missed it)" if cal.capacity_below_sessions else "")
        + f"; {cal.device}, {cal.family}, {cal.level} level, {cal.workload} workload, {cal.date}, commit {cal.commit}")
    targets = [ROOT / t for t in GPU_TARGETS] if args.write is None else list(args.write)
    record = args.record or ROOT / record_path(cal)
    shown = record.resolve().relative_to(ROOT).as_posix() if record.resolve().is_relative_to(ROOT) else str(record)
    if args.check:
        wrong = [f"{t}: {configured(t.read_text())}" for t in targets
                 if set(configured(t.read_text())) != {cal.slo_streams}]
        for line in wrong:
            out(f"differs: {line}")
        return EXIT_PROBLEM if wrong else 0
    write_record(cal, record)
    out(f"wrote {shown}")
    try:
        for path in write_configs(cal, targets, shown):
            out(f"set slo_streams: {cal.slo_streams:g} in {path}")
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return 0
