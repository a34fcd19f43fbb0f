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
on all others; tensors are cached in memory by their hash, least recently used first out past
``cache_max_bytes``.

Create-if-absent (``put(..., overwrite=False)``) commits with ``os.link`` of the fsynced temp
record instead of a rename: the link fails if the name exists, atomically, also on NFS, so of two
replicas registering the same new id exactly one succeeds (:class:`VoiceExistsError` for the other).

A record that cannot be read or lacks a field (a hand edit, a foreign file, a disk error) is
skipped by :meth:`VoiceRegistry.list` and reported (a warning, once per record version, and
:meth:`VoiceRegistry.problems`); looking it up is :class:`VoiceNotFoundError`. Listing never fails.

A store that refuses writes (a read-only mount, permissions, a full disk) makes ``put`` and
``delete`` raise :class:`VoiceStoreUnwritableError` naming the directory; :meth:`VoiceRegistry.check_writable`
probes it without touching any voice (readiness, ``fastcosy doctor``). Reading still works.

Quotas (``max_voices``, ``max_bytes``) are checked before a new voice is written
(:class:`VoiceStoreFullError`). With a quota set, the check and the write hold an exclusive
``flock`` on ``<root>/.quota.lock``, so writers of every replica sharing the directory take turns
and the quota is never passed (on NFS, Linux maps flock to the server's byte-range locks; a
filesystem without locks raises, rather than silently overshooting). Without quotas, writers do
not serialise.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from cosyvoice_runtime.frontend.atomic_files import TMP_SUFFIX, atomic_write, fsync_dir, probe_writable
from cosyvoice_runtime.frontend.errors import (
    InvalidVoiceIdError,
    VoiceExistsError,
    VoiceFamilyMismatchError,
    VoiceNotFoundError,
    VoiceStoreFullError,
    VoiceStoreUnwritableError,
)
from cosyvoice_runtime.frontend.voice_id import check_voice_id
from cosyvoice_runtime.voice_prompt import VoicePrompt

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
QUOTA_LOCK = ".quota.lock"  # flock target of quota-checked writes (a dot file: never listed nor collected)
_TENSORS = ("text_tokens", "speech_tokens", "mel", "embedding")
_RECORD_FIELDS = {"family": str, "tensors": str, "sha256": str}
MEL_BINS = 80
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024


def content_voice_id(family: str, prompt_text: str, audio: bytes) -> str:
    """Deterministic id of a (family, prompt text, prompt audio) registration: same input, same id."""
    h = hashlib.sha256()
    for part in (family.encode(), prompt_text.encode("utf-8"), bytes(audio)):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return "v" + h.hexdigest()[:24]


def _serialize(voice: VoicePrompt) -> bytes:
    from safetensors.numpy import save

    arrays = {
        "text_tokens": np.ascontiguousarray(voice.text_tokens, dtype=np.int32).reshape(-1),
        "speech_tokens": np.ascontiguousarray(voice.speech_tokens, dtype=np.int32).reshape(-1),
        "mel": np.ascontiguousarray(voice.mel, dtype=np.float32).reshape(-1, MEL_BINS),
        "embedding": np.ascontiguousarray(voice.embedding, dtype=np.float32).reshape(-1),
    }
    return save(arrays)


def _nbytes(voice: VoicePrompt) -> int:
    return sum(np.asarray(getattr(voice, k)).nbytes for k in _TENSORS)


class VoiceRegistry:
    """Register once, reuse by id: ``put``/``get``/``delete``/``list`` over a directory store.

    Args:
        root: the store's directory (shared storage on a cluster).
        max_voices: most records the store may hold (None: no limit).
        max_bytes: most bytes of records + tensor files the store may hold (None: no limit).
        cache_max_bytes: tensor bytes kept in memory (least recently used evicted first).
    """

    def __init__(self, root: str | Path, max_voices: int | None = None, max_bytes: int | None = None,
                 cache_max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_voices, self.max_bytes, self.cache_max_bytes = max_voices, max_bytes, cache_max_bytes
        self._cache: OrderedDict[str, tuple[str, VoicePrompt, int]] = OrderedDict()  # id -> (sha, voice, bytes)
        self._cache_bytes = 0
        self._lock = threading.Lock()  # the cache is shared by the frontend's executor threads
        self._problems: dict[str, str] = {}  # id -> why its record is unusable (last scan or lookup)
        self._reported: set[tuple[str, int]] = set()  # (id, mtime_ns) already logged
        self._listed: dict[str, tuple[tuple[int, int, int], str | None]] = {}  # id -> (version, problem)

    # -- paths ------------------------------------------------------------------------------
    def _record_path(self, voice_id: str) -> Path:
        path = (self.root / f"{check_voice_id(voice_id)}.json")
        if path.resolve().parent != self.root.resolve():  # belt and braces against traversal
            raise InvalidVoiceIdError(f"invalid voice id {voice_id!r}")
        return path

    def _read_record(self, voice_id: str) -> dict | None:
        """The record, None if absent; :class:`VoiceNotFoundError` if it is unusable (reported)."""
        path = self._record_path(voice_id)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._report(voice_id, path, f"unreadable record: {exc}")
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            self._report(voice_id, path, f"record is not JSON ({exc})")
        if not isinstance(record, dict):
            self._report(voice_id, path, "record is not a JSON object")
        for key, kind in _RECORD_FIELDS.items():
            if not isinstance(record.get(key), kind):
                self._report(voice_id, path, f"record lacks '{key}'")
        tensors = record["tensors"]
        if "/" in tensors or "\\" in tensors or tensors.startswith(".") or not tensors.endswith(".safetensors"):
            self._report(voice_id, path, "record names a tensor file outside the store")
        self._problems.pop(voice_id, None)
        return record

    def _report(self, voice_id: str, path: Path, why: str):
        """Remember and log (once per record version) why a record is unusable, then raise."""
        self._problems[voice_id] = why
        try:
            key = (voice_id, path.stat().st_mtime_ns)
        except OSError:
            key = (voice_id, -1)
        if key not in self._reported:
            self._reported.add(key)
            logger.warning("voice store %s: skipping voice %s: %s", self.root, voice_id, why)
        raise VoiceNotFoundError(f"voice '{voice_id}' is stored but unreadable")

    def problems(self) -> dict[str, str]:
        """Records found unusable by the last :meth:`list` (or lookups since): id -> reason."""
        return dict(self._problems)

    def check_writable(self) -> str | None:
        """None when the store accepts writes now; else why not (a probe file created and removed)."""
        return probe_writable(self.root)

    def _unwritable(self, exc: OSError) -> VoiceStoreUnwritableError:
        why = exc.strerror or type(exc).__name__
        logger.error("voice store %s refuses writes: %s", self.root, why)
        return VoiceStoreUnwritableError(f"the voice store {self.root} is not writable ({why}): voices cannot be "
                                         "registered or deleted until it is")

    # -- cache ------------------------------------------------------------------------------
    def _cached(self, voice_id: str, sha: str) -> VoicePrompt | None:
        with self._lock:
            hit = self._cache.get(voice_id)
            if hit is None or hit[0] != sha:
                return None
            self._cache.move_to_end(voice_id)
            return hit[1]

    def _remember(self, voice_id: str, sha: str, voice: VoicePrompt) -> None:
        size = _nbytes(voice)
        with self._lock:
            self._forget_locked(voice_id)
            if size > self.cache_max_bytes:
                return
            self._cache[voice_id] = (sha, voice, size)
            self._cache_bytes += size
            while self._cache_bytes > self.cache_max_bytes:
                _, (_, _, evicted) = self._cache.popitem(last=False)
                self._cache_bytes -= evicted

    def _forget_locked(self, voice_id: str) -> None:
        old = self._cache.pop(voice_id, None)
        if old is not None:
            self._cache_bytes -= old[2]

    def cache_info(self) -> tuple[int, int]:
        """``(voices, bytes)`` held in memory."""
        with self._lock:
            return len(self._cache), self._cache_bytes

    # -- quotas -----------------------------------------------------------------------------
    def usage(self) -> tuple[int, int]:
        """``(records, bytes)`` in the store: every committed record, plus all its files' sizes."""
        records, total = 0, 0
        for p in self.root.iterdir():
            if p.name.startswith("."):
                continue
            if p.suffix == ".json":
                records += 1
            if p.suffix in (".json", ".safetensors"):
                try:
                    total += p.stat().st_size
                except FileNotFoundError:  # deleted meanwhile by another replica
                    pass
        return records, total

    @contextlib.contextmanager
    def _quota_turn(self):
        """Exclusive across processes and threads while a quota is set (module docstring)."""
        if self.max_voices is None and self.max_bytes is None:
            yield
            return
        with open(self.root / QUOTA_LOCK, "a+b") as f:  # one open file description per turn
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _check_quota(self, new_record: bool, new_bytes: int) -> None:
        if self.max_voices is None and self.max_bytes is None:
            return
        records, total = self.usage()
        if new_record and self.max_voices is not None and records + 1 > self.max_voices:
            raise VoiceStoreFullError(f"the voice store holds {records} voices; the limit is {self.max_voices}")
        if self.max_bytes is not None and total + new_bytes > self.max_bytes:
            raise VoiceStoreFullError(f"the voice store holds {total} bytes; adding {new_bytes} would pass "
                                      f"the limit of {self.max_bytes}")

    # -- API --------------------------------------------------------------------------------
    def exists(self, voice_id: str) -> bool:
        return self._record_path(voice_id).exists()

    def put(self, voice_id: str, voice: VoicePrompt, overwrite: bool = True) -> bool:
        """Store ``voice`` under ``voice_id``. Returns False when the identical voice is already there.

        Re-registering an id with different content replaces it atomically (last write wins);
        with ``overwrite=False`` an existing id is :class:`VoiceExistsError`, decided atomically
        by the commit itself (two replicas racing for a new id: one wins, one gets the error).

        Raises:
            VoiceExistsError: ``overwrite=False`` and the id exists (or was created meanwhile).
            VoiceStoreFullError: the store would pass ``max_voices`` or ``max_bytes``.
            VoiceStoreUnwritableError: the directory refuses writes.
        """
        record_path = self._record_path(voice_id)
        blob = _serialize(voice)
        sha = hashlib.sha256(blob).hexdigest()
        try:
            old = self._read_record(voice_id)
        except VoiceNotFoundError:  # an unusable record is replaced (overwrite) or kept (create)
            old = None
            if not overwrite:
                raise VoiceExistsError(f"voice '{voice_id}' already exists (its record is unreadable)") from None
        if old is not None and old["sha256"] == sha and old["family"] == voice.family:
            return False
        if old is not None and not overwrite:
            raise VoiceExistsError(f"voice '{voice_id}' already exists")
        tensor_name = f"{voice_id}.{sha[:16]}.safetensors"
        tensor_path = self.root / tensor_name
        created_tensors = not tensor_path.exists()
        record = {"schema": SCHEMA_VERSION, "id": voice_id, "family": voice.family, "kind": voice.kind,
                  "text": voice.text, "tensors": tensor_name, "sha256": sha, "created_at": time.time(),
                  "meta": voice.meta}
        data = json.dumps(record, ensure_ascii=False, indent=1).encode("utf-8")
        new_bytes = len(data) + (len(blob) if created_tensors else 0)
        try:
            with self._quota_turn():
                self._check_quota(new_record=not record_path.exists(), new_bytes=new_bytes)
                if created_tensors:
                    atomic_write(tensor_path, blob)
                try:
                    atomic_write(record_path, data, exclusive=not overwrite)
                except FileExistsError:
                    if created_tensors:
                        tensor_path.unlink(missing_ok=True)  # ours alone: the winner's record names its own file
                    raise VoiceExistsError(f"voice '{voice_id}' already exists") from None
        except OSError as exc:
            raise self._unwritable(exc) from exc
        if old is not None and old["tensors"] != tensor_name:
            (self.root / old["tensors"]).unlink(missing_ok=True)
        with self._lock:
            self._forget_locked(voice_id)
        logger.info("registered voice %s (%s, %s)", voice_id, voice.family, voice.kind)
        return True

    def get(self, voice_id: str, family: str | None = None) -> VoicePrompt:
        """The stored voice; :class:`VoiceNotFoundError` if absent, a family mismatch is an error too."""
        from safetensors.numpy import load

        record = self._read_record(voice_id)
        if record is None:
            raise VoiceNotFoundError(f"unknown voice id '{voice_id}'")
        if family is not None and record["family"] != family:
            raise VoiceFamilyMismatchError(voice_id, record["family"], family)
        cached = self._cached(voice_id, record["sha256"])
        if cached is not None:
            return cached
        try:
            blob = (self.root / record["tensors"]).read_bytes()
            if hashlib.sha256(blob).hexdigest() != record["sha256"]:
                raise ValueError("checksum mismatch")
            arrays = load(blob)
            voice = VoicePrompt(family=record["family"], text=str(record.get("text", "")),
                                kind=str(record.get("kind", "zero_shot")), meta=dict(record.get("meta") or {}),
                                **{k: arrays[k] for k in _TENSORS})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.error("voice %s: tensor file %s unreadable: %s", voice_id, record.get("tensors"), exc)
            raise VoiceNotFoundError(f"voice '{voice_id}' is stored but unreadable") from None
        self._remember(voice_id, record["sha256"], voice)
        return voice

    def delete(self, voice_id: str) -> bool:
        """Remove a voice (an unusable record too). Returns False if there was none."""
        path = self._record_path(voice_id)
        try:
            record = self._read_record(voice_id)
        except VoiceNotFoundError:
            record = None  # unusable: the record goes, gc() collects whatever it named
        if record is None and not path.exists():
            return False
        try:
            path.unlink(missing_ok=True)  # the commit: the voice is gone
        except OSError as exc:
            raise self._unwritable(exc) from exc
        fsync_dir(self.root)
        if record is not None:
            (self.root / record["tensors"]).unlink(missing_ok=True)
        with self._lock:
            self._forget_locked(voice_id)
        self._problems.pop(voice_id, None)
        return True

    def _record_ids(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.json") if not p.name.startswith("."))

    def list(self) -> list[str]:
        """Ids of the usable voices; unusable records are skipped and reported (:meth:`problems`).

        Each record is parsed once per version (inode, mtime, size): listing again costs a stat
        per voice, not a read (the deployment checks existence with it on every registration).
        """
        ids, problems, listed = [], {}, {}
        for vid in self._record_ids():
            try:
                st = (self.root / f"{vid}.json").stat()
            except FileNotFoundError:  # deleted meanwhile
                continue
            version = (st.st_ino, st.st_mtime_ns, st.st_size)
            known = self._listed.get(vid)
            if known is not None and known[0] == version:
                why = known[1]
            else:
                try:
                    why = None if self._read_record(vid) is not None else "deleted"
                except (VoiceNotFoundError, InvalidVoiceIdError):  # reported; or a file name that is no id
                    why = self._problems.get(vid, "not a voice id")
            listed[vid] = (version, why)
            if why is None:
                ids.append(vid)
            elif why != "deleted":
                problems[vid] = why
        self._listed, self._problems = listed, problems
        return ids

    def gc(self, min_age_s: float = 3600.0) -> int:
        """Remove temp files and tensor files no record points to, if older than ``min_age_s``
        (a younger one may belong to a write in progress on another replica). Returns the count.

        Tensor files of an unusable record (``<id>.*``) are kept: it may be repaired by hand.
        """
        referenced, keep_prefixes = set(), []
        for vid in self._record_ids():
            try:
                rec = self._read_record(vid)
            except (VoiceNotFoundError, InvalidVoiceIdError):
                keep_prefixes.append(f"{vid}.")
                continue
            if rec:
                referenced.add(rec["tensors"])
        now, removed = time.time(), 0
        for p in self.root.iterdir():
            orphan = p.name.endswith(TMP_SUFFIX) or (
                p.suffix == ".safetensors" and p.name not in referenced and not p.name.startswith(tuple(keep_prefixes)))
            try:
                if orphan and now - p.stat().st_mtime >= min_age_s:
                    p.unlink(missing_ok=True)
                    removed += 1
            except FileNotFoundError:  # removed meanwhile by another replica
                continue
        if removed:
            logger.info("voice store %s: removed %d orphaned files", self.root, removed)
        return removed
