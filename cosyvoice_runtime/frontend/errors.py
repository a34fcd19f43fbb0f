"""Typed input errors of the frontend.

All are subclasses of :class:`cosyvoice_runtime.errors.InvalidInputError` (or
:class:`VoiceNotFoundError`), so the serving layer maps every one of them to a client error with
its message and never shows a stack trace. Messages say what is wrong and what is allowed.
"""
from __future__ import annotations

from cosyvoice_runtime.errors import CosyVoiceError, InvalidInputError, VoiceNotFoundError

__all__ = [
    "DictionaryLimitError",
    "DictionaryNotFoundError",
    "DictionaryStoreUnwritableError",
    "EmptyTextError",
    "InvalidAudioError",
    "InvalidInputError",
    "InvalidVoiceIdError",
    "PromptTooLongError",
    "PromptTooShortError",
    "TextTooLongError",
    "VoiceExistsError",
    "VoiceFamilyMismatchError",
    "VoiceNotFoundError",
    "VoiceStoreFullError",
    "VoiceStoreUnwritableError",
]


class EmptyTextError(InvalidInputError):
    """The text is empty or whitespace only (or only punctuation after normalisation)."""


class _ArgsError(InvalidInputError):
    """Errors whose constructor takes fields, not a message: pickle them by their fields (Ray)."""

    _fields: tuple[str, ...] = ()

    def __reduce__(self):
        return type(self), tuple(getattr(self, f) for f in self._fields)


class TextTooLongError(_ArgsError):
    """The text is longer than the configured limit."""

    _fields = ("length", "limit")

    def __init__(self, length: int, limit: int) -> None:
        self.length = length
        self.limit = limit
        super().__init__(f"text has {length} characters, the limit is {limit}")


class InvalidAudioError(InvalidInputError):
    """The prompt bytes are not decodable audio, or the samples are unusable (NaN, rate 0...)."""


class PromptTooShortError(InvalidAudioError, _ArgsError):
    _fields = ("seconds", "minimum")

    def __init__(self, seconds: float, minimum: float) -> None:
        self.seconds = seconds
        self.minimum = minimum
        super().__init__(f"prompt audio is {seconds:.2f} s long, at least {minimum:g} s is needed")


class PromptTooLongError(InvalidAudioError, _ArgsError):
    _fields = ("seconds", "maximum")

    def __init__(self, seconds: float, maximum: float) -> None:
        self.seconds = seconds
        self.maximum = maximum
        super().__init__(f"prompt audio is {seconds:.2f} s long, at most {maximum:g} s is allowed")


class VoiceFamilyMismatchError(_ArgsError):
    """A stored voice was computed for the other model family (CV2 and CV3 prompts differ)."""

    _fields = ("voice_id", "voice_family", "model_family")

    def __init__(self, voice_id: str, voice_family: str, model_family: str) -> None:
        self.voice_id, self.voice_family, self.model_family = voice_id, voice_family, model_family
        super().__init__(f"voice '{voice_id}' was registered for {voice_family}, this model is {model_family}")


class InvalidVoiceIdError(InvalidInputError):
    """A voice id that is not a safe store key (path separators, '..', control characters...)."""


class VoiceExistsError(InvalidInputError):
    """A voice was registered without overwrite under an id that exists (or was created meanwhile)."""


class VoiceStoreFullError(InvalidInputError):
    """Registering would pass the voice store's quota (voice count or bytes)."""


class VoiceStoreUnwritableError(CosyVoiceError):
    """The voice store's directory refuses writes (a read-only mount, permissions, a full disk).

    Not the client's fault: the serving layer answers 503 with this message, which names the path."""


class DictionaryNotFoundError(InvalidInputError):
    """A pronunciation dictionary (or the version of it asked for) does not exist (404)."""


class DictionaryLimitError(InvalidInputError):
    """A pronunciation dictionary or the store would pass a limit: rules per dictionary,
    dictionaries per key, dictionaries or bytes in the store (413)."""


class DictionaryStoreUnwritableError(CosyVoiceError):
    """The pronunciation store's directory refuses writes; the message names it (503)."""
