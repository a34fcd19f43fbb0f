"""Pronunciation dictionaries on the frontend replica: the store, who may see and change which
dictionary, and the aliases of a request (applied to its text before normalisation).

Dictionaries belong to the key that created them, as voices do
(:class:`~deployments.protocol.VoiceAccess`): a key sees and uses its own and the shared ones
(created with keys off), changes only its own; an admin key, and every caller of a service
without keys, sees and changes all. A dictionary the caller may not see answers as unknown (404).

A request's aliases (:class:`~deployments.protocol.PronunciationSpec`) are its own rules, then
the rules of the dictionaries it names, compiled into one lexicon (cached by the versions it
resolved to: versions never change) and applied in one pass (cosyvoice_runtime/frontend/aliases.py).
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import PositiveInt

from cosyvoice_runtime.frontend.aliases import AliasOverflowError, AliasRule, Lexicon
from cosyvoice_runtime.frontend.lexicon_store import LexiconStore, StoreLimits
from deployments import constants
from deployments.options import StrictModel
from deployments.protocol import (
    DictionaryForbiddenError,
    DictionaryNotFoundError,
    InvalidInputError,
    PayloadTooLargeError,
    PronunciationSpec,
    VoiceAccess,
)

logger = logging.getLogger(__name__)

MAX_LOCATORS = 3  # dictionaries one request may name (ElevenLabs' limit)
MAX_REQUEST_RULES = 100  # rules one request may carry itself
COMPILED_CACHE = 32  # compiled lexicons kept per replica (by the versions they were built from)


class PronunciationConfig(StrictModel):
    """Pronunciation dictionaries (``/v1/pronunciation-dictionaries``), stored as small JSON files."""

    # None: $FAST_COSY_HOME/pronunciation (use shared storage on a cluster, as for voices_dir)
    dir: str | None = None
    max_dictionaries: PositiveInt = 10_000  # dictionaries the store may hold (413 past it)
    max_dictionaries_per_key: PositiveInt = 100  # dictionaries one API key may own (413 past it)
    max_rules: PositiveInt = 1_000  # rules of one dictionary (413 past it)
    max_store_bytes: PositiveInt = 256 * 1024**2  # bytes of the store's files (413 past it)


@dataclass(frozen=True)
class DictionaryInfo:
    """A dictionary as the routes show it; ``rules``: those of ``version_id`` when asked for."""

    id: str
    name: str
    description: str | None
    owner: str | None
    created_at: float
    archived_at: float | None
    version_id: str
    rules_num: int
    versions: tuple[tuple[str, int, float], ...]  # (id, rules, created_at), oldest first
    rules: tuple[AliasRule, ...] | None = None


def _info(record: dict, rules: tuple[AliasRule, ...] | None = None, version_id: str | None = None) -> DictionaryInfo:
    versions = tuple((str(v["id"]), int(v.get("rules_num", 0)), float(v.get("created_at", 0.0)))
                     for v in record["versions"])
    vid = version_id or versions[-1][0]
    num = next((n for i, n, _ in versions if i == vid), len(rules or ()))
    return DictionaryInfo(id=record["id"], name=record["name"], description=record.get("description"),
                          owner=record.get("owner"), created_at=float(record.get("created_at", 0.0)),
                          archived_at=record.get("archived_at"), version_id=vid, rules_num=num, versions=versions,
                          rules=rules)


def _merge(old: list[AliasRule], new: list[AliasRule]) -> list[AliasRule]:
    """``old`` with ``new`` added; a new rule for an existing string_to_replace replaces it (of
    two new ones for the same string, the later)."""
    latest = {r.grapheme: r for r in new}
    out = [latest.get(r.grapheme, r) for r in old]
    placed = {r.grapheme for r in old}
    for r in new:
        if r.grapheme not in placed:
            placed.add(r.grapheme)
            out.append(latest[r.grapheme])
    return out


def _unique(rules: list[AliasRule]) -> list[AliasRule]:
    """Rules in order, a later one for the same string_to_replace replacing the earlier."""
    return _merge([], rules)


class PronunciationService:
    """See the module docstring. Blocking (file I/O): the frontend runs it on its executor."""

    def __init__(self, cfg: PronunciationConfig) -> None:
        root = Path(cfg.dir) if cfg.dir else constants.default_pronunciation_dir()
        self.store = LexiconStore(root, StoreLimits(max_dictionaries=cfg.max_dictionaries,
                                                    max_per_owner=cfg.max_dictionaries_per_key,
                                                    max_rules=cfg.max_rules, max_bytes=cfg.max_store_bytes))
        self._compiled: OrderedDict[tuple, Lexicon] = OrderedDict()
        self._lock = threading.Lock()

    # -- access -------------------------------------------------------------------------------
    def _visible(self, dict_id: str, access: VoiceAccess) -> dict:
        record = self.store.get(dict_id)
        if not access.may_see(record.get("owner")):
            raise DictionaryNotFoundError(f"pronunciation dictionary '{dict_id}' not found")
        return record

    def _changeable(self, dict_id: str, access: VoiceAccess) -> None:
        if not access.may_change(self._visible(dict_id, access).get("owner")):
            raise DictionaryForbiddenError(f"pronunciation dictionary '{dict_id}' is shared: only an admin key may "
                                           "change it")

    # -- CRUD ---------------------------------------------------------------------------------
    def create(self, name: str, description: str | None, rules: list[AliasRule], access: VoiceAccess) -> DictionaryInfo:
        rules = _unique([r.check() for r in rules])
        return _info(self.store.create(name, rules, access.owner, description))

    def list(self, access: VoiceAccess, include_archived: bool = False) -> list[DictionaryInfo]:
        return [_info(r) for r in self.store.list()
                if access.may_see(r.get("owner")) and (include_archived or not r.get("archived_at"))]

    def get(self, dict_id: str, access: VoiceAccess, version_id: str | None = None) -> DictionaryInfo:
        record = self._visible(dict_id, access)
        vid, rules = self.store.rules(dict_id, version_id)
        return _info(record, rules, vid)

    def update(self, dict_id: str, access: VoiceAccess, name: str | None = None,
               archived: bool | None = None) -> DictionaryInfo:
        self._changeable(dict_id, access)
        return _info(self.store.update(dict_id, name=name, archived=archived))

    def add_rules(self, dict_id: str, access: VoiceAccess, rules: list[AliasRule]) -> DictionaryInfo:
        new = _unique([r.check() for r in rules])
        return self._change(dict_id, access, lambda old: _merge(old, new))

    def set_rules(self, dict_id: str, access: VoiceAccess, rules: list[AliasRule]) -> DictionaryInfo:
        new = _unique([r.check() for r in rules])
        return self._change(dict_id, access, lambda old: new)

    def remove_rules(self, dict_id: str, access: VoiceAccess, graphemes: list[str]) -> DictionaryInfo:
        gone = set(graphemes)
        return self._change(dict_id, access, lambda old: [r for r in old if r.grapheme not in gone])

    def _change(self, dict_id: str, access: VoiceAccess,
                change: Callable[[list[AliasRule]], list[AliasRule]]) -> DictionaryInfo:
        self._changeable(dict_id, access)
        return _info(self.store.change_rules(dict_id, change))

    def delete(self, dict_id: str, access: VoiceAccess) -> None:
        self._changeable(dict_id, access)
        self.store.delete(dict_id)

    def store_status(self) -> tuple[str, str | None]:
        return str(self.store.root), self.store.check_writable()

    # -- requests -----------------------------------------------------------------------------
    def lexicon(self, spec: PronunciationSpec | None, access: VoiceAccess) -> Lexicon | None:
        """The compiled aliases of a request (None: it has none). Named dictionaries must be
        visible to the caller (404 otherwise); an archived one still applies where a request names
        it (archiving only hides it from the list)."""
        if spec is None or not (spec.locators or spec.rules):
            return None
        if len(spec.locators) > MAX_LOCATORS:
            raise InvalidInputError(f"at most {MAX_LOCATORS} pronunciation dictionaries per request")
        if len(spec.rules) > MAX_REQUEST_RULES:
            raise InvalidInputError(f"at most {MAX_REQUEST_RULES} pronunciation rules per request")
        resolved = []
        for dict_id, version_id in spec.locators:
            self._visible(dict_id, access)
            vid, rules = self.store.rules(dict_id, version_id)
            resolved.append(((dict_id, vid), rules))
        own = tuple(r.check() for r in spec.rules)
        key = (own, tuple(k for k, _ in resolved))
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        lexicon = Lexicon.compile([own, *(rules for _, rules in resolved)])
        with self._lock:
            self._compiled[key] = lexicon
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return lexicon

    def rewrite(self, text: str, spec: PronunciationSpec | None, access: VoiceAccess) -> str:
        """``text`` with the request's aliases applied. An alias may make the text at most four
        times longer plus 1024 characters (413 past that), so later stages stay bounded."""
        lexicon = self.lexicon(spec, access)
        if lexicon is None:
            return text
        try:
            return lexicon.apply(text, max_chars=expanded_limit(len(text)))
        except AliasOverflowError as exc:
            raise PayloadTooLargeError(str(exc)) from None


def expanded_limit(chars: int) -> int:
    """Most characters a text of ``chars`` may have once aliases are applied."""
    return 4 * chars + 1024


class PronunciationHandles:
    """The frontend deployment's handle methods for dictionaries (mixed into
    :class:`~deployments.frontend.TextFrontend`, which provides ``pronunciation`` and ``_run``)."""

    pronunciation: PronunciationService

    async def _run(self, fn, *args):  # the frontend's executor (deployments/frontend.py)
        raise NotImplementedError

    async def create_dictionary(self, name: str, description: str | None, rules: list[AliasRule],
                                access: VoiceAccess) -> DictionaryInfo:
        return await self._run(self.pronunciation.create, name, description, rules, access)

    async def list_dictionaries(self, access: VoiceAccess, include_archived: bool = False) -> list[DictionaryInfo]:
        return await self._run(self.pronunciation.list, access, include_archived)

    async def get_dictionary(self, dict_id: str, access: VoiceAccess, version_id: str | None = None) -> DictionaryInfo:
        return await self._run(self.pronunciation.get, dict_id, access, version_id)

    async def update_dictionary(self, dict_id: str, access: VoiceAccess, name: str | None = None,
                                archived: bool | None = None) -> DictionaryInfo:
        return await self._run(self.pronunciation.update, dict_id, access, name, archived)

    async def change_dictionary_rules(self, dict_id: str, access: VoiceAccess, how: str,
                                      rules: list[AliasRule] | list[str]) -> DictionaryInfo:
        """``how``: ``add`` / ``set`` (rules) or ``remove`` (strings_to_replace)."""
        fn = {"add": self.pronunciation.add_rules, "set": self.pronunciation.set_rules,
              "remove": self.pronunciation.remove_rules}[how]
        return await self._run(fn, dict_id, access, rules)

    async def delete_dictionary(self, dict_id: str, access: VoiceAccess) -> None:
        await self._run(self.pronunciation.delete, dict_id, access)

    async def pronunciation_lexicon(self, spec: PronunciationSpec | None, access: VoiceAccess) -> Lexicon | None:
        """A WebSocket session's compiled aliases, applied by the session to its streamed text."""
        return await self._run(self.pronunciation.lexicon, spec, access)
