"""Where and how a replica runs, decided on the replica's own node: the model directory, the
device and the execution mode (config first, then the node's environment)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from cosyvoice_runtime.modes import resolve_mode
from deployments import constants

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """Where a replica gets its model: resolved on the replica's own node (see resolve_model_dir).

    ``tiny_family`` set asks for the generated tiny random-weight model when no directory is
    configured; None (the default) makes a replica without a model refuse to start.
    """

    model_dir: str | None = None
    tiny_family: str | None = None

    def resolve(self) -> Path:
        return resolve_model_dir(self.model_dir, self.tiny_family)


class ModelNotConfiguredError(ValueError):
    """No model directory, and the config did not ask for the tiny model."""


def resolve_model_dir(model_dir: str | None, family: str | None) -> Path:
    """The configured model directory, else ``$FAST_COSY_MODEL_DIR``, else the tiny model if asked for.

    The tiny random-weight model (it does not speak) is written on first use, deterministically,
    so every node that needs it can generate the same one locally. It is served only when the
    config names its family (``tiny_family``): a production replica without a model must fail at
    start, not answer HTTP 200 with noise.
    """
    chosen = model_dir or constants.model_dir_override()
    if chosen:
        return Path(chosen).expanduser()
    if family is None:
        raise ModelNotConfiguredError(
            f"no model directory: set `model_dir` in the serve config's args (or ${constants.ENV_MODEL_DIR} on "
            "the node); to serve the tiny random-weight model, which does not speak, set `tiny_family: cosyvoice2` "
            "(or cosyvoice3) in the args explicitly")
    target = constants.tiny_model_dir(family)
    if not (target / f"{family}.yaml").exists():
        from cosyvoice_runtime.tiny_model import write_tiny_model

        logger.warning("no model directory configured: writing the tiny RANDOM-WEIGHT %s model to %s", family, target)
        try:
            write_tiny_model(target, family=family)
        except OSError:
            # Another replica on this node won the atomic rename; its directory is complete.
            if not (target / f"{family}.yaml").exists():
                raise
    logger.warning("serving the tiny RANDOM-WEIGHT %s model (tiny_family): valid audio, not speech", family)
    return target


def resolve_device(configured: str) -> str:
    """``auto`` -> ``$FAST_COSY_DEVICE`` or ``cuda`` when available, else ``cpu``."""
    override = constants.device_override()
    if override:
        return override
    if configured != "auto":
        return configured
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def replica_mode(configured: str | None) -> tuple[str, str]:
    """(mode, source) of a replica: the config's mode, else ``$FAST_COSY_MODE`` of this node, else
    pytorch. The one place the rule is applied: the Synthesizer resolves once and hands the loader
    a config whose mode is set."""
    return resolve_mode(configured, constants.mode_override())
