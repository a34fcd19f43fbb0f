"""API-key authentication and CORS of the ingress (``ingress.auth``).

Keys come from a file named in the config (``auth.keys_file``, on every ingress node) and from
``$FAST_COSY_API_KEYS`` (read in ``deployments/constants.py``); never from a config file itself.
Each key carries scopes:

* ``synthesis``: ``POST /v1/audio/speech``, ``POST /v1/tts``, WebSocket routes, reading voices;
* ``voices``: voice administration (``POST /v1/voices``, ``DELETE /v1/voices/{id}``) and reading;
  also the pronunciation dictionaries' changes (``/v1/pronunciation-dictionaries``; reading them
  needs ``synthesis`` or ``voices``, as for voices);
* ``metrics``: ``GET /metrics`` and ``GET /health?detail=1`` (the live probe) when those are protected;
* ``admin``: every endpoint, and every voice (other keys see and use their own voices and the shared
  ones, and delete only their own: :class:`~deployments.protocol.VoiceAccess`).

A request's key is identified to the routes by a fingerprint (:func:`voice_access`), never the key.

Clients send ``Authorization: Bearer <key>`` (what OpenAI clients send) or ``xi-api-key: <key>``
(what ElevenLabs clients send; the same keys and scopes). WebSocket clients may also use an
``api_key`` query parameter, or the subprotocol
``openai-insecure-api-key.<key>`` (browsers cannot set headers on a WebSocket). A presented key is
hashed and compared with every configured key's hash by ``hmac.compare_digest``, so the time taken
does not depend on how much of a key matched, nor on which key matched.

``GET /health`` is open: it answers a cached status with counts only and calls no replica
(serve_app/health.py); ``GET /health?detail=1`` runs the probe and, with ``health_details: key``,
needs a key holding ``metrics``. Responses: 401 without a
valid key (``WWW-Authenticate: Bearer``), 403 with a valid key lacking the scope, both in the JSON
error shape of :mod:`serve_app.errors`. Without any configured key the service runs open and logs
a warning once per replica, unless ``auth.required`` is set, in which case the replica refuses
to start (production configs set it).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs

from pydantic import Field
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request

from deployments import constants
from deployments.options import StrictModel
from deployments.protocol import VoiceAccess
from serve_app.errors import error_response, request_id_of
from serve_app.health import wants_detail
from serve_app.middleware import route_path
from serve_app.playground import OPEN_PATHS as PLAYGROUND_PATHS

logger = logging.getLogger(__name__)

SYNTHESIS, VOICES, METRICS, ADMIN = "synthesis", "voices", "metrics", "admin"
SCOPES = frozenset({SYNTHESIS, VOICES, METRICS, ADMIN})
DEFAULT_SCOPES = frozenset({SYNTHESIS})
WS_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."


class AuthConfig(StrictModel):
    """API keys, open endpoints and CORS of the ingress (keys themselves never live in a config)."""

    # Refuse to start without at least one key (file or $FAST_COSY_API_KEYS); production configs set it.
    required: bool = False
    # File with one key per line: `<key> [scope,scope]` (no scopes: synthesis); `#` starts a comment.
    keys_file: str | None = None
    # GET /health?detail=1 (a live probe of every replica): `open` to anyone, `key` needs the `metrics` scope.
    # Plain GET /health (cached status, counts only) is always open.
    health_details: Literal["open", "key"] = "key"
    # GET /metrics: `open` to anyone who reaches the port, `key` needs the `metrics` scope.
    metrics: Literal["open", "key"] = "key"
    # Browser origins allowed by CORS (exact, or ["*"]); empty: no CORS headers at all.
    cors_origins: list[str] = Field(default_factory=list)


# ----------------------------------------------------------------------------- keys
def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def _scopes(text: str, where: str) -> frozenset[str]:
    scopes = frozenset(s.strip() for s in text.replace("+", ",").split(",") if s.strip())
    unknown = scopes - SCOPES
    if unknown:
        raise ValueError(f"{where}: unknown scope(s) {sorted(unknown)}; known: {sorted(SCOPES)}")
    return scopes or DEFAULT_SCOPES


def parse_key_file(text: str, name: str = "keys file") -> list[tuple[str, frozenset[str]]]:
    """``<key> [scope,scope]`` per line; blank lines and ``#`` comments skipped."""
    out = []
    for no, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, _, rest = line.partition(" ")
        out.append((key, _scopes(rest, f"{name}:{no}")))
    return out


def parse_key_env(value: str) -> list[tuple[str, frozenset[str]]]:
    """``$FAST_COSY_API_KEYS``: comma-separated ``key`` or ``key:scope+scope`` entries."""
    out = []
    for i, entry in enumerate(e.strip() for e in value.split(",")):
        if entry:
            key, _, scopes = entry.partition(":")
            out.append((key, _scopes(scopes, f"${constants.ENV_API_KEYS} entry {i + 1}")))
    return out


def key_id(key: str) -> str:
    """A key's stable public name (stored as the owner of the voices it registers): a fingerprint
    under its own label, so it is not the digest the ring compares, and never the key."""
    return "key-" + hashlib.sha256(b"fastcosy voice owner\0" + key.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class KeyEntry:
    digest: bytes
    scopes: frozenset[str]
    id: str


class KeyRing:
    """Configured keys as SHA-256 digests with their scopes; lookups compare in constant time."""

    def __init__(self, keys: Iterable[tuple[str, frozenset[str]]]) -> None:
        self._entries: list[KeyEntry] = []
        for key, scopes in keys:
            if len(key) < 16:
                raise ValueError("API keys must be at least 16 characters long")
            self._entries.append(KeyEntry(_digest(key), scopes, key_id(key)))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, presented: str) -> KeyEntry | None:
        """The entry of ``presented``, or None when it is not a configured key.

        Every configured key is compared (no early exit), each by ``hmac.compare_digest``.
        """
        digest = _digest(presented)
        found: KeyEntry | None = None
        for entry in self._entries:
            if hmac.compare_digest(digest, entry.digest):
                found = entry
        return found

    def scopes_of(self, presented: str) -> frozenset[str] | None:
        """The scopes of ``presented``, or None when it is not a configured key."""
        entry = self.lookup(presented)
        return entry.scopes if entry is not None else None


SCOPE_KEY = "tts_api_key"  # ASGI scope entry: the request's KeyEntry, set by ApiKeyAuth


def voice_access(conn) -> VoiceAccess:
    """Whose voices a request may see and change: everything without keys (open mode), all for an
    admin key, else its own and the shared ones (``conn``: a Request, WebSocket or ASGI scope)."""
    scope = conn if isinstance(conn, dict) else conn.scope
    entry: KeyEntry | None = scope.get(SCOPE_KEY)
    if entry is None:
        return VoiceAccess()
    return VoiceAccess(owner=entry.id, sees_all=ADMIN in entry.scopes)


def load_keys(cfg: AuthConfig) -> KeyRing:
    """Keys of ``cfg.keys_file`` plus ``$FAST_COSY_API_KEYS``; raises when ``required`` finds none."""
    keys: list[tuple[str, frozenset[str]]] = []
    env = constants.api_keys_env()
    if env:
        keys += parse_key_env(env)
    if cfg.keys_file:
        path = Path(cfg.keys_file).expanduser()
        try:
            keys += parse_key_file(path.read_text(encoding="utf-8"), str(path))
        except FileNotFoundError:
            if not env:  # a named file that is not there is a mistake, unless the environment gives the keys
                raise ValueError(f"ingress.auth.keys_file {path} does not exist (and ${constants.ENV_API_KEYS} "
                                 "is unset)") from None
            logger.warning("ingress.auth.keys_file %s does not exist: using $%s only", path, constants.ENV_API_KEYS)
        except OSError as exc:
            raise ValueError(f"ingress.auth.keys_file {path}: {exc.strerror or exc}") from None
    ring = KeyRing(keys)
    if cfg.required and not len(ring):
        raise ValueError(f"ingress.auth.required is true but no API key is configured: set ingress.auth.keys_file "
                         f"(a file on every ingress node) or ${constants.ENV_API_KEYS}")
    return ring


# ------------------------------------------------------------------------ routes
def required_scopes(method: str, path: str, websocket: bool = False) -> frozenset[str] | None:
    """Scopes of which a key needs one for this request; None: open (``/health`` without
    ``?detail``, the playground
    page and its files, which hold no secret: the page asks for the key).

    An empty set means any valid key (unknown paths: a 404 is not answered to strangers).
    """
    if websocket:
        return frozenset({SYNTHESIS})
    if path == "/health" or (method in ("GET", "HEAD") and path in PLAYGROUND_PATHS):
        return None
    if path == "/metrics":
        return frozenset({METRICS})
    if path in ("/v1/audio/speech", "/v1/tts") or path.startswith("/v1/text-to-speech/"):
        return frozenset({SYNTHESIS})
    if path == "/v1/voices" or path.startswith(("/v1/voices/", "/v1/pronunciation-dictionaries")):
        if method in ("GET", "HEAD"):
            return frozenset({SYNTHESIS, VOICES})
        return frozenset({VOICES})
    return frozenset()


def presented_key(scope) -> str | None:
    """The key a request carries: Bearer header, else xi-api-key, else (WebSockets) query, subprotocol."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
    auth = headers.get("authorization", "")
    kind, _, token = auth.partition(" ")
    if kind.lower() == "bearer" and token.strip():
        return token.strip()
    if headers.get("xi-api-key", "").strip():
        return headers["xi-api-key"].strip()
    if scope["type"] != "websocket":
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    if query.get("api_key"):
        return query["api_key"][0]
    for proto in scope.get("subprotocols") or []:
        if proto.startswith(WS_SUBPROTOCOL_PREFIX):
            return proto[len(WS_SUBPROTOCOL_PREFIX):]
    return None


# --------------------------------------------------------------------- middleware
@dataclass(frozen=True)
class _Denied:
    status: int
    message: str
    type: str
    code: str


class ApiKeyAuth:
    """Pure ASGI middleware enforcing :class:`AuthConfig` (a no-op pass-through without keys)."""

    def __init__(self, app, cfg: AuthConfig, keys: KeyRing) -> None:
        self.app, self.cfg, self.keys = app, cfg, keys

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or not len(self.keys):
            await self.app(scope, receive, send)
            return
        websocket = scope["type"] == "websocket"
        path = route_path(scope)
        needed = required_scopes(scope.get("method", "GET"), path, websocket)
        if path == "/metrics" and self.cfg.metrics == "open":
            needed = None
        key = presented_key(scope)
        entry = self.keys.lookup(key) if key else None
        held = entry.scopes if entry is not None else None
        if entry is not None:
            scope[SCOPE_KEY] = entry  # who is asking, for the voice routes (voice_access)
        if path == "/health" and self.cfg.health_details == "key" and wants_detail(scope.get("query_string", b"")):
            needed = frozenset({METRICS})  # the live probe of every replica: not for strangers
        if needed is None:
            await self.app(scope, receive, send)
            return
        denied = self._check(key, held, needed)
        if denied is None:
            await self.app(scope, receive, send)
        elif websocket:
            # Before accept: the server answers the handshake with 403 and no connection opens.
            await send({"type": "websocket.close", "code": 1008, "reason": denied.message[:120]})
        else:
            rid = request_id_of(Request(scope))
            headers = {"WWW-Authenticate": "Bearer"} if denied.status == 401 else None
            await error_response(rid, denied.status, denied.message, denied.type, denied.code, headers,
                                 path=path)(scope, receive, send)

    @staticmethod
    def _check(key: str | None, held: frozenset[str] | None, needed: frozenset[str]) -> _Denied | None:
        if key is None:
            return _Denied(401, "missing API key: send 'Authorization: Bearer <key>' or 'xi-api-key: <key>'",
                           "authentication_error",
                           "missing_api_key")
        if held is None:
            return _Denied(401, "invalid API key", "authentication_error", "invalid_api_key")
        if needed and not (held & (needed | {ADMIN})):
            return _Denied(403, f"this API key lacks the scope for this endpoint (needs one of: "
                                f"{', '.join(sorted(needed))})", "permission_error", "insufficient_scope")
        return None


def auth_middleware(cfg: AuthConfig) -> list[Middleware]:
    """CORS (when origins are configured) and API-key middleware, for the ingress's middleware list.

    Loads the keys on the replica that builds the app; raises when ``cfg.required`` finds none,
    which fails the replica's start.
    """
    keys = load_keys(cfg)
    if not len(keys):
        logger.warning("ingress is UNAUTHENTICATED: no API key configured (ingress.auth.keys_file, $%s); "
                       "anyone who reaches the port can synthesise and change voices", constants.ENV_API_KEYS)
    else:
        logger.info("ingress API keys: %d loaded; /metrics %s, /health details %s", len(keys), cfg.metrics,
                    cfg.health_details)
    out = []
    if cfg.cors_origins:
        # NOTE: before the key check, so a browser's preflight (OPTIONS, which carries no key) is answered.
        out.append(Middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins),
                              allow_methods=["GET", "POST", "PATCH", "DELETE"],
                              allow_headers=["authorization", "content-type", "x-request-id", "xi-api-key"],
                              expose_headers=["x-request-id", "retry-after"]))
    out.append(Middleware(ApiKeyAuth, cfg=cfg, keys=keys))
    return out
