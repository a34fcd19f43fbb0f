"""The one voice-id rule of the project: the voice store, the deployments and the HTTP schemas
all take it from here. Standard library only, so the ingress can import it without torch.

Ids name files in the voice store: a letter or digit (any script: imported SFT speakers are
named like "中文女"), then letters, digits, '_', '.' or '-', at most 128 characters, and never
'..'. :data:`VOICE_ID_PATTERN` is also used as a pydantic ``pattern``, which pydantic runs with
Rust's regex engine (no look-arounds), so '..' is refused by :func:`is_voice_id`, not by the
pattern.
"""
from __future__ import annotations

import re

from cosyvoice_runtime.frontend.errors import InvalidVoiceIdError

VOICE_ID_MAX_LEN = 128
VOICE_ID_PATTERN = rf"^[^\W_][\w.\-]{{0,{VOICE_ID_MAX_LEN - 1}}}$"
VOICE_ID_RULE = f"1-{VOICE_ID_MAX_LEN} letters, digits, '.', '_' or '-', starting with a letter or digit, no '..'"
_ID_RE = re.compile(VOICE_ID_PATTERN)


def is_voice_id(voice_id: object) -> bool:
    """Whether ``voice_id`` follows the rule (a safe file-name stem)."""
    # fullmatch: the '$' of re.match also accepts a trailing newline
    return isinstance(voice_id, str) and _ID_RE.fullmatch(voice_id) is not None and ".." not in voice_id


def check_voice_id(voice_id: str) -> str:
    """Return ``voice_id`` if it follows the rule, else raise :class:`InvalidVoiceIdError`."""
    if not is_voice_id(voice_id):
        raise InvalidVoiceIdError(f"invalid voice id {voice_id!r}: use {VOICE_ID_RULE}")
    return voice_id
