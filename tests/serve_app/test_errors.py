"""One error shape; exceptions map to their status codes; no traces leak."""
from __future__ import annotations

import json

import pytest
from starlette.requests import Request

from deployments.protocol import (
    EngineDeadError,
    InvalidInputError,
    OverloadedError,
    PayloadTooLargeError,
    VoiceExistsError,
    VoiceForbiddenError,
    VoiceNotFoundError,
    VoiceStoreUnavailableError,
)
from serve_app.errors import ApiError, response_for
from serve_app.progress import NoAudioError


def _request(headers=()) -> Request:
    return Request({"type": "http", "method": "POST", "path": "/", "headers": list(headers)})


@pytest.mark.parametrize("exc, status, code", [
    (InvalidInputError("bad"), 400, "invalid_input"),
    (VoiceNotFoundError("no voice"), 404, "voice_not_found"),
    (VoiceExistsError("dup"), 409, "voice_exists"),
    (PayloadTooLargeError("big"), 413, "payload_too_large"),
    (OverloadedError("full"), 429, "queue_full"),
    (EngineDeadError("dead"), 503, "engine_unavailable"),
    (NoAudioError("no audio for 60 s"), 504, "audio_timeout"),
    (VoiceForbiddenError("shared"), 403, "voice_not_owned"),
    (VoiceStoreUnavailableError("the voice store /v is not writable"), 503, "voice_store_unavailable"),
    (ApiError(415, "nope", code="unsupported_media_type"), 415, "unsupported_media_type"),
])
def test_mapping(exc, status, code):
    resp = response_for(_request(), exc)
    body = json.loads(resp.body)
    assert resp.status_code == status
    assert set(body) == {"error", "request_id"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert len(body["request_id"]) == 32  # fresh id outside Serve


def test_backpressure_error_is_429_with_retry_after():
    from ray.serve.exceptions import BackPressureError

    resp = response_for(_request(), BackPressureError(num_queued_requests=3, max_queued_requests=2), retry_after_s=7)
    assert resp.status_code == 429 and resp.headers["retry-after"] == "7"


def test_unexpected_error_is_generic_500_without_details():
    resp = response_for(_request(), RuntimeError("secret path /srv/x.py line 3"))
    body = json.loads(resp.body)
    assert resp.status_code == 500 and "secret" not in body["error"]["message"]
    assert body["request_id"] in body["error"]["message"]


def test_ray_wrapped_cause_is_unwrapped():
    class Wrapped(Exception):
        def __init__(self, cause):
            super().__init__("ray.exceptions.RayTaskError: Traceback ...")
            self.cause = cause

    resp = response_for(_request(), Wrapped(VoiceNotFoundError("voice 'x' not found")))
    assert resp.status_code == 404 and json.loads(resp.body)["error"]["message"] == "voice 'x' not found"


def test_client_request_id_is_kept_when_well_formed():
    assert json.loads(response_for(_request([(b"x-request-id", b"abc-123")]), InvalidInputError("x")).body)[
        "request_id"] == "abc-123"
    rid = json.loads(response_for(_request([(b"x-request-id", b"bad id")]), InvalidInputError("x")).body)["request_id"]
    assert rid != "bad id" and len(rid) == 32


def test_runtime_errors_with_custom_constructors_are_made_portable():
    import pickle

    from deployments.protocol import portable_error

    class TextTooLongError(InvalidInputError):  # the shape of cosyvoice_runtime.frontend.errors
        def __init__(self, length: int, limit: int) -> None:
            super().__init__(f"text has {length} characters, the limit is {limit}")

    class VoiceFamilyMismatchError(InvalidInputError):
        def __init__(self, voice_id: str, a: str, b: str) -> None:
            super().__init__(f"voice '{voice_id}' was registered for {a}, this model is {b}")

    too_long = portable_error(TextTooLongError(5000, 4096))
    assert type(too_long) is PayloadTooLargeError and "5000" in str(too_long)
    mismatch = portable_error(VoiceFamilyMismatchError("v", "cosyvoice2", "cosyvoice3"))
    assert type(mismatch) is InvalidInputError and pickle.loads(pickle.dumps(mismatch)).args == mismatch.args
    plain = VoiceNotFoundError("voice 'x' not found")
    assert portable_error(plain) is plain
    overloaded = pickle.loads(pickle.dumps(OverloadedError("full", retry_after_s=4)))
    assert overloaded.retry_after_s == 4 and str(overloaded) == "full"
