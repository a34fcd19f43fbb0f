"""``fastcosy doctor``'s checks of the node itself: the serve config, torch, the GPU, its driver
and architecture, wetext, the Ray cluster and free GPU memory."""
from __future__ import annotations

import re
from collections.abc import Iterable

from fastcosy_cli.doctor_results import GIB, CheckResult, Environment, Status, parse_version, version_text

# Project floors (pyproject.toml): torch>=2.6, wetext>=0.0.7 (0.0.4, which CosyVoice pins,
# downloads its FSTs from ModelScope at construction).
MIN_TORCH = (2, 6)
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
                           f"install torch >= {version_text(MIN_TORCH)} (a CUDA build on GPU nodes) before the project")
    if parse_version(env.torch_version)[:2] < MIN_TORCH:
        return CheckResult("torch", Status.FAIL, f"torch {env.torch_version} is older than {version_text(MIN_TORCH)}",
                           f"install torch >= {version_text(MIN_TORCH)}")
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
    upgrade = f"upgrade the NVIDIA driver to >= {driver_min} (CUDA {version_text(want)})" if driver_min else \
        f"upgrade the NVIDIA driver to one supporting CUDA {version_text(want)}"
    msg = f"driver {env.driver_version} supports CUDA {version_text(have)}; torch is built for CUDA {version_text(want)}"
    if have[0] < want[0]:
        return CheckResult("driver", Status.FAIL, msg + ": CUDA fails to initialise",
                           f"{upgrade}, or install a torch build for CUDA <= {version_text(have)}")
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
            fix = (f"install torch >= {_torch_for_cuda(cuda)} built with CUDA {version_text(cuda)} (or newer), and update "
                   f"the driver if the 'driver' check asks for it" if cuda else
                   f"install a torch build whose arch list includes {_sm(g.capability)}")
            out.append(CheckResult("gpu_arch", Status.FAIL,
                                   f"{head}, missing from torch {env.torch_version}'s arch list ({arch}): CUDA "
                                   f"calls fail with 'no kernel image is available for execution on the device'",
                                   fix))
    return out


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
        need, source = env.estimated_need_bytes, "estimate: weights + KV cache (+ flow cache budget)"
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


def _store_check(name: str, what: str, path, problem: str | None, refused: str, key: str) -> CheckResult:
    """A frontend store (``what`` at ``path``) must accept writes; ``refused``: the calls that answer
    503 when it does not; ``key``: the config key that moves it."""
    if path is None:
        return CheckResult(name, Status.OK, f"skipped (no {what} resolved)")
    if problem is None:
        return CheckResult(name, Status.OK, f"{what} {path} is writable")
    return CheckResult(name, Status.FAIL, f"{what} {path} is not writable ({problem}): {refused} will answer 503",
                       f"make {path} writable by the user running the frontend replicas (a read-write mount on "
                       f"every node), or set {key} to writable shared storage")


def check_voice_store(env: Environment) -> CheckResult:
    """The frontend's voice store must accept writes: a read-only one answers voice registration and
    deletion with 503 and makes /health say ``degraded`` (synthesis with stored voices still works)."""
    return _store_check("voice_store", "voice store", env.voices_dir, env.voices_dir_problem,
                        "POST and DELETE /v1/voices", "frontend.voices_dir")


def check_pronunciation_store(env: Environment) -> CheckResult:
    """The frontend's pronunciation dictionary store must accept writes: a read-only one answers
    dictionary changes with 503 and makes /health say ``degraded``."""
    return _store_check("pronunciation_store", "pronunciation store", env.pronunciation_dir,
                        env.pronunciation_dir_problem, "changes to /v1/pronunciation-dictionaries",
                        "frontend.pronunciation.dir")
