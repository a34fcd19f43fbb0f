"""Offline tools of ``fastcosy``: ``make-tiny-model``, ``build-trt``, ``bench``, ``config-reference``.

``build-trt`` and ``bench`` hand their arguments to the modules that implement them
(``cosyvoice_runtime.trt.build``, ``bench.gpu_bench``) and say so plainly, with exit code 2,
where this installation does not have them.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
from pathlib import Path

from serve_app.cli_common import EXIT_PROBLEM, CliError, out

logger = logging.getLogger(__name__)

TRT_BUILD_MODULE = "cosyvoice_runtime.trt.build"
BENCH_MODULE = "bench.gpu_bench"
DEFAULT_REFERENCE_PATH = Path("docs/configuration.md")


def _module_or_none(name: str):
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # a missing parent package
        return None
    return importlib.import_module(name)


def _forward(args: argparse.Namespace) -> list[str]:
    rest = list(getattr(args, "rest", None) or [])
    return [a for i, a in enumerate(rest) if not (a == "--" and i == 0)]


# ------------------------------------------------------------------------------ make-tiny-model
def add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write the tiny random-weight model (official layout; NOT speech)")
    p.add_argument("--family", choices=["cosyvoice2", "cosyvoice3"], default="cosyvoice2")
    p.add_argument("--out", required=True, help="directory to create")
    p.add_argument("--seed", type=int, default=0)
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
    p = sub.add_parser("build-trt", help="offline TensorRT plan build for the flow estimator (arguments are passed "
                       f"to python -m {TRT_BUILD_MODULE})")
    p.set_defaults(func=run_build_trt, forward_rest=True)


def run_build_trt(args: argparse.Namespace) -> int:
    builder = _module_or_none(TRT_BUILD_MODULE)
    if builder is None or not callable(getattr(builder, "main", None)):
        raise CliError(f"TensorRT plan building is not available in this installation: {TRT_BUILD_MODULE} (with a "
                       "main(argv)) does not exist. Serve with synthesizer.mode: pytorch meanwhile.")
    # Without tensorrt the builder still writes the ONNX files, then exits 2 with what to install.
    return int(builder.main(_forward(args)) or 0)


# ---------------------------------------------------------------------------------------- bench
def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help=f"GPU streaming benchmark (arguments are passed to python -m {BENCH_MODULE})")
    p.set_defaults(func=run_bench, forward_rest=True)


def run_bench(args: argparse.Namespace) -> int:
    bench = _module_or_none(BENCH_MODULE)
    if bench is None or not callable(getattr(bench, "main", None)):
        raise CliError(f"the benchmark ({BENCH_MODULE}) is not importable: it lives in the repository's bench/ "
                       "folder, which is not part of the installed package; run fastcosy bench from the "
                       "repository root")
    return int(bench.main(_forward(args)) or 0)


# ----------------------------------------------------------------------------- config-reference
def add_config_reference(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config-reference", help="write the configuration reference generated from the pydantic models")
    p.add_argument("-o", "--output", default=str(DEFAULT_REFERENCE_PATH), help="'-' for stdout")
    p.add_argument("--check", action="store_true", help="exit 1 if the file differs from the generated text")
    p.set_defaults(func=run_config_reference)


def run_config_reference(args: argparse.Namespace) -> int:
    from serve_app.cli_config_reference import render_reference

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
