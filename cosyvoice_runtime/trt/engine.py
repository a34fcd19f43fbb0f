"""TensorRT flow estimator for replicas: plan lookup by cache key, context pool, estimator signature.

Plans are built offline (``fastcosy build-trt`` / ``python -m cosyvoice_runtime.trt.build``)
and are specific to the GPU architecture and the TensorRT version; a replica only loads a
plan whose ``<plan>.json`` sidecar names this GPU's compute capability and this TensorRT (the
rule, shared with ``fastcosy doctor``: :mod:`cosyvoice_runtime.trt.plan_key`), and otherwise
fails at start-up pointing to the build command (never a lazy build, spec §9.4).

:class:`TrtEstimator` has the torch estimator's call signature
``(x, mask, mu, t, spks, cond, streaming) -> (rows, 80, T)`` and swaps into
``flow.decoder.estimator``. One engine per attention pattern (``full``; ``chunk`` = the
streaming chunk masks baked in at export); a batch mixing both is split by rows (the estimator
is row-independent). Each call checks an execution context out of a blocking pool, so at most
``pool_size`` calls run at once and each has its own activation memory and CUDA stream.

``tensorrt`` and CUDA are imported inside the functions that need them.
"""
from __future__ import annotations

import importlib.util
import logging
import queue
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cosyvoice_runtime.errors import InvalidInputError, ModelLoadError
from cosyvoice_runtime.trt.plan_key import PLAN_SUFFIX, EngineKey, plan_mismatches, read_sidecar, sha256_file
from cosyvoice_runtime.trt.profiles import EstimatorProfile

logger = logging.getLogger(__name__)

BUILD_HINT = ("build plans on a node with this GPU and TensorRT: fastcosy build-trt --model-dir <model> "
              "--out <trt_plan_dir> [--fp16] [--max-batch N]")


# ------------------------------------------------------------------------------- plan lookup
@dataclass(frozen=True)
class PlanInfo:
    path: Path
    key: EngineKey
    profile: EstimatorProfile
    meta: dict


def read_plans(plan_dir: str | Path) -> tuple[list[PlanInfo], list[str]]:
    """Plans with a usable sidecar (:func:`~cosyvoice_runtime.trt.plan_key.read_sidecar`), and one
    line per file that could not be used."""
    found, skipped = [], []
    for plan in sorted(Path(plan_dir).glob(f"*{PLAN_SUFFIX}")):
        meta, unusable = read_sidecar(plan)
        if meta is None:
            skipped.append(f"{plan.name}: {unusable}")
            continue
        found.append(PlanInfo(plan, EngineKey.from_sidecar(meta), EstimatorProfile.from_dict(meta["profile"]), meta))
    return found, skipped


def select_plans(plans: list[PlanInfo], *, compute_capability: str, tensorrt_version: str,
                 profile: EstimatorProfile | None = None, precision: str | None = None,
                 flow_sha256: str | None = None) -> tuple[dict[str, PlanInfo], list[str]]:
    """Per attention pattern, the plan to load on this GPU; and why every other plan was rejected.

    A plan must match the GPU's compute capability, the TensorRT version, the precision (when
    given) and the flow checkpoint it was exported from (when both record it), and its profile
    must cover ``profile`` (the replica's largest batch and call). The exact profile is
    preferred, then fp16, then the largest profile.
    """
    chosen: dict[str, PlanInfo] = {}
    rejected: list[str] = []
    for p in plans:
        why = plan_mismatches(p.key, p.profile.to_dict(), p.meta.get("flow_sha256"),
                              compute_capability=compute_capability, tensorrt_version=tensorrt_version,
                              precision=precision, needed=profile.to_dict() if profile is not None else None,
                              flow_sha256=flow_sha256)
        if why:
            rejected.append(f"{p.path.name}: " + "; ".join(why))
            continue

        def rank(q: PlanInfo) -> tuple:
            exact = profile is not None and q.key.profile_hash == profile.digest()
            return (exact, q.key.precision == "fp16", q.profile.rows[2] * q.profile.frames[2])

        if p.key.attention not in chosen or rank(p) > rank(chosen[p.key.attention]):
            chosen[p.key.attention] = p
    return chosen, rejected


# ---------------------------------------------------------------------------- tensorrt runtime
def tensorrt_version(purpose: str = "synthesizer mode 'trt'") -> str:
    """The installed TensorRT version; ModelLoadError if it does not import (at start-up)."""
    if importlib.util.find_spec("tensorrt") is None:
        raise ModelLoadError("tensorrt", f"{purpose} needs TensorRT, which is not installed: install the [trt] extra "
                             "(tensorrt>=10.13; its libraries come from NVIDIA's package index, not PyPI alone)"
                             + (" or serve with mode: pytorch / torchscript" if "mode" in purpose else ""))
    try:
        import tensorrt as trt
    except Exception as exc:  # a broken install raises anything from OSError to RuntimeError
        raise ModelLoadError("tensorrt", f"TensorRT is installed but does not import: {type(exc).__name__}: {exc}") from exc
    return str(trt.__version__)


def gpu_compute_capability(device: torch.device | str | None = None, purpose: str = "synthesizer mode 'trt'") -> str:
    if not torch.cuda.is_available():
        raise ModelLoadError("cuda", f"{purpose} needs a CUDA GPU; none is visible")
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}.{minor}"


class ContextPool:
    """Blocking pool of execution contexts: a call waits until a context is free."""

    def __init__(self, items: list) -> None:
        if not items:
            raise ValueError("a context pool needs at least one context")
        self.size = len(items)
        self._free: queue.Queue = queue.Queue()
        for item in items:
            self._free.put(item)

    @contextmanager
    def checkout(self, timeout: float | None = None):
        item = self._free.get(timeout=timeout)
        try:
            yield item
        finally:
            self._free.put(item)

    def available(self) -> int:
        return self._free.qsize()


class _TrtRunner:
    """One deserialised engine with ``pool_size`` contexts, each with its own CUDA stream."""

    def __init__(self, plan: PlanInfo, device: torch.device, pool_size: int) -> None:
        import tensorrt as trt

        self.plan = plan
        self.device = device
        self.profile = plan.profile
        trt_logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(trt_logger)
        self.engine = runtime.deserialize_cuda_engine(plan.path.read_bytes())
        if self.engine is None:
            raise ModelLoadError(plan.path, f"TensorRT could not deserialize the plan; {BUILD_HINT}")
        self.input_names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)
                            if self.engine.get_tensor_mode(self.engine.get_tensor_name(i)) == trt.TensorIOMode.INPUT]
        self.output_name = next(self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)
                                if self.engine.get_tensor_name(i) not in self.input_names)
        to_torch = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16}
        self.dtypes = {n: to_torch[self.engine.get_tensor_dtype(n)] for n in [*self.input_names, self.output_name]}
        with torch.cuda.device(device):
            contexts = [(self.engine.create_execution_context(), torch.cuda.Stream(device)) for _ in range(pool_size)]
        self.pool = ContextPool(contexts)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        x = inputs["x"]
        with self.pool.checkout() as (context, stream):
            current = torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            feeds = {n: inputs[n].to(self.dtypes[n]).contiguous() for n in self.input_names}
            out = torch.empty(x.shape, dtype=self.dtypes[self.output_name], device=x.device)
            for name, tensor in feeds.items():
                context.set_input_shape(name, tuple(tensor.shape))
                context.set_tensor_address(name, tensor.data_ptr())
            context.set_tensor_address(self.output_name, out.data_ptr())
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError(f"TensorRT execution failed ({self.plan.path.name}, shape {tuple(x.shape)})")
            for tensor in (*feeds.values(), out):
                tensor.record_stream(stream)  # keep buffers alive until the engine is done with them
            current.wait_stream(stream)
        return out


# ------------------------------------------------------------------------------- the estimator
Runner = Callable[[dict[str, torch.Tensor]], torch.Tensor]
INPUT_ORDER = ("x", "mask", "mu", "t", "spks", "cond")


class TrtEstimator(nn.Module):
    """Drop-in for ``flow.decoder.estimator`` backed by TensorRT engines (no parameters).

    Args:
        runners: attention pattern (``full`` / ``chunk``) -> callable on a dict of named inputs.
        profile: the shapes every runner accepts (rows are split into pieces of at most
            ``profile.rows[2]``; longer T is an input error).
    """

    def __init__(self, runners: dict[str, Runner], profile: EstimatorProfile) -> None:
        super().__init__()
        if "full" not in runners and "chunk" not in runners:
            raise ValueError("TrtEstimator needs a 'full' or a 'chunk' engine")
        self.runners = runners
        self.profile = profile
        self.fallback_warned = False

    def _runner(self, streaming: bool) -> Runner:
        want = "chunk" if streaming else "full"
        if want in self.runners:
            return self.runners[want]
        if not self.fallback_warned:  # the official TensorRT path always uses full attention (spec §4.8)
            logger.warning("no %s-attention TensorRT plan: using the %s one", want, next(iter(self.runners)))
            self.fallback_warned = True
        return next(iter(self.runners.values()))

    def _run(self, args: dict[str, torch.Tensor], streaming: bool) -> torch.Tensor:
        rows, frames = args["x"].shape[0], args["x"].shape[2]
        if frames > self.profile.frames[2] or frames < self.profile.frames[0]:
            raise InvalidInputError(f"flow call of {frames} mel frames is outside the TensorRT profile "
                                    f"[{self.profile.frames[0]}, {self.profile.frames[2]}]")
        runner = self._runner(streaming)
        step = self.profile.rows[2]
        if rows <= step:
            return runner(args)
        return torch.cat([runner({n: a[i:i + step] for n, a in args.items()}) for i in range(0, rows, step)])

    def forward(self, x, mask, mu, t, spks, cond, streaming: bool | torch.Tensor = False) -> torch.Tensor:
        args = dict(zip(INPUT_ORDER, (x, mask, mu, t, spks, cond)))
        if not isinstance(streaming, torch.Tensor):
            return self._run(args, bool(streaming)).to(x.dtype)
        flags = streaming.to(device=x.device, dtype=torch.bool).reshape(-1)
        if bool(flags.all()) or not bool(flags.any()):
            return self._run(args, bool(flags[0])).to(x.dtype)
        out = torch.empty_like(x)
        for value in (True, False):
            idx = torch.nonzero(flags == value).reshape(-1)
            out[idx] = self._run({n: a.index_select(0, idx) for n, a in args.items()}, value).to(x.dtype)
        return out


def load_trt_estimator(plan_dir: str | Path | None, profile: EstimatorProfile, *,
                       device: torch.device | str = "cuda", pool_size: int = 1,
                       precision: str | None = None, flow_checkpoint: str | Path | None = None) -> TrtEstimator:
    """The estimator of the plans in ``plan_dir`` that match this GPU and TensorRT (start-up only).

    Raises:
        ModelLoadError: TensorRT is missing, there is no GPU, or no plan matches (the message
            lists every plan and why it was rejected, and the build command).
    """
    version = tensorrt_version()
    if not plan_dir:
        raise ModelLoadError("trt_plan_dir", f"mode 'trt' needs trt_plan_dir; {BUILD_HINT}")
    root = Path(plan_dir).expanduser()
    if not root.is_dir():
        raise ModelLoadError(root, f"TensorRT plan directory does not exist; {BUILD_HINT}")
    device = torch.device(device)
    if device.type != "cuda":
        raise ModelLoadError("device", f"mode 'trt' runs the estimator on a CUDA device, the replica device is {device}")
    capability = gpu_compute_capability(device)
    plans, skipped = read_plans(root)
    flow_sha = sha256_file(flow_checkpoint) if flow_checkpoint else None
    chosen, rejected = select_plans(plans, compute_capability=capability, tensorrt_version=version,
                                    profile=profile, precision=precision, flow_sha256=flow_sha)
    if not chosen:
        lines = "\n  ".join(skipped + rejected) or "(no *.plan files)"
        raise ModelLoadError(root, f"no TensorRT plan for sm{capability} / TensorRT {version} covering flow batch "
                             f"{profile.max_flow_batch} x {profile.frames[2]} frames:\n  {lines}\n{BUILD_HINT}")
    runners = {att: _TrtRunner(p, device, pool_size) for att, p in chosen.items()}
    for att, p in chosen.items():
        logger.info("TensorRT %s-attention estimator: %s (%s, rows %s, frames %s, %d contexts)",
                    att, p.path.name, p.key.precision, p.profile.rows, p.profile.frames, pool_size)
    return TrtEstimator(runners, profile)  # every chosen plan covers the replica's profile
