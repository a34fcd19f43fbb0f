"""Durable voice registry: a directory of safetensors + JSON, shareable by every replica.

Layout of ``root`` (a local path or shared storage such as NFS/EFS/a mounted bucket that
supports rename)::

    <id>.json                        commit record: family, kind, prompt text, tensor file, sha256
    <id>.<sha256[:16]>.safetensors   text_tokens, speech_tokens, mel, embedding

Why files and not SQLite: SQLite's locking is unreliable on network file systems (its own
documentation warns against NFS), and replicas of a Ray cluster usually share a network mount,
not a local disk. A rename inside one directory is atomic on POSIX file systems and NFS.

Crash safety: the tensor file (content-addressed name, never overwritten) is written to a temp
file, fsynced and renamed first; the JSON record is then written the same way and its rename is
the commit. A crash at any point leaves either the old record or the new one, each pointing at a
complete tensor file; orphaned temp/tensor files are ignored by readers and removed by :meth:`gc`.
Readers re-read the (small) JSON on every lookup, so a voice registered on one replica is visible
on all others; tensors are cached in memory by their hash.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from pathlib import Path

import numpy as np

from cosyvoice_runtime.frontend.errors import InvalidVoiceIdError, VoiceFamilyMismatchError, VoiceNotFoundError
from cosyvoice_runtime.frontend.prompt import PromptFeatures

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_ID_RE = re.compile(r"^[^\W_][\w.\-]{0,127}$", re.UNICODE)  # letters/digits first; no separators
_TENSORS = ("text_tokens", "speech_tokens", "mel", "embedding")
_TMP_SUFFIX = ".tmp"
MEL_BINS = 80


def check_voice_id(voice_id: str) -> str:
    """Return ``voice_id`` if it is a safe file-name stem, else raise :class:`InvalidVoiceIdError`."""
    if not isinstance(voice_id, str) or not _ID_RE.match(voice_id) or ".." in voice_id:
        raise InvalidVoiceIdError(
            f"invalid voice id {voice_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit")
    return voice_id


def content_voice_id(family: str, prompt_text: str, audio: bytes) -> str:
    """Deterministic id of a (family, prompt text, prompt audio) registration: same input, same id."""
    h = hashlib.sha256()
    for part in (family.encode(), prompt_text.encode("utf-8"), bytes(audio)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return "v" + h.hexdigest()[:24]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms/file systems cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old content or all of the new one."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{_TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _serialize(voice: PromptFeatures) -> bytes:
    from safetensors.numpy import save

    arrays = {
        "text_tokens": np.ascontiguousarray(voice.text_tokens, dtype=np.int32).reshape(-1),
        "speech_tokens": np.ascontiguousarray(voice.speech_tokens, dtype=np.int32).reshape(-1),
        "mel": np.ascontiguousarray(voice.mel, dtype=np.float32).reshape(-1, MEL_BINS),
        "embedding": np.ascontiguousarray(voice.embedding, dtype=np.float32).reshape(-1),
    }
    return save(arrays)


class VoiceRegistry:
    """Register once, reuse by id: ``put``/``get``/``delete``/``list`` over a directory store."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._cache: dict[str, tuple[str, PromptFeatures]] = {}  # id -> (sha256, voice)

    # -- paths ------------------------------------------------------------------------------
    def _record_path(self, voice_id: str) -> Path:
        path = (self.root / f"{check_voice_id(voice_id)}.json")
        if path.resolve().parent != self.root.resolve():  # belt and braces against traversal
            raise InvalidVoiceIdError(f"invalid voice id {voice_id!r}")
        return path

    def _read_record(self, voice_id: str) -> dict | None:
        try:
            return json.loads(self._record_path(voice_id).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None

    # -- API --------------------------------------------------------------------------------
    def exists(self, voice_id: str) -> bool:
        return self._record_path(voice_id).exists()

    def put(self, voice_id: str, voice: PromptFeatures) -> bool:
        """Store ``voice`` under ``voice_id``. Returns False when the identical voice is already there.

        Re-registering an id with different content replaces it atomically (last write wins).
        """
        blob = _serialize(voice)
        sha = hashlib.sha256(blob).hexdigest()
        old = self._read_record(voice_id)
        if old is not None and old.get("sha256") == sha and old.get("family") == voice.family:
            return False
        tensor_name = f"{voice_id}.{sha[:16]}.safetensors"
        tensor_path = self.root / tensor_name
        if not tensor_path.exists():
            atomic_write(tensor_path, blob)
        record = {"schema": SCHEMA_VERSION, "id": voice_id, "family": voice.family, "kind": voice.kind,
                  "text": voice.text, "tensors": tensor_name, "sha256": sha, "created_at": time.time(),
                  "meta": voice.meta}
        atomic_write(self._record_path(voice_id), json.dumps(record, ensure_ascii=False, indent=1).encode("utf-8"))
        if old is not None and old.get("tensors") not in (None, tensor_name):
            (self.root / old["tensors"]).unlink(missing_ok=True)
        logger.info("registered voice %s (%s, %s)", voice_id, voice.family, voice.kind)
        return True

    def get(self, voice_id: str, family: str | None = None) -> PromptFeatures:
        """The stored voice; :class:`VoiceNotFoundError` if absent, a family mismatch is an error too."""
        from safetensors.numpy import load

        record = self._read_record(voice_id)
        if record is None:
            raise VoiceNotFoundError(f"unknown voice id '{voice_id}'")
        if family is not None and record["family"] != family:
            raise VoiceFamilyMismatchError(voice_id, record["family"], family)
        cached = self._cache.get(voice_id)
        if cached is not None and cached[0] == record["sha256"]:
            return cached[1]
        try:
            blob = (self.root / record["tensors"]).read_bytes()
            if hashlib.sha256(blob).hexdigest() != record["sha256"]:
                raise ValueError("checksum mismatch")
            arrays = load(blob)
        except (OSError, ValueError) as exc:
            logger.error("voice %s: tensor file %s unreadable: %s", voice_id, record.get("tensors"), exc)
            raise VoiceNotFoundError(f"voice '{voice_id}' is stored but unreadable") from None
        voice = PromptFeatures(family=record["family"], text=record.get("text", ""), kind=record.get("kind", "zero_shot"),
                               meta=record.get("meta", {}), **{k: arrays[k] for k in _TENSORS})
        self._cache[voice_id] = (record["sha256"], voice)
        return voice

    def delete(self, voice_id: str) -> bool:
        record = self._read_record(voice_id)
        if record is None:
            return False
        self._record_path(voice_id).unlink(missing_ok=True)  # the commit: the voice is gone
        _fsync_dir(self.root)
        (self.root / record["tensors"]).unlink(missing_ok=True)
        self._cache.pop(voice_id, None)
        return True

    def list(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.json") if not p.name.startswith("."))

    def gc(self, min_age_s: float = 3600.0) -> int:
        """Remove temp files and tensor files no record points to, if older than ``min_age_s``
        (a younger one may belong to a write in progress on another replica). Returns the count."""
        referenced = set()
        for vid in self.list():
            rec = self._read_record(vid)
            if rec:
                referenced.add(rec["tensors"])
        now, removed = time.time(), 0
        for p in self.root.iterdir():
            orphan = p.name.endswith(_TMP_SUFFIX) or (p.suffix == ".safetensors" and p.name not in referenced)
            if orphan and now - p.stat().st_mtime >= min_age_s:
                p.unlink(missing_ok=True)
                removed += 1
        return removed


def import_spk2info(path: str | Path, family: str, registry: VoiceRegistry) -> list[str]:
    """Import an official ``spk2info.pt`` (both entry shapes of spec §2.9). Returns the ids.

    * SFT entries ``{'embedding': (1, 192)}`` become ``kind="sft"`` voices (embedding only).
    * zero-shot entries (``add_zero_shot_spk``) keep their aligned flow prompt tokens, prompt
      feature, prompt text ids and the raw flow embedding.
    Every key is validated before anything is written.
    """
    import torch

    table = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(table, dict):
        raise VoiceNotFoundError(f"{path}: not a speaker table")
    for key in table:
        check_voice_id(str(key))
    ids = []
    for key, entry in table.items():
        def arr(name, dtype):
            return entry[name].detach().cpu().numpy().astype(dtype).reshape(-1) if name in entry else None

        if "flow_prompt_speech_token" in entry:
            mel = entry["prompt_speech_feat"].detach().cpu().numpy().astype(np.float32).reshape(-1, MEL_BINS)
            voice = PromptFeatures(family=family, text="", kind="zero_shot", text_tokens=arr("prompt_text", np.int32),
                                   speech_tokens=arr("flow_prompt_speech_token", np.int32), mel=mel,
                                   embedding=arr("flow_embedding", np.float32), meta={"source": "spk2info"})
        elif "embedding" in entry:
            voice = PromptFeatures(family=family, text="", kind="sft", text_tokens=np.zeros(0, np.int32),
                                   speech_tokens=np.zeros(0, np.int32), mel=np.zeros((0, MEL_BINS), np.float32),
                                   embedding=arr("embedding", np.float32), meta={"source": "spk2info"})
        else:
            logger.warning("spk2info entry %r has neither shape of spec §2.9; skipped", key)
            continue
        registry.put(str(key), voice)
        ids.append(str(key))
    return ids
