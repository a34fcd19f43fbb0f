"""Offline TensorRT build of the flow estimator (never run inside a replica).

::

    python -m cosyvoice_runtime.trt.build --model-dir D --out DIR [--fp16] [--max-batch N]
    fastcosy build-trt --model-dir D --out DIR ...          (same arguments)

Steps: derive the profile from the model spec and the replica limits
(:mod:`cosyvoice_runtime.trt.profiles`, optionally fitted to ``--max-mem-gb``); export the
estimator to ONNX once per attention pattern (``full``, and ``chunk`` with the streaming masks
baked in) and check it with onnxruntime; build each engine with the TensorRT Python API; write
``DIR/<plan name>`` under its cache key (GPU compute capability, TensorRT version, profile
hash, precision, ONNX hash) with a ``<plan>.json`` sidecar that replicas and ``fastcosy
doctor`` read; check the engine against torch on the GPU.

Without TensorRT (an optional extra whose libraries do not install from PyPI alone) the ONNX
files are still written, then the command exits with code 2 and says what to install.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch

from cosyvoice_runtime.trt.plan_key import EngineKey, sha256_file, write_sidecar
from cosyvoice_runtime.trt.profiles import GIB, EstimatorProfile, ReplicaLimits, derive_profile, fit_to_memory

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_PROBLEM = 1  # the engine builds but disagrees with torch
EXIT_CANNOT_RUN = 2  # no TensorRT / no GPU / the build failed
DEFAULT_WORKSPACE_GB = 4.0
# Engine vs torch on the GPU (spec §10.6: the export check's tolerances; fp16 is looser).
CHECK_TOL = {"fp32": (1e-2, 1e-3), "fp16": (5e-2, 5e-2)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fastcosy build-trt", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path, help="plan directory (synthesizer.trt_plan_dir)")
    p.add_argument("--fp16", action="store_true", help="fp16 kernels (inputs/outputs stay float32)")
    p.add_argument("--max-batch", type=int, default=ReplicaLimits.max_flow_batch,
                   help="largest flow batch (= synthesizer.token2wav.max_batch_size); the engine sees 2x (CFG)")
    p.add_argument("--max-prompt-s", type=float, default=ReplicaLimits.max_prompt_s)
    p.add_argument("--max-total-s", type=float, default=ReplicaLimits.max_total_s,
                   help="longest flow call: prompt + generated audio of one text piece")
    p.add_argument("--max-mem-gb", type=float, default=None,
                   help="replica memory budget: lowers --max-batch / --max-total-s until the estimate fits")
    p.add_argument("--max-running", type=int, default=16, help="LLM slots counted in the --max-mem-gb estimate")
    p.add_argument("--max-model-len", type=int, default=2048, help="KV positions counted in the --max-mem-gb estimate")
    p.add_argument("--attention", choices=["full", "chunk", "both"], default="both",
                   help="full: padding-only attention; chunk: streaming chunk masks baked in")
    p.add_argument("--workspace-gb", type=float, default=DEFAULT_WORKSPACE_GB)
    p.add_argument("--no-verify", action="store_true", help="skip the onnxruntime and engine checks")
    return p


def limits_from_args(spec, args: argparse.Namespace) -> ReplicaLimits:
    limits = ReplicaLimits(max_flow_batch=args.max_batch, max_prompt_s=args.max_prompt_s, max_total_s=args.max_total_s)
    if args.max_mem_gb is None:
        return limits
    # Weights in the serving dtype: the LLM and flow follow --fp16, the vocoder stays fp32.
    from cosyvoice_runtime.model import build_modules

    dtype_bytes = 2 if args.fp16 else 4
    mods = build_modules(spec, device="meta")  # shapes only, no memory
    weights = sum(p.numel() * (4 if name == "hift" else dtype_bytes)
                  for name, m in mods.items() for p in m.parameters())
    fitted = fit_to_memory(spec, args.max_mem_gb, limits, weights_bytes=weights, max_running=args.max_running,
                           max_model_len=args.max_model_len, dtype_bytes=dtype_bytes)
    if fitted != limits:
        logger.info("max_mem_gb %g: flow batch %d -> %d, longest call %.0f s -> %.0f s", args.max_mem_gb,
                    limits.max_flow_batch, fitted.max_flow_batch, limits.max_total_s, fitted.max_total_s)
    return fitted


def export_onnx(estimator, out_dir: Path, attention: str, verify: bool) -> tuple[Path, str]:
    """``out_dir/estimator.<attention>.onnx`` and its SHA-256."""
    from cosyvoice_runtime.trt.export import export_estimator, verify_onnx

    path = out_dir / f"estimator.{attention}.onnx"
    started = time.perf_counter()
    export_estimator(estimator, path, streaming=attention == "chunk")
    logger.info("[onnx] %s exported in %.1f s", path.name, time.perf_counter() - started)
    if verify:
        try:
            worst = verify_onnx(path, estimator, streaming=attention == "chunk")
            logger.info("[onnx] onnxruntime matches torch (max abs err %.2e)", worst)
        except ImportError:
            logger.warning("[onnx] onnxruntime is not installed: ONNX not checked")
    return path, sha256_file(path)


def build_serialized(onnx_path: Path, profile: EstimatorProfile, fp16: bool, workspace_gb: float) -> bytes:
    """Parse the ONNX and build a serialized engine with one optimisation profile."""
    import tensorrt as trt

    trt_logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(trt_logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT >= 10
    parser = trt.OnnxParser(network, trt_logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gb * GIB))
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    opt = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile.shapes().items():
        opt.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(opt)
    config.progress_monitor = _progress_monitor(trt)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path} (see the messages above)")
    return bytes(plan)


def _progress_monitor(trt):
    class Progress(trt.IProgressMonitor):
        """Logs each build phase once at start and at the end (the builder has few, long phases)."""

        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.started: dict[str, float] = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            self.started[phase_name] = time.perf_counter()
            logger.info("[trt] %s%s (%d steps)", "  " if parent_phase else "", phase_name, num_steps)

        def step_complete(self, phase_name, step):
            return True  # never cancel

        def phase_finish(self, phase_name):
            took = time.perf_counter() - self.started.pop(phase_name, time.perf_counter())
            if took > 1.0:
                logger.info("[trt] %s done in %.0f s", phase_name, took)

    return Progress()


def write_plan(out_dir: Path, serialized: bytes, key: EngineKey, profile: EstimatorProfile, **meta) -> Path:
    """Write the plan atomically (no empty plan after a crash) and its sidecar."""
    path = out_dir / key.plan_name()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(serialized)
    os.replace(tmp, path)
    write_sidecar(path, key, profile.to_dict(), **meta)
    return path


def check_plan(plan_path: Path, estimator, profile: EstimatorProfile, streaming: bool, precision: str) -> float:
    """Engine vs the torch estimator on the GPU at the profile's edges; returns the worst error."""
    from cosyvoice_runtime.trt.engine import _TrtRunner, read_plans
    from cosyvoice_runtime.trt.export import INPUT_NAMES, dummy_inputs

    info = next(p for p in read_plans(plan_path.parent)[0] if p.path == plan_path)
    runner = _TrtRunner(info, torch.device("cuda"), pool_size=1)
    est = estimator.to("cuda")
    rtol, atol = CHECK_TOL[precision]
    worst = 0.0
    shapes = {(profile.rows[0], profile.frames[0]), (profile.rows[1], profile.frames[1]),
              (2, profile.frames[2]), (profile.rows[2], min(profile.frames[2], profile.frames[1]))}
    try:
        for seed, (rows, frames) in enumerate(sorted(shapes)):
            args = [a.cuda() for a in dummy_inputs(profile.n_mels, profile.spk_dim, rows, frames, seed=seed)]
            with torch.inference_mode():
                ref = est(*args, streaming=streaming).float()
                got = runner(dict(zip(INPUT_NAMES, args))).float()
            if not torch.isfinite(got).all():
                raise AssertionError(f"{plan_path.name}: non-finite output at rows {rows} frames {frames}")
            err = (got - ref).abs()
            worst = max(worst, float(err.max()))
            if bool((err > atol + rtol * ref.abs()).any()):
                raise AssertionError(f"{plan_path.name}: rows {rows} frames {frames}: max err {err.max():.3e} "
                                     f"beyond rtol {rtol} atol {atol}")
    finally:
        estimator.to("cpu")
    return worst


def main(argv: list[str] | None = None) -> int:
    from cosyvoice_runtime.errors import ModelLoadError
    from cosyvoice_runtime.flow.flow import build_flow
    from cosyvoice_runtime.trt.engine import gpu_compute_capability, tensorrt_version
    from cosyvoice_runtime.weights import load_checkpoint
    from cosyvoice_runtime.yaml_config import read_model_spec

    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = read_model_spec(args.model_dir)
    try:
        limits = limits_from_args(spec, args)
    except ValueError as exc:
        logger.error("%s", exc)
        return EXIT_CANNOT_RUN
    profile = derive_profile(spec, limits)
    precision = "fp16" if args.fp16 else "fp32"
    if args.fp16 and spec.flow.dit is not None:
        logger.warning("fp16 engines of the CosyVoice3 DiT are reported to give non-finite output (spec §7.3); "
                       "the engine check below catches that; build without --fp16 if it fails")
    logger.info("%s estimator, %s, max flow batch %d (engine rows %s), frames %s\n%s", spec.family, precision,
                limits.max_flow_batch, profile.rows, profile.frames, profile.table())

    flow_file = args.model_dir / spec.files["flow"]
    flow = build_flow(spec.flow)
    load_checkpoint(flow, flow_file)
    estimator = flow.decoder.estimator.eval().requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    attentions = ["full", "chunk"] if args.attention == "both" else [args.attention]
    onnx = {att: export_onnx(estimator, args.out, att, verify=not args.no_verify) for att in attentions}

    try:
        trt_version = tensorrt_version("building TensorRT plans")
        capability = gpu_compute_capability(purpose="building TensorRT plans")
    except ModelLoadError as exc:
        logger.error("cannot build TensorRT plans here: %s\nthe ONNX files are written: %s", exc.problem,
                     ", ".join(str(p) for p, _ in onnx.values()))
        return EXIT_CANNOT_RUN
    flow_sha = sha256_file(flow_file)
    rows = []
    for att, (onnx_path, onnx_hash) in onnx.items():
        key = EngineKey(compute_capability=capability, tensorrt_version=trt_version, profile_hash=profile.digest(),
                        precision=precision, onnx_hash=onnx_hash[:16], attention=att)
        started = time.perf_counter()
        logger.info("[trt] building %s (this takes minutes)", key.plan_name())
        try:
            serialized = build_serialized(onnx_path, profile, args.fp16, args.workspace_gb)
        except RuntimeError as exc:
            logger.error("%s", exc)
            return EXIT_CANNOT_RUN
        plan = write_plan(args.out, serialized, key, profile, family=spec.family, flow_sha256=flow_sha,
                          onnx_file=onnx_path.name, max_flow_batch=limits.max_flow_batch,
                          max_prompt_s=limits.max_prompt_s, max_total_s=limits.max_total_s,
                          built_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        took = time.perf_counter() - started
        worst = None
        if not args.no_verify:
            try:
                worst = check_plan(plan, estimator, profile, streaming=att == "chunk", precision=precision)
            except AssertionError as exc:
                logger.error("engine check failed: %s", exc)
                return EXIT_PROBLEM
        rows.append((att, plan.name, len(serialized) / 2**20, took, worst))
    logger.info("\n%-6s %-72s %9s %8s %10s", "attn", "plan", "MiB", "build s", "max err")
    for att, name, mib, took, worst in rows:
        logger.info("%-6s %-72s %9.1f %8.0f %10s", att, name, mib, took, "-" if worst is None else f"{worst:.2e}")
    logger.info("serve them with synthesizer.mode: trt, trt_plan_dir: %s", args.out)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
