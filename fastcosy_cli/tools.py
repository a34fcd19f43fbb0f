"""Offline tools of ``fastcosy``: ``make-tiny-model``, ``build-trt``, ``bench``, ``config-reference``.

``build-trt`` and ``bench`` hand their arguments to the modules that implement them
(``cosyvoice_runtime.trt.build``; for ``bench TOOL``, the module :data:`BENCH_TOOLS` names; ``bench``
is installed with the project).
Those modules import torch, so each command imports its module when it runs: ``fastcosy --help``
and ``fastcosy doctor`` must work on a node where torch is not installed yet.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from fastcosy_cli.common import EXIT_PROBLEM, CliError, out

logger = logging.getLogger(__name__)

DEFAULT_REFERENCE_PATH = Path("docs/configuration.md")


def _forward(args: argparse.Namespace) -> list[str]:
    rest = list(getattr(args, "rest", None) or [])
    return [a for i, a in enumerate(rest) if not (a == "--" and i == 0)]


# ------------------------------------------------------------------------------ make-tiny-model
def add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write the tiny random-weight model (official layout; NOT speech)")
    p.add_argument("--family", choices=["cosyvoice2", "cosyvoice3"], default="cosyvoice2",
                   help="architecture family (default cosyvoice2: 24 kHz)")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0: the same model the service writes)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing directory")
    p.set_defaults(func=run_make_tiny_model)


def run_make_tiny_model(args: argparse.Namespace) -> int:
    from cosyvoice_runtime.tiny_model import write_tiny_model

    target = Path(args.out)
    existed = target.exists()
    if existed and not args.overwrite:
        raise CliError(f"{target} exists; pass --overwrite to replace it")
    path = write_tiny_model(target, family=args.family, seed=args.seed, overwrite=args.overwrite)
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    out(f"wrote the tiny RANDOM-WEIGHT {args.family} model (valid audio, not speech) to {path}")
    out(f"  {len(files)} files: {', '.join(files)}")
    out(f"  serve it: set model_dir: {path} in the config, or FAST_COSY_MODEL_DIR={path}")
    return 0


# ------------------------------------------------------------------------------------ build-trt
def add_build_trt(sub: argparse._SubParsersAction) -> None:
    # add_help=False: --help reaches the builder's parser, which owns the flags.
    p = sub.add_parser("build-trt", add_help=False, help="offline TensorRT plan build for the flow estimator "
                       "(python -m cosyvoice_runtime.trt.build; fastcosy build-trt --help lists its flags)")
    p.set_defaults(func=run_build_trt, forward_rest=True)


@dataclass
class BuildPlan:
    """What a build-trt run is asked to build, derived with the builder's own functions."""

    model_dir: Path
    out: Path
    family: str
    precision: str
    requested: object  # ReplicaLimits from the flags
    limits: object  # ReplicaLimits after --max-mem-gb
    max_mem_gb: float | None
    workspace_gb: float
    profile: object  # EstimatorProfile


def plan_build(argv: list[str]) -> BuildPlan:
    """Parse ``argv`` with the builder's parser and derive its limits and profile (no export).

    Raises:
        SystemExit: bad arguments or ``--help`` (argparse's own behaviour).
        CliError: the model directory does not load, or the memory budget is too small.
    """
    from cosyvoice_runtime.errors import CosyVoiceError
    from cosyvoice_runtime.trt import build as trt_build
    from cosyvoice_runtime.trt.profiles import ReplicaLimits, derive_profile
    from cosyvoice_runtime.yaml_config import read_model_spec

    # The builder's own parser: the same flags, defaults and errors.
    a = trt_build.build_parser().parse_args(argv)
    try:
        spec = read_model_spec(a.model_dir)
        requested = ReplicaLimits(max_flow_batch=a.max_batch, max_prompt_s=a.max_prompt_s, max_total_s=a.max_total_s)
        limits = trt_build.limits_from_args(spec, a)
    except CosyVoiceError as exc:
        raise CliError(f"cannot build TensorRT plans: {exc}") from None
    except ValueError as exc:  # limits out of range, or a memory budget below the fixed costs
        raise CliError(f"cannot build TensorRT plans: {exc}") from None
    return BuildPlan(model_dir=a.model_dir, out=a.out, family=spec.family, precision="fp16" if a.fp16 else "fp32",
                     requested=requested, limits=limits, max_mem_gb=a.max_mem_gb, workspace_gb=a.workspace_gb,
                     profile=derive_profile(spec, limits))


def _limits_text(limits) -> str:
    return (f"flow batch {limits.max_flow_batch}, prompt <= {limits.max_prompt_s:g} s, "
            f"flow call <= {limits.max_total_s:g} s")


def build_summary(plan: BuildPlan, rc: int, started: float) -> str:
    """The closing summary: profiles, precision, memory budget, files written, outcome."""
    if plan.max_mem_gb is None:
        memory = f"none (--max-mem-gb not given): {_limits_text(plan.limits)} as asked"
    elif plan.limits == plan.requested:
        memory = f"{plan.max_mem_gb:g} GB: {_limits_text(plan.limits)} fit as asked"
    else:
        memory = (f"{plan.max_mem_gb:g} GB: lowered to {_limits_text(plan.limits)} "
                  f"(asked: flow batch {plan.requested.max_flow_batch}, flow call <= {plan.requested.max_total_s:g} s)")
    onnx = sorted(p.name for p in plan.out.glob("estimator.*.onnx")) if plan.out.is_dir() else []
    plans = sorted(p.name for p in plan.out.glob("*.plan")
                   if p.stat().st_mtime >= started - 1) if plan.out.is_dir() else []
    if rc == 0:
        outcome = f"done: serve with synthesizer.mode: trt, trt_plan_dir: {plan.out}"
    elif not plans and onnx:
        why = ("TensorRT is not installed here" if importlib.util.find_spec("tensorrt") is None
               else "see the error above")
        outcome = (f"stopped after the ONNX export, no TensorRT plan built (exit {rc}: {why}). Run the same "
                   "command on a node with the serving GPU and the [trt] extra installed")
    else:
        outcome = f"failed (exit {rc}; the reason is logged above)"
    lines = [
        "build-trt summary",
        f"  model        {plan.model_dir} ({plan.family})",
        f"  precision    {plan.precision}",
        f"  memory       replica budget {memory}; TensorRT workspace {plan.workspace_gb:g} GB",
        f"  profile      estimator rows (2 x flow batch) {plan.profile.rows}, mel frames {plan.profile.frames}",
        *("  " + line for line in plan.profile.table().splitlines()),
        f"  onnx         {', '.join(onnx) or 'none'} in {plan.out}",
        f"  plans        {', '.join(plans) or 'none built'}",
        f"  result       {outcome}",
    ]
    return "\n".join(lines)


def run_build_trt(args: argparse.Namespace) -> int:
    from cosyvoice_runtime.errors import CosyVoiceError
    from cosyvoice_runtime.trt import build as trt_build

    argv = _forward(args)
    plan = plan_build(argv)
    started = time.time()
    with warnings.catch_warnings():
        # torch's ONNX exporter warns once per graph pass about Slice folding: noise for an operator.
        warnings.filterwarnings("ignore", message="Constant folding", category=UserWarning)
        try:
            # Without tensorrt the builder still writes the ONNX files, then exits 2 with what to install.
            rc = int(trt_build.main(argv) or 0)
        except CosyVoiceError as exc:
            raise CliError(f"cannot build TensorRT plans: {exc}") from None
    out(build_summary(plan, rc, started))
    return rc


# ---------------------------------------------------------------------------------------- bench
# The benchmarks a user runs, each its module's own command line (``fastcosy bench TOOL --help``);
# the others in bench/ are the project's measurements (docs/tuning.md says which answered what).
BENCH_TOOLS = {
    "throughput": ("bench.gpu_bench", "one replica's throughput and first audio per concurrency, arms as config overrides"),
    "capacity": ("bench.capacity", "sessions and Poisson rate at the first-audio SLO, in process or over HTTP"),
    "serve-load": ("bench.serve_load", "the whole Serve app from a config under closed-loop HTTP streams"),
    "load": ("bench.load", "HTTP load against a running service, open or closed loop"),
    "ramp": ("bench.ramp", "a low-high-low load ramp against a service: replicas, utilisation, queue"),
    "soak": ("bench.soak", "thousands of requests through the local app, then leak and loss checks"),
    "cold-start": ("bench.cold_start", "a new replica's start until its first request is served"),
    "fleet-sim": ("bench.fleet_sim", "autoscaling policies over a simulated day of a GPU fleet"),
}


def add_bench(sub: argparse._SubParsersAction) -> None:
    # add_help=False: TOOL --help reaches the tool's parser, which owns the flags.
    p = sub.add_parser("bench", add_help=False, help=f"benchmarks: fastcosy bench TOOL ... ({', '.join(BENCH_TOOLS)}; "
                       "fastcosy bench --help lists them)")
    p.set_defaults(func=run_bench, forward_rest=True)


def bench_usage() -> str:
    width = max(map(len, BENCH_TOOLS))
    return "\n".join(["usage: fastcosy bench TOOL [ARGS ...]   (fastcosy bench TOOL --help: its flags)", "", "tools:",
                      *[f"  {name:<{width}}  {what} (python -m {module})" for name, (module, what) in BENCH_TOOLS.items()]])


def run_bench(args: argparse.Namespace) -> int:
    import importlib

    argv = _forward(args)
    if not argv or argv[0] in ("-h", "--help"):
        out(bench_usage())
        return 0
    tool, *rest = argv
    if tool not in BENCH_TOOLS:
        raise CliError(f"unknown benchmark {tool!r}\n{bench_usage()}")
    module = importlib.import_module(BENCH_TOOLS[tool][0])
    prog, sys.argv[0] = sys.argv[0], f"fastcosy bench {tool}"  # the tool's parser names itself after argv[0]
    try:
        rc = module.main(rest)
    finally:
        sys.argv[0] = prog
    return rc if isinstance(rc, int) else 0  # some tools return their figures, not an exit code


# ----------------------------------------------------------------------------- config-reference
def add_config_reference(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config-reference", help="write the configuration reference generated from the pydantic models")
    p.add_argument("-o", "--output", default=str(DEFAULT_REFERENCE_PATH), help="'-' for stdout")
    p.add_argument("--check", action="store_true", help="exit 1 if the file differs from the generated text")
    p.set_defaults(func=run_config_reference)


def run_config_reference(args: argparse.Namespace) -> int:
    from fastcosy_cli.config_reference import render_reference

    text = render_reference()
    if args.output == "-":
        out(text.rstrip("\n"))
        return 0
    path = Path(args.output)
    if args.check:
        current = path.read_text(encoding="utf-8") if path.exists() else ""
        if current != text:
            out(f"{path} is stale: regenerate it with fastcosy config-reference -o {path}")
            return EXIT_PROBLEM
        out(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    out(f"wrote {path}")
    return 0
