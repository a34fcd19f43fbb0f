"""One error shape for every response, and the one mapping from exceptions to status codes.

Body: OpenAI's ``{"error": {"message", "type", "param", "code"}}`` plus ``"request_id"``
(``param`` names the request field at fault, or is null). The request id is the incoming
``x-request-id`` header: Serve's proxy sets it on every request (taking the client's when given)
and returns it in the response header itself, so logs, body and header agree; when the app runs
outside Serve a fresh id is made. Domain errors (``deployments.protocol``) map to 4xx/5xx with their
message; anything unexpected is logged with its traceback and answered with a generic 500
that carries only the request id (house style §2.6 rule 23).

The ElevenLabs-compatible routes (paths under ``/v1/text-to-speech/`` and
``/v1/pronunciation-dictionaries``) answer in ElevenLabs' own
shape instead, which its SDKs and the voice-agent frameworks parse: ``{"detail": {"status",
"message", "request_id"}}`` (``status`` is our ``code``, else the ``type``); their WebSocket
routes send ``{"error", "message", "code", "request_id"}`` (``code``: the close code that follows).
"""
from __future__ import annotations

import logging
import re
import uuid

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse

from deployments.constants import REQUEST_ID_HEADER
from deployments.protocol import (
    CosyVoiceError,
    DictionaryForbiddenError,
    DictionaryLimitError,
    DictionaryNotFoundError,
    DictionaryStoreUnwritableError,
    EngineDeadError,
    InvalidInputError,
    OverloadedError,
    PayloadTooLargeError,
    RequestFailedError,
    VoiceExistsError,
    VoiceForbiddenError,
    VoiceNotFoundError,
    VoiceStoreUnavailableError,
)
from serve_app.progress import NoAudioError

logger = logging.getLogger(__name__)

_CLIENT_ID_RE = re.compile(r"^[\x21-\x7e]{1,128}$")  # printable, no spaces


class ApiError(Exception):
    """Raised by route code for a response with an explicit status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.headers = status, message, type_, code, headers or {}
        self.param = param


def request_id_of(request: HTTPConnection) -> str:
    """The request's id: a well-formed client ``x-request-id`` or a fresh one (stable per request)."""
    rid = request.scope.get("tts_request_id")
    if rid is None:
        given = request.headers.get(REQUEST_ID_HEADER, "")
        rid = given if _CLIENT_ID_RE.match(given) else uuid.uuid4().hex
        request.scope["tts_request_id"] = rid
    return rid


def error_body(request_id: str, message: str, type_: str, code: str | None = None,
               param: str | None = None) -> dict:
    """The one error shape (also sent as a WebSocket message by the stream-input route)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}, "request_id": request_id}


ELEVENLABS_PREFIX = "/v1/text-to-speech/"
ELEVENLABS_PREFIXES = (ELEVENLABS_PREFIX, "/v1/pronunciation-dictionaries")  # paths answered in its shape


def elevenlabs_body(request_id: str, message: str, type_: str, code: str | None = None) -> dict:
    """ElevenLabs' HTTP error shape (the routes under ``ELEVENLABS_PREFIX``)."""
    return {"detail": {"status": code or type_, "message": message, "request_id": request_id}}


def elevenlabs_ws_error(request_id: str, message: str, type_: str, code: str | None, close_code: int,
                        context_id: str | None = None) -> dict:
    """ElevenLabs' WebSocket error message (``contextId`` when it concerns one context)."""
    body = {"error": code or type_, "message": message, "code": close_code, "request_id": request_id}
    if context_id is not None:
        body["contextId"] = context_id
    return body


def error_response(request_id: str, status: int, message: str, type_: str, code: str | None = None,
                   headers: dict[str, str] | None = None, param: str | None = None,
                   path: str | None = None) -> JSONResponse:
    """The error response of the API family that ``path`` belongs to (OpenAI's shape by default)."""
    if path is not None and path.startswith(ELEVENLABS_PREFIXES):
        body = elevenlabs_body(request_id, message, type_, code)
    else:
        body = error_body(request_id, message, type_, code, param)
    return JSONResponse(body, status_code=status, headers=headers or {})


def _unwrap(exc: BaseException) -> BaseException:
    """Ray wraps replica exceptions (RayTaskError subclasses the cause); take the cause."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def classify(exc: BaseException, retry_after_s: int = 1) -> tuple[int, str, str | None, dict[str, str]]:
    """(status, type, code, headers) for an exception; 500 for unknown ones."""
    exc = _unwrap(exc)
    from ray.serve.exceptions import BackPressureError

    if isinstance(exc, BackPressureError):
        return 429, "overloaded_error", "queue_full", {"Retry-After": str(retry_after_s)}
    if isinstance(exc, OverloadedError):
        return 429, "overloaded_error", "queue_full", {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, VoiceNotFoundError):
        return 404, "not_found_error", "voice_not_found", {}
    if isinstance(exc, VoiceForbiddenError):
        return 403, "permission_error", "voice_not_owned", {}
    if isinstance(exc, VoiceStoreUnavailableError):  # read-only store: the message names its path
        return 503, "server_error", "voice_store_unavailable", {"Retry-After": str(retry_after_s)}
    if isinstance(exc, DictionaryNotFoundError):
        return 404, "not_found_error", "pronunciation_dictionary_not_found", {}
    if isinstance(exc, DictionaryForbiddenError):
        return 403, "permission_error", "pronunciation_dictionary_not_owned", {}
    if isinstance(exc, DictionaryStoreUnwritableError):  # the message names the directory
        return 503, "server_error", "pronunciation_store_unavailable", {"Retry-After": str(retry_after_s)}
    if isinstance(exc, DictionaryLimitError):
        return 413, "invalid_request_error", "payload_too_large", {}
    if isinstance(exc, VoiceExistsError):
        return 409, "conflict_error", "voice_exists", {}
    if isinstance(exc, PayloadTooLargeError):
        return 413, "invalid_request_error", "payload_too_large", {}
    if isinstance(exc, (InvalidInputError, ValidationError)):
        return 400, "invalid_request_error", "invalid_input", {}
    if isinstance(exc, NoAudioError):  # a stream without audio for stream_idle_timeout_s (serve_app/progress.py)
        return 504, "server_error", "audio_timeout", {"Retry-After": str(retry_after_s)}
    if isinstance(exc, EngineDeadError):
        return 503, "server_error", "engine_unavailable", {"Retry-After": str(retry_after_s)}
    if isinstance(exc, RequestFailedError):  # this request alone failed on the replica
        return 500, "server_error", "synthesis_failed", {}
    return 500, "server_error", None, {}


def param_of(exc: BaseException) -> str | None:
    """The request field a validation error is about (OpenAI's ``param``), if any."""
    exc = _unwrap(exc)
    if isinstance(exc, ApiError):
        return exc.param
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False)
        loc = errors[0].get("loc", ()) if errors else ()
        return ".".join(str(x) for x in loc) or None
    return None


def message_of(exc: BaseException) -> str:
    exc = _unwrap(exc)
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(x) for x in err.get("loc", ())) or "body"
            parts.append(f"{where}: {err.get('msg')}")
        return "; ".join(parts)
    text = str(exc.args[0]) if exc.args else type(exc).__name__
    return text.splitlines()[0][:500] if text else type(exc).__name__


def response_for(request: Request, exc: BaseException, retry_after_s: int = 1) -> JSONResponse:
    rid = request_id_of(request)
    path = request.scope.get("path", "")
    if isinstance(exc, ApiError):
        return error_response(rid, exc.status, exc.message, exc.type, exc.code, exc.headers, exc.param, path)
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(rid, exc.status_code, str(exc.detail), kind, path=path)
    status, type_, code, headers = classify(exc, retry_after_s)
    if status >= 500 and not isinstance(_unwrap(exc), CosyVoiceError):
        logger.error("request %s failed: %s", rid, type(exc).__name__)
        return error_response(rid, 500, f"internal error (request id {rid})", "server_error", path=path)
    if status >= 500:
        logger.warning("request %s: %s", rid, message_of(exc))
    return error_response(rid, status, message_of(exc), type_, code, headers, param_of(exc), path)


def install_exception_handlers(app: Starlette, retry_after_s: int = 1) -> None:
    """Register the mapping once for every route of ``app``."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        return response_for(request, exc, retry_after_s)

    from ray.serve.exceptions import BackPressureError

    # NOTE: specific classes go to Starlette's ExceptionMiddleware (response only); the catch-all
    # `Exception` handler runs in ServerErrorMiddleware, which re-raises after responding so the
    # server also logs the traceback. Ray re-raises replica errors as subclasses of the cause,
    # so the MRO lookup finds the domain classes below.
    for cls in (ApiError, HTTPException, CosyVoiceError, ValidationError, BackPressureError, Exception):
        app.add_exception_handler(cls, handle)
