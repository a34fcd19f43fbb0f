"""``fastcosy doctor``: independent checks of a serving node, each with the fix for a failure.

Every check is a pure function of an :class:`Environment` (facts probed from the machine by
:func:`fastcosy_cli.doctor.probe_environment`, or written by hand in tests) and returns
:class:`CheckResult` records ``(name, status, message, fix)``. Checks never raise: a check that
crashes is reported as a failure of that check only. A ``fail`` means serving with this
configuration will not work (exit code 1); a ``warn`` means it works but something is likely
wrong or slow.

This module imports only the standard library and the standard-library-only TensorRT plan
rule (:mod:`cosyvoice_runtime.trt.plan_key`, the one the replica's loader applies) at import
time, so that it runs on a bare GPU node before the serving stack is installed.
"""
from __future__ import annotations

import enum
import json
import re
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from cosyvoice_runtime.trt.plan_key import (
    FLOW_CHECKPOINT,
    PLAN_SUFFIX,
    EngineKey,
    plan_mismatches,
    read_sidecar,
    sha256_file,
)

GIB = 1024**3

# Project floors (pyproject.toml): torch>=2.6, the [trt] extra tensorrt>=10.13, wetext>=0.0.7
# (0.0.4, which CosyVoice pins, downloads its FSTs from ModelScope at construction).
MIN_TORCH = (2, 6)
MIN_TENSORRT = (10, 13)
MIN_WETEXT = (0, 0, 7)

# First CUDA toolkit that can compile for a compute capability, and the first torch release with
# wheels for that toolkit. Used to phrase the fix of a "no kernel image is available" failure.
_MIN_CUDA_FOR_ARCH = {(12, 0): (12, 8), (10, 0): (12, 8), (9, 0): (11, 8), (8, 9): (11, 8), (8, 6): (11, 1),
                      (8, 0): (11, 0), (7, 5): (10, 0), (7, 0): (9, 0)}
_MIN_TORCH_FOR_CUDA = {(12, 8): "2.7", (12, 6): "2.6", (12, 4): "2.4", (12, 1): "2.1", (11, 8): "2.0"}
# Oldest Linux driver per CUDA toolkit (CUDA release notes, table 3 "toolkit driver version").
_MIN_DRIVER_FOR_CUDA = {(13, 0): "580.65", (12, 9): "575.51", (12, 8): "570.26", (12, 6): "560.28",
                        (12, 4): "550.54", (12, 2): "535.54", (12, 1): "530.30", (12, 0): "525.60",
                        (11, 8): "520.61"}

# Official file set per family (design spec §8.1); paths relative to the model directory.
_COMMON_REQUIRED = ("llm.pt", "flow.pt", "hift.pt", "campplus.onnx", "CosyVoice-BlankEN/config.json",
                    "CosyVoice-BlankEN/tokenizer_config.json")
REQUIRED_FILES = {
    "cosyvoice2": ("cosyvoice2.yaml", *_COMMON_REQUIRED, "speech_tokenizer_v2.onnx"),
    "cosyvoice3": ("cosyvoice3.yaml", *_COMMON_REQUIRED, "speech_tokenizer_v3.onnx"),
}
# The tokenizer is either the slow pair or a fast tokenizer.json (both appear in the wild).
_TOKENIZER_ALTERNATIVES = (("CosyVoice-BlankEN/vocab.json", "CosyVoice-BlankEN/merges.txt"),
                           ("CosyVoice-BlankEN/tokenizer.json",))
CHECKSUMS_FILE = "checksums.json"
# ONNX files are parsed (catches truncation) only up to this size; larger ones are size-checked.
_ONNX_PARSE_LIMIT_BYTES = 64 * 1024**2


class Status(str, enum.Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True)
class CheckResult:
    """One finding. ``fix`` says what to do; it is empty for ``ok`` results."""

    name: str
    status: Status
    message: str
    fix: str = ""


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU. ``capability`` is (major, minor), e.g. (12, 0) for an RTX 5090."""

    index: int
    name: str
    capability: tuple[int, int] | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None


@dataclass
class Environment:
    """Facts a check may read. Everything has a "not present" default so tests state only what
    they need. Paths are real paths (model files are read by the model checks).

    Attributes:
        torch_version: ``torch.__version__`` or None when torch does not import.
        torch_cuda_version: ``torch.version.cuda`` ("12.8"), None for a CPU build.
        torch_arch_list: ``torch.cuda.get_arch_list()`` ("sm_90", "compute_90", ...).
        cuda_available / cuda_error: ``torch.cuda.is_available()`` and the init error if any.
        driver_version / driver_cuda_version: from ``nvidia-smi`` (the driver's highest CUDA).
        tensorrt_version / tensorrt_error: ``tensorrt.__version__`` or the import error.
        wetext_version / wetext_fst_dir: the installed wetext and its bundled FST folder.
        model_dir: the configured model directory (None: the tiny random-weight model if
            ``tiny_allowed``, else the replicas refuse to start).
        tiny_allowed: the config asks for the tiny model (``tiny_family``) or no config is given.
        engine_cache_dir: where TensorRT plans are read from (``synthesizer.trt_plan_dir``).
        trt_profile_needed: the estimator profile the replica will ask its plans to cover
            (``{"rows": (min, opt, max), "frames": (...), "n_mels": n, "spk_dim": n}``, from the
            model spec and the synthesizer limits); None: coverage is not checked.
        ray_address / ray_probe: cluster address to check and the function that checks it
            (returns None when reachable, else the error text).
        mode / device / needs_gpu: synthesizer execution mode and device, and whether the
            configuration cannot run without a GPU.
        max_mem_gb: GPU memory the synthesizer is allowed/expected to use; None: estimated.
        estimated_need_bytes: the probe's estimate (weights + KV cache) when max_mem_gb is None.
        config_path / config_error: the serve config and its validation error, if any.
        verify_checksums: hash the model files against ``checksums.json`` (slow for real models).
    """

    torch_version: str | None = None
    torch_cuda_version: str | None = None
    torch_arch_list: tuple[str, ...] = ()
    cuda_available: bool = False
    cuda_error: str | None = None
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str | None = None
    driver_cuda_version: str | None = None
    tensorrt_version: str | None = None
    tensorrt_error: str | None = None
    wetext_version: str | None = None
    wetext_fst_dir: Path | None = None
    model_dir: Path | None = None
    tiny_allowed: bool = True
    engine_cache_dir: Path | None = None
    trt_profile_needed: dict | None = None
    ray_address: str | None = None
    ray_probe: Callable[[str], str | None] | None = None
    mode: str = "pytorch"
    device: str = "auto"
    needs_gpu: bool = False
    max_mem_gb: float | None = None
    estimated_need_bytes: int | None = None
    config_path: str | None = None
    config_error: str | None = None
    verify_checksums: bool = True
    extra: dict = field(default_factory=dict)

    def device_index(self) -> int:
        """GPU index the synthesizer will use (``cuda:N`` -> N, otherwise 0)."""
        m = re.fullmatch(r"cuda:(\d+)", self.device or "")
        return int(m.group(1)) if m else 0


# ------------------------------------------------------------------------------------ helpers
def parse_version(text: str | None) -> tuple[int, ...]:
    """Leading numeric components: "2.7.1+cu128" -> (2, 7, 1); None/garbage -> ()."""
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in v)


def _sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def arch_support(arch_list: Iterable[str], cap: tuple[int, int]) -> str | None:
    """How torch's kernels reach a GPU of capability ``cap``: "native", "ptx" or None.

    A cubin for sm_XY runs on devices of the same major version with minor >= Y (arch-specific
    variants such as sm_90a only on exactly that arch); PTX (compute_XY) is JIT-compiled for
    any newer device, slowly, on first use.
    """
    ptx = False
    for entry in arch_list:
        m = re.fullmatch(r"(sm|compute)_(\d+?)(\d)([af]?)", entry.strip())
        if not m:
            continue
        kind, major, minor, suffix = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if kind == "sm":
            if (suffix and (major, minor) == cap) or (not suffix and major == cap[0] and minor <= cap[1]):
                return "native"
        elif (major, minor) <= cap:
            ptx = True
    return "ptx" if ptx else None


def _min_cuda_for(cap: tuple[int, int]) -> tuple[int, int] | None:
    known = [c for c in _MIN_CUDA_FOR_ARCH if c <= cap]
    return _MIN_CUDA_FOR_ARCH[max(known)] if known else None


def _torch_for_cuda(cuda: tuple[int, int]) -> str:
    known = [c for c in _MIN_TORCH_FOR_CUDA if c <= cuda]
    return _MIN_TORCH_FOR_CUDA[max(known)] if known else "a recent release"


def _driver_for_cuda(cuda: tuple[int, ...]) -> str | None:
    return _MIN_DRIVER_FOR_CUDA.get(tuple(cuda[:2]))


# ------------------------------------------------------------------------------------- checks
def check_config(env: Environment) -> CheckResult:
    if env.config_path is None:
        return CheckResult("config", Status.OK, "no serve config given (defaults assumed)")
    if env.config_error:
        return CheckResult("config", Status.FAIL, f"{env.config_path} does not validate: {env.config_error}",
                           "fix the key named in the message; every level of the config forbids unknown keys "
                           "(docs/configuration.md lists them)")
    return CheckResult("config", Status.OK, f"{env.config_path} validates")


def check_torch(env: Environment) -> CheckResult:
    if env.torch_version is None:
        return CheckResult("torch", Status.FAIL, "torch does not import",
                           f"install torch >= {_fmt(MIN_TORCH)} (a CUDA build on GPU nodes) before the project")
    if parse_version(env.torch_version)[:2] < MIN_TORCH:
        return CheckResult("torch", Status.FAIL, f"torch {env.torch_version} is older than {_fmt(MIN_TORCH)}",
                           f"install torch >= {_fmt(MIN_TORCH)}")
    build = f"CUDA {env.torch_cuda_version}" if env.torch_cuda_version else "CPU-only build"
    return CheckResult("torch", Status.OK, f"torch {env.torch_version} ({build})")


def check_gpu(env: Environment) -> CheckResult:
    if env.cuda_available and env.gpus:
        names = ", ".join(f"{g.index}: {g.name} ({_sm(g.capability) if g.capability else '?'})" for g in env.gpus)
        return CheckResult("gpu", Status.OK, f"{len(env.gpus)} GPU(s) visible: {names}")
    status = Status.FAIL if env.needs_gpu else Status.OK
    why = "the configuration needs a GPU" if env.needs_gpu else "serving on CPU (fine for the tiny model)"
    if env.torch_version and not env.torch_cuda_version:
        if env.driver_version:
            fix = "install a CUDA build of torch (this one is CPU-only) matching the driver's CUDA version"
        else:
            fix = "on a GPU node: install the NVIDIA driver and a CUDA build of torch"
        return CheckResult("gpu", status, f"no GPU usable: torch is a CPU-only build; {why}",
                           fix if env.needs_gpu else "")
    if env.driver_version is None:
        return CheckResult("gpu", status, f"no NVIDIA driver found (nvidia-smi missing or failing); {why}",
                           "install the NVIDIA driver; in a container run with the NVIDIA container toolkit "
                           "(docker run --gpus all / a pod requesting nvidia.com/gpu)" if env.needs_gpu else "")
    detail = f": {env.cuda_error}" if env.cuda_error else ""
    return CheckResult("gpu", status, f"the driver is present but torch sees no GPU{detail}; {why}",
                       "check CUDA_VISIBLE_DEVICES and that the driver's CUDA version is >= torch's "
                       "(see the 'driver' check)" if env.needs_gpu else "")


def check_driver(env: Environment) -> CheckResult:
    if env.driver_version is None or not env.torch_cuda_version:
        return CheckResult("driver", Status.OK, "skipped (no NVIDIA driver or CPU-only torch)")
    have, want = parse_version(env.driver_cuda_version), parse_version(env.torch_cuda_version)[:2]
    if not have:
        return CheckResult("driver", Status.WARN, f"driver {env.driver_version}: its CUDA version is unknown",
                           "run nvidia-smi and compare its 'CUDA Version' with torch's " + env.torch_cuda_version)
    driver_min = _driver_for_cuda(want)
    upgrade = f"upgrade the NVIDIA driver to >= {driver_min} (CUDA {_fmt(want)})" if driver_min else \
        f"upgrade the NVIDIA driver to one supporting CUDA {_fmt(want)}"
    msg = f"driver {env.driver_version} supports CUDA {_fmt(have)}; torch is built for CUDA {_fmt(want)}"
    if have[0] < want[0]:
        return CheckResult("driver", Status.FAIL, msg + ": CUDA fails to initialise",
                           f"{upgrade}, or install a torch build for CUDA <= {_fmt(have)}")
    if have[:2] < want:
        return CheckResult("driver", Status.WARN, msg + " (minor-version compatibility: runs, but PTX JIT and "
                           "newer runtime features are unavailable)", upgrade)
    return CheckResult("driver", Status.OK, msg)


def check_gpu_arch(env: Environment) -> list[CheckResult]:
    if not env.gpus or not env.torch_cuda_version:
        return [CheckResult("gpu_arch", Status.OK, "skipped (no GPU or CPU-only torch)")]
    arch = ", ".join(env.torch_arch_list) or "none"
    out = []
    for g in env.gpus:
        if g.capability is None:
            out.append(CheckResult("gpu_arch", Status.WARN, f"GPU {g.index} ({g.name}): compute capability unknown",
                                   "compare `nvidia-smi --query-gpu=compute_cap --format=csv` with "
                                   "torch.cuda.get_arch_list()"))
            continue
        how = arch_support(env.torch_arch_list, g.capability)
        head = f"GPU {g.index} ({g.name}) is {_sm(g.capability)}"
        if how == "native":
            out.append(CheckResult("gpu_arch", Status.OK, f"{head}; torch has kernels for it"))
        elif how == "ptx":
            out.append(CheckResult("gpu_arch", Status.WARN, f"{head}; torch ships only PTX for it (arch list: "
                                   f"{arch}): kernels are JIT-compiled on first use, slow start",
                                   f"install a torch build that lists {_sm(g.capability)} in its arch list"))
        else:
            cuda = _min_cuda_for(g.capability)
            fix = (f"install torch >= {_torch_for_cuda(cuda)} built with CUDA {_fmt(cuda)} (or newer), and update "
                   f"the driver if the 'driver' check asks for it" if cuda else
                   f"install a torch build whose arch list includes {_sm(g.capability)}")
            out.append(CheckResult("gpu_arch", Status.FAIL,
                                   f"{head}, missing from torch {env.torch_version}'s arch list ({arch}): CUDA "
                                   f"calls fail with 'no kernel image is available for execution on the device'",
                                   fix))
    return out


def check_tensorrt(env: Environment) -> CheckResult:
    needed = env.mode == "trt"
    if env.tensorrt_version is None:
        if not needed:
            return CheckResult("tensorrt", Status.OK, "not installed (only needed for synthesizer.mode: trt)")
        return CheckResult("tensorrt", Status.FAIL, f"synthesizer.mode is trt but tensorrt does not import"
                           f"{': ' + env.tensorrt_error if env.tensorrt_error else ''}",
                           f"install the [trt] extra (tensorrt >= {_fmt(MIN_TENSORRT)}; its libraries come from "
                           "NVIDIA's package index, not PyPI alone), or set synthesizer.mode: pytorch")
    if parse_version(env.tensorrt_version)[:2] < MIN_TENSORRT:
        status = Status.FAIL if needed else Status.WARN
        return CheckResult("tensorrt", status, f"TensorRT {env.tensorrt_version} is older than {_fmt(MIN_TENSORRT)}",
                           f"install tensorrt >= {_fmt(MIN_TENSORRT)} and rebuild the plans")
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


def detect_family(model_dir: Path) -> str | None:
    found = [f for f, files in REQUIRED_FILES.items() if (model_dir / files[0]).exists()]
    return found[0] if len(found) == 1 else None


def check_model_dir(env: Environment) -> CheckResult:
    d = env.model_dir
    if d is None and not env.tiny_allowed:
        return CheckResult("model_dir", Status.FAIL, "no model directory configured and the config does not ask for "
                           "the tiny model: the replicas will refuse to start",
                           "set model_dir in the config (or $FAST_COSY_MODEL_DIR) to an official CosyVoice2-0.5B / "
                           "Fun-CosyVoice3-0.5B directory, or tiny_family for the random-weight test model")
    if d is None:
        return CheckResult("model_dir", Status.WARN, "no model directory configured: the tiny RANDOM-WEIGHT model is "
                           "served (valid audio, not speech)",
                           "set model_dir in the config (or $FAST_COSY_MODEL_DIR) to an official CosyVoice2-0.5B / "
                           "Fun-CosyVoice3-0.5B directory")
    if not d.is_dir():
        return CheckResult("model_dir", Status.FAIL, f"model directory {d} does not exist",
                           "download the model there or fix model_dir (it is resolved on each replica's node)")
    if (d / "cosyvoice.yaml").exists() and detect_family(d) is None:
        return CheckResult("model_dir", Status.FAIL, f"{d} is a CosyVoice v1 (300M) directory, which is not supported",
                           "use CosyVoice2-0.5B or Fun-CosyVoice3-0.5B")
    family = detect_family(d)
    if family is None:
        return CheckResult("model_dir", Status.FAIL, f"{d} has neither or both of cosyvoice2.yaml / cosyvoice3.yaml",
                           "point model_dir at one official model directory (the yaml name selects the family)")
    missing = [f for f in REQUIRED_FILES[family] if not (d / f).is_file()]
    if not any(all((d / f).is_file() for f in alt) for alt in _TOKENIZER_ALTERNATIVES):
        missing.append("CosyVoice-BlankEN/vocab.json + merges.txt (or tokenizer.json)")
    if missing:
        return CheckResult("model_dir", Status.FAIL, f"{family} directory {d} is missing: {', '.join(missing)}",
                           "re-download the model directory (docs/troubleshooting.md lists the official file set)")
    # No flow.decoder.estimator.fp32.onnx needed: fastcosy build-trt exports the estimator from flow.pt.
    return CheckResult("model_dir", Status.OK, f"{family} file set complete in {d}")


def _file_problem(path: Path) -> str | None:
    """Why a model file cannot load (cheap structural checks), or None."""
    size = path.stat().st_size
    if size == 0:
        return "empty"
    if path.suffix == ".pt":
        # torch.save writes a zip archive; a truncated download loses its central directory.
        try:
            with zipfile.ZipFile(path) as zf:
                zf.namelist()
        except zipfile.BadZipFile:
            return "not a readable torch archive (truncated or corrupt download)"
    elif path.suffix == ".json":
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            return "not valid JSON"
    elif path.suffix == ".onnx" and size <= _ONNX_PARSE_LIMIT_BYTES:
        try:
            import onnx

            onnx.load_model(str(path), load_external_data=False)
        except ImportError:
            return None
        except Exception as exc:  # noqa: BLE001 - protobuf DecodeError and friends
            return f"does not parse as ONNX ({type(exc).__name__})"
    return None


def check_model_files(env: Environment) -> CheckResult:
    d = env.model_dir
    family = detect_family(d) if d is not None and d.is_dir() else None
    if family is None:
        return CheckResult("model_files", Status.OK, "skipped (no complete model directory)")
    sums_path = d / CHECKSUMS_FILE
    bad: list[str] = []
    if sums_path.is_file():
        try:
            sums = json.loads(sums_path.read_text())
        except ValueError:
            return CheckResult("model_files", Status.FAIL, f"{sums_path} is not valid JSON",
                               "restore it from the model's source, or delete it to fall back to structural checks")
        if not env.verify_checksums:
            return CheckResult("model_files", Status.OK, f"{len(sums)} files listed in {CHECKSUMS_FILE}; "
                               "hashes not verified (--no-checksums)")
        for rel, digest in sorted(sums.items()):
            p = d / rel
            if not p.is_file():
                bad.append(f"{rel} (missing)")
            elif sha256_file(p) != digest:
                bad.append(f"{rel} (checksum mismatch)")
        what = f"{len(sums)} files match {CHECKSUMS_FILE}"
    else:
        files = [*REQUIRED_FILES[family], *(f for alt in _TOKENIZER_ALTERNATIVES for f in alt)]
        for rel in files:
            p = d / rel
            if p.is_file() and (why := _file_problem(p)):
                bad.append(f"{rel} ({why})")
        what = f"model files non-empty and structurally readable (no {CHECKSUMS_FILE} to compare against)"
    if bad:
        return CheckResult("model_files", Status.FAIL, f"damaged model files in {d}: {', '.join(bad)}",
                           "re-download the named files (a partial download is the usual cause)")
    return CheckResult("model_files", Status.OK, what)


def check_wetext(env: Environment) -> CheckResult:
    fix = "pip install wetext==0.1.8 (bundles its grammars; 0.0.4 downloads them from ModelScope at start-up)"
    if env.wetext_version is None:
        return CheckResult("wetext", Status.FAIL, "wetext (text normalisation) does not import", fix)
    if parse_version(env.wetext_version) < MIN_WETEXT:
        return CheckResult("wetext", Status.FAIL, f"wetext {env.wetext_version} fetches its FSTs over the network "
                           "when the normaliser is built (fails offline)", fix)
    fst = env.wetext_fst_dir
    needed = ("en/tn/tagger.fst", "en/tn/verbalizer.fst", "zh/tn/tagger.fst", "zh/tn/verbalizer.fst")
    missing = [n for n in needed if fst is None or not (fst / n).is_file()]
    if missing:
        return CheckResult("wetext", Status.FAIL, f"wetext {env.wetext_version} grammars missing in {fst}: "
                           f"{', '.join(missing)}", "reinstall it: pip install --force-reinstall wetext==0.1.8")
    return CheckResult("wetext", Status.OK, f"wetext {env.wetext_version}, grammars in {fst}")


def check_ray(env: Environment) -> CheckResult:
    if not env.ray_address:
        return CheckResult("ray", Status.OK, "local mode (fastcosy serve starts its own Ray); "
                           "pass --ray-address to check a cluster")
    if env.ray_probe is None:
        return CheckResult("ray", Status.WARN, f"cannot probe {env.ray_address} (no probe)", "")
    error = env.ray_probe(env.ray_address)
    if error is None:
        return CheckResult("ray", Status.OK, f"Ray cluster reachable at {env.ray_address}")
    return CheckResult("ray", Status.FAIL, f"Ray cluster not reachable at {env.ray_address}: {error}",
                       "deploy needs the dashboard address (http://<head>:8265; port-forward svc/<name>-head-svc "
                       "8265 on Kubernetes); check the head pod is running and, with token auth on (Ray 2.60 "
                       "default), that RAY_AUTH_TOKEN or ~/.ray/auth_token is set")


def check_gpu_memory(env: Environment) -> CheckResult:
    if not env.gpus or not env.cuda_available:
        return CheckResult("gpu_memory", Status.OK, "skipped (no GPU)")
    idx = env.device_index()
    gpu = next((g for g in env.gpus if g.index == idx), None)
    if gpu is None:
        return CheckResult("gpu_memory", Status.FAIL, f"synthesizer.device {env.device} names GPU {idx}, "
                           f"which is not visible ({len(env.gpus)} visible)",
                           "fix synthesizer.device or CUDA_VISIBLE_DEVICES")
    if gpu.free_bytes is None:
        return CheckResult("gpu_memory", Status.WARN, f"GPU {idx}: free memory unknown", "check nvidia-smi")
    if env.max_mem_gb is not None:
        need, source = int(env.max_mem_gb * GIB), f"max_mem_gb {env.max_mem_gb:g}"
    elif env.estimated_need_bytes is not None:
        need, source = env.estimated_need_bytes, "estimate: weights + KV cache"
    else:
        return CheckResult("gpu_memory", Status.OK, f"GPU {idx}: {gpu.free_bytes / GIB:.1f} GiB free "
                           "(no max_mem_gb or estimate to compare with)")
    msg = f"GPU {idx}: {gpu.free_bytes / GIB:.1f} GiB free, synthesizer needs {need / GIB:.1f} GiB ({source})"
    fix = ("free the GPU (nvidia-smi lists the processes holding it), lower max_running / max_model_len, "
           "use dtype bfloat16, or put fewer replicas on this GPU (resources.num_gpus)")
    if gpu.free_bytes < need:
        return CheckResult("gpu_memory", Status.FAIL, msg, fix)
    if gpu.free_bytes < need * 1.2:
        return CheckResult("gpu_memory", Status.WARN, msg + " (under 20% headroom: fragmentation can still OOM)", fix)
    return CheckResult("gpu_memory", Status.OK, msg)


CHECKS: tuple[Callable[[Environment], CheckResult | list[CheckResult]], ...] = (
    check_config, check_torch, check_gpu, check_driver, check_gpu_arch, check_tensorrt,
    check_engine_cache, check_model_dir, check_model_files, check_wetext, check_ray, check_gpu_memory,
)


def run_checks(env: Environment, checks=CHECKS) -> list[CheckResult]:
    """Run every check; a check that raises becomes a failure of that check alone."""
    results: list[CheckResult] = []
    for check in checks:
        name = check.__name__.removeprefix("check_")
        try:
            out = check(env)
        except Exception as exc:  # noqa: BLE001 - a broken check must not hide the others
            out = CheckResult(name, Status.FAIL, f"check crashed: {type(exc).__name__}: {exc}",
                              "report this as a bug in fastcosy doctor")
        results.extend(out if isinstance(out, list) else [out])
    return results


def exit_code(results: Iterable[CheckResult]) -> int:
    """1 when any check failed (something blocks serving), else 0."""
    return 1 if any(r.status is Status.FAIL for r in results) else 0


def format_report(results: list[CheckResult]) -> str:
    tags = {Status.OK: "  ok", Status.WARN: "WARN", Status.FAIL: "FAIL"}
    lines = []
    for r in results:
        lines.append(f"[{tags[r.status]}] {r.name}: {r.message}")
        if r.fix and r.status is not Status.OK:
            lines.append(f"       fix: {r.fix}")
    fails = sum(r.status is Status.FAIL for r in results)
    warns = sum(r.status is Status.WARN for r in results)
    lines.append(f"{fails} failed, {warns} warnings, {len(results) - fails - warns} ok"
                 + ("  -> serving is blocked" if fails else ""))
    return "\n".join(lines)


def results_json(results: list[CheckResult]) -> str:
    return json.dumps([{"name": r.name, "status": r.status.value, "message": r.message, "fix": r.fix}
                       for r in results], indent=1)
