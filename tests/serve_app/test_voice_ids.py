"""One voice-id rule (cosyvoice_runtime/frontend/voice_id.py): the voice store, the frontend
deployment and the HTTP layer (schemas, voice aliases, the text-in stream) give every id the
same verdict."""
from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from cosyvoice_runtime.frontend.voice_id import VOICE_ID_MAX_LEN, check_voice_id, is_voice_id
from deployments.frontend import FrontendConfig, TextFrontend
from deployments.protocol import InvalidInputError, VoiceNotFoundError
from serve_app.ingress import IngressConfig
from serve_app.schemas import VoiceFields
from tests.deployments import fakes

VALID = ["alice", "中文女", "spk-01.v2", "A_b", "v0", "a.b", "a" * VOICE_ID_MAX_LEN]
INVALID = ["", "_a", ".hidden", "-a", "a..b", "..", "../x", "a/b", "a\\b", "a\x00b", "a\n", "a b",
           "a" * (VOICE_ID_MAX_LEN + 1), 3]


def _runtime_accepts(voice_id) -> bool:
    try:
        check_voice_id(voice_id)
    except InvalidInputError:
        return False
    return True


def _deployment_accepts(frontend: TextFrontend, voice_id) -> bool:
    try:
        asyncio.run(frontend.get_voice(voice_id))
    except VoiceNotFoundError:
        return True  # the id passed; the (empty) fake store has no such voice
    except InvalidInputError:
        return False
    raise AssertionError("the fake store holds no voices")


def _schema_accepts(voice_id) -> bool:
    try:
        VoiceFields(voice_id=voice_id, prompt_text="t")
    except ValidationError:
        return False
    return True


def _alias_accepted(voice_id) -> bool:
    try:
        IngressConfig(voice_aliases={"alloy": voice_id})
    except ValidationError:
        return False
    return True


@pytest.mark.parametrize(("voice_id", "valid"), [(v, True) for v in VALID] + [(v, False) for v in INVALID])
def test_every_layer_gives_an_id_the_same_verdict(voice_id, valid):
    frontend = TextFrontend(FrontendConfig(), runtime_factory=fakes.fake_frontend_runtime)
    assert is_voice_id(voice_id) is valid
    assert _runtime_accepts(voice_id) is valid
    assert _deployment_accepts(frontend, voice_id) is valid
    assert _alias_accepted(voice_id) is valid
    if isinstance(voice_id, str) and ".." not in voice_id:
        assert _schema_accepts(voice_id) is valid
    else:
        # The schema's pattern runs in pydantic's Rust regex engine (no look-arounds), so '..' is
        # left to the frontend deployment, which answers the same 400.
        assert not valid


def test_error_names_the_rule():
    with pytest.raises(InvalidInputError, match="1-128 letters, digits"):
        check_voice_id("a/b")
