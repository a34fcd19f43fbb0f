"""Runtime-level exceptions.

The serving layer (``deployments.protocol``) re-exports these and maps them to HTTP
status codes; the runtime itself never imports serving code.
"""
from __future__ import annotations


class CosyVoiceError(Exception):
    """Base class of every error the runtime raises on purpose."""


class ModelLoadError(CosyVoiceError):
    """A model directory is incomplete, corrupt or inconsistent.

    The message always names the offending file and what is wrong with it.
    """

    def __init__(self, path: object, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class ConfigError(ModelLoadError):
    """The model yaml has a missing, unknown or malformed key."""

    def __init__(self, path: object, key: str, problem: str) -> None:
        self.key = key
        super().__init__(path, f"key '{key}': {problem}")


class InvalidInputError(CosyVoiceError):
    """A request carries input the runtime cannot synthesise (empty text, bad audio...)."""


class VoiceNotFoundError(InvalidInputError):
    """A voice id is not in the voice registry."""
