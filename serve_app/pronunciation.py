"""Pronunciation dictionaries over HTTP, in ElevenLabs' API shape, and the request fields that
use them (docs/serving.md, docs/voice-agents.md).

Routes (``voices`` scope to change, ``synthesis`` or ``voices`` to read; errors in ElevenLabs'
shape, serve_app/errors.py):

* ``POST /v1/pronunciation-dictionaries/add-from-rules``  ``{"name", "description", "rules"}``
* ``GET /v1/pronunciation-dictionaries``  ``?cursor, page_size (<= 100), sort (creation_time_unix |
  name), sort_direction, include_archived``
* ``GET /v1/pronunciation-dictionaries/{id}``  with the latest version's rules
* ``PATCH /v1/pronunciation-dictionaries/{id}``  ``{"name", "archived"}`` (no new version)
* ``DELETE /v1/pronunciation-dictionaries/{id}``  (ours: ElevenLabs only archives)
* ``POST /v1/pronunciation-dictionaries/{id}/add-rules`` | ``set-rules`` ``{"rules"}``,
  ``/remove-rules`` ``{"rule_strings"}``: each makes a new version
* ``GET /v1/pronunciation-dictionaries/{id}/{version_id}/download``  the version as a PLS lexicon

Rules: ``{"string_to_replace", "type": "alias", "alias", "case_sensitive", "word_boundaries"}``
(cosyvoice_runtime/frontend/aliases.py). Phoneme rules and PLS uploads (``add-from-file``) are
refused with a 400: CosyVoice reads text, not a phonetic alphabet.

Requests name dictionaries with ``pronunciation_dictionary_locators`` (at most 3:
``{"pronunciation_dictionary_id", "version_id"}``, no version: the latest) on the ElevenLabs
HTTP routes and in the first message of a WebSocket (of each context on multi-stream-input); the
OpenAI route and ``POST /v1/tts`` (JSON) take the same field and, like every route,
``pronunciation_rules`` (our extension: rules given with the request, before any dictionary's).
"""
from __future__ import annotations

import re
from typing import Any, Literal
from xml.sax.saxutils import escape

from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cosyvoice_runtime.frontend.aliases import MAX_ALIAS_CHARS, MAX_GRAPHEME_CHARS, AliasStream
from deployments.pronunciation import MAX_LOCATORS, MAX_REQUEST_RULES, DictionaryInfo, expanded_limit
from deployments.protocol import AliasRule, InvalidInputError, PronunciationSpec
from serve_app.auth import voice_access
from serve_app.errors import ApiError
from serve_app.handles import admitted
from serve_app.request_body import read_json

BASE = "/v1/pronunciation-dictionaries"
_ID = r"^[0-9A-Za-z]{1,64}$"
DEFAULT_PAGE, MAX_PAGE = 30, 100
PLS_MEDIA_TYPE = "application/pls+xml"


class RuleIn(BaseModel):
    """One rule as ElevenLabs' SDKs send it (extra fields ignored)."""

    model_config = ConfigDict(extra="ignore")

    string_to_replace: str = Field(min_length=1, max_length=MAX_GRAPHEME_CHARS)
    type: Literal["alias", "phoneme"] = "alias"
    alias: str | None = Field(None, max_length=MAX_ALIAS_CHARS)
    case_sensitive: bool | None = None
    word_boundaries: bool | None = None

    @model_validator(mode="after")
    def _alias_only(self) -> RuleIn:
        if self.type != "alias":
            raise ValueError("phoneme rules are not supported (CosyVoice reads text): use an alias rule, the text "
                             "to read instead")
        if self.alias is None:
            raise ValueError("an alias rule needs 'alias'")
        return self

    def rule(self) -> AliasRule:
        return AliasRule(self.string_to_replace, self.alias or "",
                         True if self.case_sensitive is None else self.case_sensitive,
                         True if self.word_boundaries is None else self.word_boundaries)


class LocatorIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pronunciation_dictionary_id: str = Field(pattern=_ID)
    version_id: str | None = Field(None, pattern=_ID)


class PronunciationFields(BaseModel):
    """The request fields (mixed into the OpenAI and ElevenLabs bodies)."""

    pronunciation_dictionary_locators: list[LocatorIn] | None = Field(None, max_length=MAX_LOCATORS)
    pronunciation_rules: list[RuleIn] | None = Field(None, max_length=MAX_REQUEST_RULES)

    def pronunciation(self) -> PronunciationSpec | None:
        return spec_of(self.pronunciation_dictionary_locators, self.pronunciation_rules)


def spec_of(locators: list[LocatorIn] | None, rules: list[RuleIn] | None = None) -> PronunciationSpec | None:
    if not locators and not rules:
        return None
    return PronunciationSpec(locators=tuple((x.pronunciation_dictionary_id, x.version_id) for x in locators or ()),
                             rules=tuple(r.rule() for r in rules or ()))


def spec_of_message(msg: dict) -> PronunciationSpec | None:
    """The fields of a WebSocket's first message (validated as on HTTP; 400-class errors)."""
    if not isinstance(msg, dict):
        return None
    return PronunciationFields.model_validate({k: msg[k] for k in ("pronunciation_dictionary_locators",
                                                                     "pronunciation_rules") if k in msg}).pronunciation()


class _Rules(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rules: list[RuleIn] = Field(max_length=100_000)  # the store's own limit (max_rules) answers 413 first


class _Create(_Rules):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = Field(None, max_length=2000)


class _Update(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str | None = Field(None, min_length=1, max_length=256)
    archived: bool | None = None


class _Remove(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rule_strings: list[str] = Field(max_length=100_000)


def _meta(d: DictionaryInfo) -> dict:
    return {"id": d.id, "latest_version_id": d.versions[-1][0], "latest_version_rules_num": d.versions[-1][1],
            "name": d.name, "description": d.description, "created_by": d.owner or "shared",
            "creation_time_unix": int(d.created_at), "permission_on_resource": "admin",
            "archived_time_unix": int(d.archived_at) if d.archived_at else None,
            "versions": [{"version_id": v, "version_rules_num": n, "creation_time_unix": int(t)}
                         for v, n, t in d.versions]}


def _rule_out(r: AliasRule) -> dict:
    return {"string_to_replace": r.grapheme, "type": "alias", "alias": r.alias, "case_sensitive": r.case_sensitive,
            "word_boundaries": r.word_boundaries}


def pls(d: DictionaryInfo) -> bytes:
    """A version's rules as a W3C PLS lexicon (``<lexeme><grapheme/><alias/></lexeme>``)."""
    lines = ['<?xml version="1.0" encoding="UTF-8"?>',
             ('<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon" '
              'alphabet="ipa" xml:lang="en-US">')]
    for r in d.rules or ():
        lines.append(f"  <lexeme><grapheme>{escape(r.grapheme)}</grapheme><alias>{escape(r.alias)}</alias></lexeme>")
    lines.append("</lexicon>")
    return ("\n".join(lines) + "\n").encode("utf-8")


def routes(ingress: Any) -> list[Route]:
    """The routes, served by ``ingress`` (a ``serve_app.ingress.TTSIngress``: its frontend handle
    and body limit)."""
    api = DictionaryRoutes(ingress)
    return [
        Route(BASE, api.list, methods=["GET"]),
        Route(BASE + "/add-from-rules", api.create, methods=["POST"]),
        Route(BASE + "/add-from-file", api.from_file, methods=["POST"]),
        Route(BASE + "/{dict_id}", api.get, methods=["GET"]),
        Route(BASE + "/{dict_id}", api.update, methods=["PATCH"]),
        Route(BASE + "/{dict_id}", api.delete, methods=["DELETE"]),
        Route(BASE + "/{dict_id}/add-rules", api.add_rules, methods=["POST"]),
        Route(BASE + "/{dict_id}/set-rules", api.set_rules, methods=["POST"]),
        Route(BASE + "/{dict_id}/remove-rules", api.remove_rules, methods=["POST"]),
        Route(BASE + "/{dict_id}/{version_id}/download", api.download, methods=["GET"]),
    ]


def _id(request: Request, name: str = "dict_id") -> str:
    value = request.path_params[name]
    if not re.match(_ID, value):
        raise InvalidInputError(f"invalid {name.replace('dict_id', 'pronunciation_dictionary_id')}: 1 to 64 letters "
                                "and digits")
    return value


class DictionaryRoutes:
    def __init__(self, ingress: Any) -> None:
        self.ingress = ingress

    @property
    def frontend(self):
        return self.ingress.frontend

    async def _body(self, request: Request, model: type[BaseModel]) -> Any:
        return model.model_validate(await read_json(request, self.ingress.cfg.max_upload_bytes))

    async def create(self, request: Request) -> Response:
        body = await self._body(request, _Create)
        d = await admitted(self.frontend.create_dictionary.remote(body.name, body.description,
                                                                  [r.rule() for r in body.rules],
                                                                  voice_access(request)))
        meta = _meta(d)
        return JSONResponse({"id": d.id, "name": d.name, "created_by": meta["created_by"],
                             "creation_time_unix": meta["creation_time_unix"], "version_id": d.version_id,
                             "version_rules_num": d.rules_num, "description": d.description,
                             "permission_on_resource": "admin"})

    async def from_file(self, request: Request) -> Response:
        raise ApiError(400, "PLS uploads are not supported: create the dictionary with add-from-rules (alias rules)",
                       code="unsupported")

    async def list(self, request: Request) -> Response:
        q = request.query_params
        try:
            size = int(q.get("page_size", DEFAULT_PAGE))
            start = int(q.get("cursor") or 0)
        except ValueError:
            raise InvalidInputError("page_size and cursor must be integers") from None
        if not 1 <= size <= MAX_PAGE or start < 0:
            raise InvalidInputError(f"page_size must be within 1..{MAX_PAGE} and cursor a cursor this route returned")
        sort = q.get("sort", "creation_time_unix")
        if sort not in ("creation_time_unix", "created_at_unix", "name"):
            raise InvalidInputError("sort must be creation_time_unix or name")
        archived = q.get("include_archived", "false").lower() in ("1", "true", "yes")
        infos = await admitted(self.frontend.list_dictionaries.remote(voice_access(request), archived))
        infos = sorted(infos, key=(lambda d: (d.name, d.id)) if sort == "name" else (lambda d: (d.created_at, d.id)),
                       reverse=q.get("sort_direction", "descending").lower() != "ascending")
        page = infos[start:start + size]
        more = start + size < len(infos)
        return JSONResponse({"pronunciation_dictionaries": [_meta(d) for d in page],
                             "next_cursor": str(start + size) if more else None, "has_more": more})

    async def get(self, request: Request) -> Response:
        d = await admitted(self.frontend.get_dictionary.remote(_id(request), voice_access(request)))
        return JSONResponse({**_meta(d), "rules": [_rule_out(r) for r in d.rules or ()]})

    async def update(self, request: Request) -> Response:
        body = await self._body(request, _Update)
        d = await admitted(self.frontend.update_dictionary.remote(_id(request), voice_access(request), body.name,
                                                                  body.archived))
        return JSONResponse(_meta(d))

    async def delete(self, request: Request) -> Response:
        dict_id = _id(request)
        await admitted(self.frontend.delete_dictionary.remote(dict_id, voice_access(request)))
        return JSONResponse({"pronunciation_dictionary_id": dict_id, "deleted": True})

    async def _change(self, request: Request, how: str, rules: list) -> Response:
        d = await admitted(self.frontend.change_dictionary_rules.remote(_id(request), voice_access(request), how, rules))
        return JSONResponse({"id": d.id, "version_id": d.version_id, "version_rules_num": d.rules_num})

    async def add_rules(self, request: Request) -> Response:
        return await self._change(request, "add", [r.rule() for r in (await self._body(request, _Rules)).rules])

    async def set_rules(self, request: Request) -> Response:
        return await self._change(request, "set", [r.rule() for r in (await self._body(request, _Rules)).rules])

    async def remove_rules(self, request: Request) -> Response:
        return await self._change(request, "remove", (await self._body(request, _Remove)).rule_strings)

    async def download(self, request: Request) -> Response:
        d = await admitted(self.frontend.get_dictionary.remote(_id(request), voice_access(request),
                                                               _id(request, "version_id")))
        return Response(pls(d), media_type=PLS_MEDIA_TYPE,
                        headers={"content-disposition": f'attachment; filename="{d.id}-{d.version_id}.pls"'})


# ----------------------------------------------------------------------------- WebSocket text
async def session_aliases(session: Any, max_chars: int) -> AliasStream | None:
    """The aliases of a text-in session whose first message named any, as a stream over its text
    (an :class:`AliasStream` holds back what a longer rule could still match, so a rule split over
    messages still matches; serve_app/alignment.py ``TextIn`` puts it before the word cutter).
    Their dictionaries are resolved by the frontend, which checks the key may use them."""
    if session.pronunciation is None:
        return None
    lexicon = await admitted(session.frontend.pronunciation_lexicon.remote(session.pronunciation, session.access))
    if lexicon is None:
        return None
    return AliasStream(lexicon, expanded_limit(max_chars))
