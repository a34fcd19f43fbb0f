"""What ``fastcosy doctor``'s checks read and return: the probed :class:`Environment`, the
:class:`CheckResult` records, and the report written from them. Standard library only."""
from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

GIB = 1024**3


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
        voices_dir / voices_dir_problem: the frontend's voice store and why it refuses writes
            (None: it accepts them; the probe creates and removes one file, or checks the nearest
            existing parent of a store not created yet).
        pronunciation_dir / pronunciation_dir_problem: the same for the pronunciation dictionaries.
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
    voices_dir: Path | None = None
    voices_dir_problem: str | None = None
    pronunciation_dir: Path | None = None
    pronunciation_dir_problem: str | None = None
    extra: dict = field(default_factory=dict)

    def device_index(self) -> int:
        """GPU index the synthesizer will use (``cuda:N`` -> N, otherwise 0)."""
        m = re.fullmatch(r"cuda:(\d+)", self.device or "")
        return int(m.group(1)) if m else 0


def parse_version(text: str | None) -> tuple[int, ...]:
    """Leading numeric components: "2.7.1+cu128" -> (2, 7, 1); None/garbage -> ()."""
    m = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in m.group(1).split(".")) if m else ()


def version_text(v: tuple[int, ...]) -> str:
    """(2, 6) -> "2.6"."""
    return ".".join(str(p) for p in v)


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
