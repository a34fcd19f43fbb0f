"""Shared pieces of the ``fastcosy`` subcommands: the error type, output, config loading."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

APP_IMPORT_PATH = "serve_app.app:build_app"
# Exit codes: 1 = the command ran and found a problem (doctor fail, check mismatch);
# 2 = the command cannot run (bad arguments, missing component, unreachable service).
EXIT_PROBLEM = 1
EXIT_UNAVAILABLE = 2


class CliError(Exception):
    """A failure the user can act on: printed without a traceback, exits with ``code``."""

    def __init__(self, message: str, code: int = EXIT_UNAVAILABLE) -> None:
        super().__init__(message)
        self.code = code


def out(text: str = "") -> None:
    """User-facing output of a command (stdout); diagnostics go through logging (stderr)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


@dataclass
class LoadedConfig:
    """A serve config: the whole YAML document, our application entry and its validated args."""

    path: Path
    document: dict[str, Any]
    app: dict[str, Any]
    args: Any  # serve_app.args.AppArgs


def load_serve_config(path: str | Path, app_name: str | None = None) -> LoadedConfig:
    """Read a serve config (or a bare ``args`` file, wrapped into one) and validate it.

    Raises:
        CliError: the file is missing, is not YAML, or does not validate (message names the key).
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise CliError(f"config file {path} does not exist")
    try:
        document = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise CliError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(document, dict):
        raise CliError(f"{path} must hold a mapping (a serve config or AppArgs)")
    if "applications" not in document:
        document = {"applications": [{"name": "tts", "route_prefix": "/", "import_path": APP_IMPORT_PATH,
                                      "args": document}]}
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from serve_app.args import AppArgs, application_of

    try:
        ServeDeploySchema.model_validate(document)
        app = application_of(document, app_name)
        args = AppArgs.model_validate(app.get("args") or {})
    except ValidationError as exc:
        raise CliError(f"{path} does not validate:\n{exc}") from None
    except ValueError as exc:
        raise CliError(f"{path}: {exc}") from None
    return LoadedConfig(path=path, document=document, app=app, args=args)
