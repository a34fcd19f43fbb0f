"""``fastcosy doctor``: probe this machine into an :class:`~fastcosy_cli.doctor_results.Environment` and
run the checks. Every probe tolerates a missing component (that absence is itself a fact)."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import shutil
import socket
import subprocess
import warnings
from pathlib import Path
from urllib.parse import urlparse

from fastcosy_cli.common import CliError, out
from fastcosy_cli.doctor_checks import detect_family, run_checks
from fastcosy_cli.doctor_results import Environment, GpuInfo, exit_code, format_report, results_json

logger = logging.getLogger(__name__)

_NVIDIA_SMI_TIMEOUT_S = 10
_RAY_PROBE_TIMEOUT_S = 3.0
_GCS_DEFAULT_PORT = 6379
_RAY_CLIENT_DEFAULT_PORT = 10001
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


# ------------------------------------------------------------------------------------ probes
def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=_NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def probe_nvidia_smi() -> tuple[str | None, str | None, list[GpuInfo]]:
    """(driver version, driver CUDA version, GPUs) from nvidia-smi, without creating a CUDA context."""
    header = _run(["nvidia-smi"])
    cuda = None
    if header and (m := re.search(r"CUDA Version:\s*([\d.]+)", header)):
        cuda = m.group(1)
    table = _run(["nvidia-smi", "--query-gpu=index,name,driver_version,compute_cap,memory.total,memory.free",
                  "--format=csv,noheader,nounits"])
    gpus, driver = [], None
    for line in (table or "").strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 6:
            continue
        idx, name, driver, cap, total, free = parts
        capability = tuple(int(x) for x in cap.split(".")) if re.fullmatch(r"\d+\.\d+", cap) else None
        mib = 1024**2
        gpus.append(GpuInfo(int(idx), name, capability,
                            int(float(total)) * mib if total.replace(".", "").isdigit() else None,
                            int(float(free)) * mib if free.replace(".", "").isdigit() else None))
    return driver, cuda, gpus


def probe_torch(env: Environment) -> None:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - broken installs raise more than ImportError
        env.extra["torch_error"] = str(exc)
        return
    env.torch_version = torch.__version__
    env.torch_cuda_version = torch.version.cuda
    if not env.torch_cuda_version:
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            env.cuda_available = bool(torch.cuda.is_available())
        except Exception as exc:  # noqa: BLE001 - a broken driver is reported, not raised
            env.cuda_error = str(exc)
    if not env.cuda_available and caught:
        env.cuda_error = env.cuda_error or str(caught[-1].message)
    if env.cuda_available:
        env.torch_arch_list = tuple(torch.cuda.get_arch_list())
        if not env.gpus:  # nvidia-smi missing (some containers): ask torch
            gpus = []
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                free, total = torch.cuda.mem_get_info(i)
                gpus.append(GpuInfo(i, props.name, (props.major, props.minor), int(total), int(free)))
            env.gpus = tuple(gpus)
        if env.driver_cuda_version is None:
            try:
                v = int(torch._C._cuda_getDriverVersion())  # e.g. 12080
                env.driver_cuda_version = f"{v // 1000}.{(v % 1000) // 10}"
            except Exception as exc:  # noqa: BLE001 - a private torch call: the version stays unknown
                logger.debug("driver CUDA version unknown: %s", exc)


def probe_tensorrt(env: Environment) -> None:
    try:
        import tensorrt

        env.tensorrt_version = tensorrt.__version__
    except Exception as exc:  # noqa: BLE001 - a broken TensorRT install is reported, not raised
        env.tensorrt_error = f"{type(exc).__name__}: {exc}"


def probe_wetext(env: Environment) -> None:
    try:
        from importlib.metadata import version

        spec = importlib.util.find_spec("wetext")
        if spec is None or not spec.submodule_search_locations:
            return
        env.wetext_version = version("wetext")
        env.wetext_fst_dir = Path(next(iter(spec.submodule_search_locations))) / "fsts"
    except Exception as exc:  # noqa: BLE001 - the wetext checks report what is missing
        logger.debug("wetext probe failed: %s", exc)


def probe_ray(address: str) -> str | None:
    """None when the cluster answers; else why not. Dashboard URLs get an HTTP request,
    GCS / Ray-client addresses a TCP connect."""
    if address.startswith(("http://", "https://")):
        import httpx

        try:
            resp = httpx.get(address.rstrip("/") + "/api/version", timeout=_RAY_PROBE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        if resp.status_code in (401, 403):
            return f"HTTP {resp.status_code}: the dashboard needs an auth token"
        return None if resp.status_code == 200 else f"HTTP {resp.status_code} from the dashboard"
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    default = _RAY_CLIENT_DEFAULT_PORT if parsed.scheme == "ray" else _GCS_DEFAULT_PORT
    try:
        with socket.create_connection((parsed.hostname or "", parsed.port or default), timeout=_RAY_PROBE_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def estimate_need_bytes(model_dir: Path | None, dtype: str, max_running: int, max_model_len: int,
                        flow_cache_bytes: int = 0) -> int | None:
    """Rough synthesizer GPU need: weights (llm/flow at ``dtype``, hift fp32) + full KV cache +
    the incremental flow's cache budget (``token2wav.flow_cache_bytes``, when that flow is on)."""
    if model_dir is None or not model_dir.is_dir():
        return None
    scale = _DTYPE_BYTES.get(dtype, 4) / 4
    weights = 0
    for name, factor in (("llm.pt", scale), ("flow.pt", scale), ("hift.pt", 1.0)):
        p = model_dir / name
        if p.is_file():
            weights += int(p.stat().st_size * factor)
    try:
        from cosyvoice_runtime.yaml_config import read_model_spec

        b = read_model_spec(model_dir).llm.backbone
        kv = 2 * b.num_layers * b.num_kv_heads * b.head_dim * max_running * max_model_len * _DTYPE_BYTES.get(dtype, 4)
    except Exception:  # noqa: BLE001 - a broken yaml is the model checks' business
        kv = 0
    return weights + kv + flow_cache_bytes


def incremental_flow_budget(synth) -> int:
    """The flow cache budget a replica of ``synth`` may fill: 0 unless an incremental flow is on
    ("auto" is on wherever the replica is not told to run on the CPU)."""
    t2w = synth.token2wav
    flows = (t2w.cv2_flow, t2w.cv3_flow)
    on = "incremental" in flows or ("auto" in flows and synth.device != "cpu")
    return t2w.flow_cache_bytes if on else 0


def needed_trt_profile(model_dir: Path | None, synth, max_mem_gb: float | None = None) -> dict | None:
    """The estimator profile a trt replica asks its plans to cover, computed as the replica does
    (``deployments.assembler.replica_limits`` + ``derive_profile``) on meta-device modules
    (shapes only, no weights read); None when the model directory or the runtime is not
    available here (the model checks report why).
    """
    if model_dir is None or not model_dir.is_dir():
        return None
    try:
        import torch

        from cosyvoice_runtime.errors import CosyVoiceError
        from cosyvoice_runtime.model import build_modules
        from cosyvoice_runtime.trt.profiles import derive_profile
        from cosyvoice_runtime.yaml_config import read_model_spec
        from deployments.assembler import replica_limits
        from deployments.synthesizer_config import SynthesizerConfig
    except ImportError as exc:
        logger.debug("no TensorRT profile requirement: %s", exc)
        return None
    cfg = synth or SynthesizerConfig()
    if max_mem_gb is not None:
        cfg = cfg.model_copy(update={"max_mem_gb": max_mem_gb})
    try:
        spec = read_model_spec(model_dir)
        dtype = getattr(torch, cfg.dtype)
        mods = build_modules(spec, device="meta")
        model = argparse.Namespace(spec=spec, llm=mods["llm"].to(dtype), flow=mods["flow"].to(dtype),
                                   hift=mods["hift"].to(torch.float32))
        limits = replica_limits(cfg, model, dtype_bytes=torch.finfo(dtype).bits // 8)
    except (CosyVoiceError, ValueError, OSError) as exc:
        logger.debug("no TensorRT profile requirement: %s", exc)
        return None
    return derive_profile(spec, limits).to_dict()


def probe_voice_store(env: Environment, voices_dir: str | None, family: str | None) -> None:
    """Where the frontend keeps voices (the replica's rule: ``frontend.voices_dir``, else
    ``$FAST_COSY_HOME/voices/<family>``) and whether it accepts writes. A store not created yet is
    judged by its nearest existing parent (the replica creates it)."""
    from deployments import constants

    default = constants.default_voices_dir()
    path = Path(voices_dir).expanduser() if voices_dir else (default / family if family else default)
    env.voices_dir = path
    env.voices_dir_problem = _store_problem(path)


def _store_problem(path: Path) -> str | None:
    """Why a store directory refuses writes (None: it accepts them); one not created yet is
    judged by its nearest existing parent (the replica creates it)."""
    from cosyvoice_runtime.frontend.atomic_files import probe_writable

    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    return probe_writable(existing)


def probe_pronunciation_store(env: Environment, pronunciation_dir: str | None) -> None:
    """Where the frontend keeps pronunciation dictionaries (``frontend.pronunciation.dir``, else
    ``$FAST_COSY_HOME/pronunciation``) and whether it accepts writes."""
    from deployments import constants

    path = Path(pronunciation_dir).expanduser() if pronunciation_dir else constants.default_pronunciation_dir()
    env.pronunciation_dir, env.pronunciation_dir_problem = path, _store_problem(path)


def probe_environment(args: argparse.Namespace) -> Environment:
    """Facts of this machine plus what the config and flags ask for."""
    from deployments import constants

    env = Environment(verify_checksums=not args.no_checksums, ray_address=args.ray_address, ray_probe=probe_ray)
    synth = None
    voices_dir, family, pronunciation_dir = None, None, None
    model_dir = args.model_dir
    if args.config:
        env.config_path = str(args.config)
        try:
            from fastcosy_cli.common import load_serve_config

            cfg = load_serve_config(args.config).args
            synth = cfg.synthesizer
            model_dir = model_dir or synth.model_dir or cfg.frontend.model_dir or cfg.model_dir
            env.tiny_allowed = cfg.tiny_family is not None
            voices_dir, family = cfg.frontend.voices_dir, cfg.tiny_family
            pronunciation_dir = cfg.frontend.pronunciation.dir
        except CliError as exc:
            env.config_error = str(exc)
        except ImportError as exc:
            env.config_error = f"the serving stack does not import ({exc}); install the project first"
    model_dir = model_dir or constants.model_dir_override()
    env.model_dir = Path(model_dir).expanduser() if model_dir else None
    probe_voice_store(env, voices_dir, (detect_family(env.model_dir) if env.model_dir else None) or family)
    probe_pronunciation_store(env, pronunciation_dir)
    from cosyvoice_runtime.modes import resolve_mode  # the replica's rule: config wins, then the env

    try:
        env.mode = args.mode or resolve_mode(synth.mode if synth else None, constants.mode_override())[0]
    except ValueError as exc:  # a bad $FAST_COSY_MODE: the replica would refuse to start too
        env.config_error, env.mode = str(exc), "pytorch"
    env.device = args.device or constants.device_override() or (synth.device if synth else "auto")
    plan_dir = args.plan_dir or (synth.trt_plan_dir if synth else None)
    env.engine_cache_dir = Path(plan_dir).expanduser() if plan_dir else None
    num_gpus = synth.resources.num_gpus if synth else 0
    env.needs_gpu = env.device.startswith("cuda") or num_gpus > 0 or env.mode == "trt"
    env.max_mem_gb = args.max_mem_gb if args.max_mem_gb is not None else getattr(synth, "max_mem_gb", None)
    env.driver_version, env.driver_cuda_version, gpus = probe_nvidia_smi()
    env.gpus = tuple(gpus)
    probe_torch(env)
    probe_tensorrt(env)
    probe_wetext(env)
    if env.mode == "trt":
        env.trt_profile_needed = needed_trt_profile(env.model_dir, synth, env.max_mem_gb)
    if env.max_mem_gb is None:
        env.estimated_need_bytes = estimate_need_bytes(
            env.model_dir, synth.dtype if synth else "float32", synth.max_running if synth else 16,
            synth.max_model_len if synth else 2048, incremental_flow_budget(synth) if synth else 0)
    return env


# ---------------------------------------------------------------------------------- command
def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check this node can serve (driver/CUDA/torch arch, TensorRT, model files, "
                       "wetext, Ray, GPU memory); exit 1 when something blocks serving",
                       description="Each check prints ok/WARN/FAIL with the fix. Exit code 1 if any check fails.")
    p.add_argument("--config", help="serve config to check against (model_dir, mode, device, plan dir)")
    p.add_argument("--model-dir", help="model directory (overrides the config)")
    p.add_argument("--plan-dir", help="TensorRT plan directory (overrides synthesizer.trt_plan_dir)")
    p.add_argument("--mode", choices=["pytorch", "torchscript", "trt"],
                   help="synthesizer mode (overrides the config)")
    p.add_argument("--device", help="synthesizer device: auto | cpu | cuda | cuda:N (overrides the config)")
    p.add_argument("--ray-address", help="cluster to check: dashboard http://HEAD:8265, or HEAD:6379 / ray://HEAD:10001")
    p.add_argument("--max-mem-gb", type=float, help="GPU memory the synthesizer needs (default: estimated)")
    p.add_argument("--no-checksums", action="store_true", help="skip hashing model files against checksums.json")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace, environment: Environment | None = None) -> int:
    env = environment or probe_environment(args)
    results = run_checks(env)
    out(results_json(results) if args.json else format_report(results))
    return exit_code(results)
