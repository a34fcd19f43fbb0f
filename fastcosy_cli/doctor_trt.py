"""``fastcosy doctor``'s TensorRT checks: the installed TensorRT, and whether a replica finds a
plan it loads (the loader's own rule, :mod:`cosyvoice_runtime.trt.plan_key`)."""
from __future__ import annotations

from pathlib import Path

from cosyvoice_runtime.trt.plan_key import (
    FLOW_CHECKPOINT,
    PLAN_SUFFIX,
    EngineKey,
    plan_mismatches,
    read_sidecar,
    sha256_file,
)
from fastcosy_cli.doctor_results import CheckResult, Environment, Status, parse_version, version_text

MIN_TENSORRT = (10, 13)  # the [trt] extra's floor (pyproject.toml)


def check_tensorrt(env: Environment) -> CheckResult:
    needed = env.mode == "trt"
    if env.tensorrt_version is None:
        if not needed:
            return CheckResult("tensorrt", Status.OK, "not installed (only needed for synthesizer.mode: trt)")
        return CheckResult("tensorrt", Status.FAIL, f"synthesizer.mode is trt but tensorrt does not import"
                           f"{': ' + env.tensorrt_error if env.tensorrt_error else ''}",
                           f"install the [trt] extra (tensorrt >= {version_text(MIN_TENSORRT)}; its libraries come from "
                           "NVIDIA's package index, not PyPI alone), or set synthesizer.mode: pytorch")
    if parse_version(env.tensorrt_version)[:2] < MIN_TENSORRT:
        status = Status.FAIL if needed else Status.WARN
        return CheckResult("tensorrt", status, f"TensorRT {env.tensorrt_version} is older than {version_text(MIN_TENSORRT)}",
                           f"install tensorrt >= {version_text(MIN_TENSORRT)} and rebuild the plans")
    used = "" if needed else " (not used: synthesizer.mode is pytorch)"
    return CheckResult("tensorrt", Status.OK, f"TensorRT {env.tensorrt_version}{used}")


def _capability_text(cap: tuple[int, int]) -> str:
    return f"{cap[0]}.{cap[1]}"  # as the loader formats torch.cuda.get_device_capability()


def _build_command(env: Environment, fp16: bool) -> str:
    model = env.model_dir or "<model dir>"
    out = env.engine_cache_dir or "<trt_plan_dir>"
    cmd = f"fastcosy build-trt --model-dir {model} --out {out}"
    if fp16:
        cmd += " --fp16"
    if env.trt_profile_needed:
        cmd += f" --max-batch {env.trt_profile_needed['rows'][2] // 2}"
    return cmd


def check_engine_cache(env: Environment) -> list[CheckResult]:
    """Will a replica find a plan it loads? Same rule as the loader; stale plans beside a usable
    one are warnings (replicas ignore them), no usable plan is a failure."""
    if env.mode != "trt":
        return [CheckResult("engine_cache", Status.OK, f"skipped (synthesizer.mode is {env.mode})")]
    root = env.engine_cache_dir
    build_fix = (f"build plans on a node with this GPU and TensorRT: {_build_command(env, fp16=False)} "
                 "(add --fp16 for fp16 kernels)")
    if root is None or not root.is_dir():
        return [CheckResult("engine_cache", Status.FAIL, f"TensorRT plan directory {root} does not exist", build_fix)]
    plans = sorted(root.glob(f"*{PLAN_SUFFIX}"))
    if not plans:
        return [CheckResult("engine_cache", Status.FAIL, f"no *{PLAN_SUFFIX} files in {root}", build_fix)]
    gpu = next((g for g in env.gpus if g.index == env.device_index()), None)
    capability = _capability_text(gpu.capability) if gpu is not None and gpu.capability else None
    flow = env.model_dir / FLOW_CHECKPOINT if env.model_dir is not None else None
    flow_sha: str | None = None
    verdicts: list[tuple[Path, dict | None, list[str]]] = []
    for plan in plans:
        meta, unusable = read_sidecar(plan)
        if meta is None:
            verdicts.append((plan, None, [unusable]))
            continue
        if (flow_sha is None and env.verify_checksums and meta.get("flow_sha256") and flow is not None
                and flow.is_file()):
            flow_sha = sha256_file(flow)
        verdicts.append((plan, meta, plan_mismatches(EngineKey.from_sidecar(meta), meta["profile"],
                                                     meta.get("flow_sha256"), compute_capability=capability,
                                                     tensorrt_version=env.tensorrt_version,
                                                     needed=env.trt_profile_needed, flow_sha256=flow_sha)))
    usable = [(p, m) for p, m, why in verdicts if not why]
    unknown = [what for what, known in (("this GPU's compute capability", capability),
                                        ("the installed TensorRT version", env.tensorrt_version),
                                        ("the profile the replica needs", env.trt_profile_needed)) if known is None]
    out = []
    for plan, meta, why in verdicts:
        fix = (f"delete {plan} and rebuild: {_build_command(env, fp16=bool(meta) and meta['precision'] == 'fp16')}"
               if why else "")
        if not why:
            status = Status.WARN if unknown else Status.OK
            msg = (f"{plan.name}: {meta['attention']} attention, {meta['precision']}, sm{meta['compute_capability']}, "
                   f"TensorRT {meta['tensorrt_version']}")
            msg += f"; not compared with {', '.join(unknown)} (not detected)" if unknown else ": a replica loads it"
            fix = "run doctor on the serving node with tensorrt installed and --config" if unknown else ""
        elif usable:
            status = Status.WARN
            msg = f"{plan.name}: ignored by replicas ({'; '.join(why)}); another plan is usable"
        else:
            status = Status.FAIL
            msg = f"{plan.name}: {'; '.join(why)} (plans are specific to GPU arch and exact TensorRT version)"
        out.append(CheckResult("engine_cache", status, msg, fix))
    if usable:
        patterns = sorted({m["attention"] for _, m in usable})
        if patterns == ["full"]:
            out.append(CheckResult("engine_cache", Status.OK, "no chunk-attention plan: streamed flow calls use the "
                                   "full-attention one (the official behaviour)"))
    else:
        out.append(CheckResult("engine_cache", Status.FAIL, f"no plan in {root} loads on this node: the synthesizer "
                               "replica will refuse to start", build_fix))
    return out
