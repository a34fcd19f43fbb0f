"""Durable pronunciation dictionaries: a directory of small JSON files, shareable by replicas.

Layout of ``root`` (a local path or shared storage, as the voice store)::

    <id>.json                   the dictionary: name, description, owner, archived time, versions
    <id>.<version>.rules.json   one version's rules (written once, never changed)

Every change of rules writes a new version file first (temp file, fsync, rename) and then the
dictionary's record the same way; the record's rename is the commit, so readers see the old
version or the new one, never half of one. A dictionary keeps its last ``MAX_VERSIONS`` versions
(older version files are removed after the commit; a locator naming one gets 404).

Writers of every replica take turns on an exclusive ``flock`` of ``<root>/.lock``: a rule change
is a read-modify-write of the record, and the quotas (dictionaries in the store, per owner, bytes)
are checked against what the store holds. Writes are rare (an operator's or agent's setup), so one
lock for the whole store costs nothing that matters.

A directory that refuses writes raises :class:`DictionaryStoreUnwritableError` naming it; reading
goes on. The directory is made at the first write, so a service that never stores a dictionary
never creates it.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_runtime.frontend.aliases import AliasRule
from cosyvoice_runtime.frontend.atomic_files import atomic_write, fsync_dir, probe_writable
from cosyvoice_runtime.frontend.errors import (
    DictionaryLimitError,
    DictionaryNotFoundError,
    DictionaryStoreUnwritableError,
    InvalidInputError,
)

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MAX_VERSIONS = 16  # versions a dictionary keeps (older ones are removed)
LOCK_FILE = ".lock"
_ID_RE = re.compile(r"^[0-9A-Za-z]{1,64}$")
_RULES_CACHE = 64  # versions' rules kept in memory (they never change)


@dataclass(frozen=True)
class StoreLimits:
    max_dictionaries: int = 10_000
    max_per_owner: int = 100
    max_rules: int = 1_000
    max_bytes: int = 256 * 1024**2


def check_id(value: str, what: str = "pronunciation_dictionary_id") -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidInputError(f"invalid {what} {str(value)[:80]!r}: 1 to 64 letters and digits")
    return value


def _rules_json(rules: list[AliasRule]) -> list[list]:
    return [[r.grapheme, r.alias, r.case_sensitive, r.word_boundaries] for r in rules]


def _rules_of(data: object) -> tuple[AliasRule, ...]:
    if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
        raise ValueError("no rule list")  # noqa: TRY004 - a bad file, reported as unreadable
    return tuple(AliasRule(str(g), str(a), bool(cs), bool(wb)) for g, a, cs, wb in data["rules"])


class LexiconStore:
    """``create`` / ``get`` / ``rules`` / ``list`` / ``update`` / ``change_rules`` / ``delete``
    over a directory (module docstring). Records are plain dicts (the JSON)."""

    def __init__(self, root: str | Path, limits: StoreLimits = StoreLimits()) -> None:
        self.root, self.limits = Path(root), limits
        self._records: dict[str, tuple[tuple[int, int, int], dict]] = {}  # id -> (stat version, record)
        self._rules: OrderedDict[tuple[str, str], tuple[AliasRule, ...]] = OrderedDict()
        self._lock = threading.Lock()  # the caches are shared by the frontend's executor threads

    # -- reading ------------------------------------------------------------------------------
    def _record_path(self, dict_id: str) -> Path:
        return self.root / f"{check_id(dict_id)}.json"

    def get(self, dict_id: str) -> dict:
        """The dictionary's record; DictionaryNotFoundError if absent or unreadable."""
        record = self._read(self._record_path(dict_id))
        if record is None:
            raise DictionaryNotFoundError(f"pronunciation dictionary '{dict_id}' not found")
        return record

    def _read(self, path: Path) -> dict | None:
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._records.get(path.stem)
        if hit is not None and hit[0] == version:
            return hit[1]
        try:
            record = json.loads(path.read_bytes().decode("utf-8"))
            if not (isinstance(record, dict) and isinstance(record.get("versions"), list) and record["versions"]
                    and isinstance(record.get("name"), str)):
                raise ValueError("not a dictionary record")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            logger.warning("pronunciation store %s: skipping %s: %s", self.root, path.name, exc)
            return None
        with self._lock:
            self._records[path.stem] = (version, record)
        return record

    def rules(self, dict_id: str, version_id: str | None = None) -> tuple[str, tuple[AliasRule, ...]]:
        """(version id, rules) of a version (None: the latest); DictionaryNotFoundError if gone."""
        record = self.get(dict_id)
        version_id = version_id or record["versions"][-1]["id"]
        if not any(v.get("id") == version_id for v in record["versions"]):
            raise DictionaryNotFoundError(f"pronunciation dictionary '{dict_id}' has no version '{version_id}'")
        key = (dict_id, version_id)
        with self._lock:
            cached = self._rules.get(key)
            if cached is not None:
                self._rules.move_to_end(key)
                return version_id, cached
        try:
            rules = _rules_of(json.loads((self.root / f"{dict_id}.{check_id(version_id, 'version_id')}.rules.json")
                                         .read_bytes().decode("utf-8")))
        except (OSError, ValueError, TypeError, UnicodeDecodeError) as exc:
            logger.warning("pronunciation store %s: version %s of %s unreadable: %s", self.root, version_id, dict_id,
                           exc)
            raise DictionaryNotFoundError(f"pronunciation dictionary '{dict_id}' version '{version_id}' is "
                                          "stored but unreadable") from None
        with self._lock:
            self._rules[key] = rules
            while len(self._rules) > _RULES_CACHE:
                self._rules.popitem(last=False)
        return version_id, rules

    def list(self) -> list[dict]:
        """Every readable dictionary's record, oldest first."""
        try:
            paths = [p for p in self.root.glob("*.json") if not p.name.startswith(".") and p.stem.isalnum()]
        except OSError:
            return []
        records = [r for r in map(self._read, paths) if r is not None]
        return sorted(records, key=lambda r: (r.get("created_at", 0), r.get("id", "")))

    def check_writable(self) -> str | None:
        """None when the store accepts writes now; else why not. Before the first write (no
        directory yet) the nearest existing directory above it is probed: the store can be made
        there. Nothing is left behind."""
        where = self.root
        while not where.exists() and where != where.parent:
            where = where.parent
        if where != self.root and not where.is_dir():
            return "Not a directory"
        return probe_writable(where)

    # -- writing ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _turn(self):
        """One writer at a time, across threads and replicas (module docstring)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            f = open(self.root / LOCK_FILE, "a+b")  # noqa: SIM115 - closed by the `with` below
        except OSError as exc:
            raise self._unwritable(exc) from exc
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            except OSError as exc:
                raise self._unwritable(exc) from exc
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _unwritable(self, exc: OSError) -> DictionaryStoreUnwritableError:
        why = exc.strerror or type(exc).__name__
        logger.error("pronunciation store %s refuses writes: %s", self.root, why)
        return DictionaryStoreUnwritableError(f"the pronunciation dictionary store {self.root} is not writable "
                                              f"({why}): dictionaries cannot be changed until it is")

    def _usage(self) -> int:
        total = 0
        for p in self.root.iterdir():
            if p.suffix == ".json" and not p.name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    total += p.stat().st_size
        return total

    def _write_version(self, dict_id: str, rules: list[AliasRule], extra_bytes: int = 0) -> dict:
        """The new version's file (not yet committed); returns its entry for the record."""
        if len(rules) > self.limits.max_rules:
            raise DictionaryLimitError(f"a dictionary holds at most {self.limits.max_rules} rules; this one would "
                                       f"hold {len(rules)}")
        version = {"id": secrets.token_hex(10), "rules_num": len(rules), "created_at": time.time()}
        data = json.dumps({"schema": SCHEMA_VERSION, "rules": _rules_json(rules)}, ensure_ascii=False).encode()
        used = self._usage()
        if used + len(data) + extra_bytes > self.limits.max_bytes:
            raise DictionaryLimitError(f"the pronunciation store holds {used} bytes; this change would pass its "
                                       f"limit of {self.limits.max_bytes}")
        atomic_write(self.root / f"{dict_id}.{version['id']}.rules.json", data)
        return version

    def _commit(self, record: dict) -> None:
        data = json.dumps(record, ensure_ascii=False, indent=1).encode("utf-8")
        atomic_write(self._record_path(record["id"]), data)

    def create(self, name: str, rules: list[AliasRule], owner: str | None, description: str | None = None) -> dict:
        """A new dictionary with one version of ``rules``; its record."""
        with self._turn():
            records = self.list()
            if len(records) >= self.limits.max_dictionaries:
                raise DictionaryLimitError(f"the pronunciation store holds {len(records)} dictionaries; the limit "
                                           f"is {self.limits.max_dictionaries}")
            mine = sum(1 for r in records if r.get("owner") == owner)
            if mine >= self.limits.max_per_owner:
                raise DictionaryLimitError(f"this key has {mine} pronunciation dictionaries; the limit is "
                                           f"{self.limits.max_per_owner}: delete one first")
            dict_id = secrets.token_hex(10)
            version = self._write_version(dict_id, rules, extra_bytes=1024)
            record = {"schema": SCHEMA_VERSION, "id": dict_id, "name": name, "description": description,
                      "owner": owner, "created_at": version["created_at"], "archived_at": None, "versions": [version]}
            self._commit(record)
        logger.info("pronunciation dictionary %s created (%d rules)", dict_id, len(rules))
        return record

    def update(self, dict_id: str, name: str | None = None, archived: bool | None = None) -> dict:
        """Rename or (un)archive, without a new version."""
        with self._turn():
            record = dict(self.get(dict_id))
            if name is not None:
                record["name"] = name
            if archived is not None:
                record["archived_at"] = (record.get("archived_at") or time.time()) if archived else None
            self._commit(record)
        return record

    def change_rules(self, dict_id: str, change) -> dict:
        """A new version with ``change(old rules) -> new rules`` (read and written in one turn)."""
        with self._turn():
            record = dict(self.get(dict_id))
            _, old = self.rules(dict_id)
            version = self._write_version(dict_id, list(change(list(old))))
            record["versions"] = [*record["versions"], version]
            dropped = record["versions"][:-MAX_VERSIONS]
            record["versions"] = record["versions"][-MAX_VERSIONS:]
            self._commit(record)
            for v in dropped:
                (self.root / f"{dict_id}.{v['id']}.rules.json").unlink(missing_ok=True)
        return record

    def delete(self, dict_id: str) -> None:
        """Remove the dictionary (its record first: the commit), then its version files."""
        with self._turn():
            record = self.get(dict_id)
            self._record_path(dict_id).unlink()
            fsync_dir(self.root)
            for v in record["versions"]:
                (self.root / f"{dict_id}.{v['id']}.rules.json").unlink(missing_ok=True)
        with self._lock:
            self._records.pop(dict_id, None)
        logger.info("pronunciation dictionary %s deleted", dict_id)
