"""The TensorRT plan key: what a plan file is valid for, its ``<plan>.json`` sidecar, and the rule
that decides whether a replica on a node may load it.

A plan is specific to one GPU compute capability ("12.0") and one full TensorRT version
("10.13.3.9"; plans do not load across TensorRT releases, patch releases included). Its
sidecar records the cache key (:class:`EngineKey`), the optimisation profile it was built for
and, optionally, the hash of the ``flow.pt`` it was exported from.

The replica's loader (:mod:`cosyvoice_runtime.trt.engine`) and ``fastcosy doctor`` both apply
the rule from here. This module imports only the standard library (the profile is a plain
dict here), so doctor can run it on a node before torch is installed.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

PLAN_SUFFIX = ".plan"
SIDECAR_SUFFIX = ".json"  # appended to the plan name: estimator_...plan.json
ATTENTIONS = ("full", "chunk")
PRECISIONS = ("fp16", "fp32")
PROFILE_FIELDS = ("rows", "frames", "n_mels", "spk_dim")
FLOW_CHECKPOINT = "flow.pt"
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True)
class EngineKey:
    """What a plan is valid for. Any field that differs means another plan (another file name)."""

    compute_capability: str  # "9.0", as torch.cuda.get_device_capability() is formatted
    tensorrt_version: str  # full version: plans do not load across TensorRT releases
    profile_hash: str
    precision: str  # fp16 | fp32
    onnx_hash: str
    attention: str = "full"  # full | chunk

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")

    @classmethod
    def from_sidecar(cls, meta: Mapping) -> EngineKey:
        return cls(**{f.name: str(meta[f.name]) for f in dataclasses.fields(cls)})

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def plan_name(self) -> str:
        """``estimator_full_fp16_sm90_trt10.13.3.9_<digest>.plan``: the sm/trt tokens are for people;
        the digest covers every field."""
        sm = self.compute_capability.replace(".", "")
        return f"estimator_{self.attention}_{self.precision}_sm{sm}_trt{self.tensorrt_version}_{self.digest()}{PLAN_SUFFIX}"


KEY_FIELDS = tuple(f.name for f in dataclasses.fields(EngineKey))


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sidecar_path(plan: Path) -> Path:
    return plan.with_name(plan.name + SIDECAR_SUFFIX)


def write_sidecar(plan: Path, key: EngineKey, profile: Mapping, **extra) -> Path:
    """Write ``<plan>.json``: the key fields, ``key`` (its digest), ``profile`` and ``extra``
    (``flow_sha256``, build facts)."""
    meta = {**dataclasses.asdict(key), "key": key.digest(), "profile": dict(profile), **extra}
    path = sidecar_path(plan)
    path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return path


def _valid_range(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) == 3 and all(isinstance(v, int) for v in value)
            and 1 <= value[0] <= value[1] <= value[2])


def read_sidecar(plan: Path) -> tuple[dict | None, str | None]:
    """``(sidecar, None)`` when the plan is usable at all, else ``(None, why not)``.

    Usable: a non-empty plan with a ``<plan>.json`` object that holds every key field, a known
    precision and attention, and a profile with ``1 <= min <= opt <= max`` integer ranges and
    integer widths.
    """
    if plan.stat().st_size == 0:
        return None, "empty (left by a failed build)"
    side = sidecar_path(plan)
    try:
        meta = json.loads(side.read_text())
    except FileNotFoundError:
        return None, f"no {side.name} sidecar (replicas skip plans without one)"
    except (OSError, ValueError) as exc:
        return None, f"{side.name} is unreadable ({type(exc).__name__})"
    if not isinstance(meta, dict):
        return None, f"{side.name} does not hold an object"
    missing = [k for k in (*KEY_FIELDS, "profile") if k not in meta]
    if missing:
        return None, f"{side.name} lacks {', '.join(missing)}"
    if str(meta["precision"]) not in PRECISIONS:
        return None, f"{side.name}: unknown precision {meta['precision']!r}"
    if str(meta["attention"]) not in ATTENTIONS:
        return None, f"{side.name}: unknown attention {meta['attention']!r}"
    prof = meta["profile"]
    if (not isinstance(prof, dict) or any(k not in prof for k in PROFILE_FIELDS)
            or not _valid_range(prof["rows"]) or not _valid_range(prof["frames"])
            or not all(isinstance(prof[k], int) for k in ("n_mels", "spk_dim"))):
        return None, f"{side.name}: malformed profile"
    return meta, None


def profile_covers(built: Mapping, needed: Mapping) -> bool:
    """A plan built for profile ``built`` runs every call of ``needed``: its ranges hold the needed
    min and max shapes, and the widths are the same model's."""
    def covers(rows: int, frames: int) -> bool:
        return built["rows"][0] <= rows <= built["rows"][2] and built["frames"][0] <= frames <= built["frames"][2]

    return (covers(needed["rows"][0], needed["frames"][0]) and covers(needed["rows"][2], needed["frames"][2])
            and built["n_mels"] == needed["n_mels"] and built["spk_dim"] == needed["spk_dim"])


def plan_mismatches(key: EngineKey, profile: Mapping, built_flow_sha256: str | None = None, *,
                    compute_capability: str | None, tensorrt_version: str | None, precision: str | None = None,
                    needed: Mapping | None = None, flow_sha256: str | None = None) -> list[str]:
    """Why a replica on this node refuses a plan; [] = it may load it.

    Args:
        key, profile, built_flow_sha256: the plan, as its sidecar records it (``profile`` as
            :meth:`~cosyvoice_runtime.trt.profiles.EstimatorProfile.to_dict` writes it).
        compute_capability, tensorrt_version: this node's, compared exactly; None: not known
            (doctor without a GPU or TensorRT), not compared.
        precision: the precision the replica asks for; None: any.
        needed: the profile the replica's largest batch and call need; None: not compared.
        flow_sha256: hash of the replica's ``flow.pt``; compared when the sidecar records one too.
    """
    why = []
    if compute_capability is not None and key.compute_capability != compute_capability:
        why.append(f"built for sm{key.compute_capability}, this GPU is sm{compute_capability}")
    if tensorrt_version is not None and key.tensorrt_version != tensorrt_version:
        why.append(f"built with TensorRT {key.tensorrt_version}, installed is {tensorrt_version}")
    if precision is not None and key.precision != precision:
        why.append(f"precision {key.precision}, wanted {precision}")
    if flow_sha256 and built_flow_sha256 and built_flow_sha256 != flow_sha256:
        why.append(f"exported from another {FLOW_CHECKPOINT}")
    if needed is not None and not profile_covers(profile, needed):
        why.append(f"profile rows {tuple(profile['rows'])} frames {tuple(profile['frames'])} does not cover "
                   f"rows {tuple(needed['rows'])} frames {tuple(needed['frames'])}")
    return why
