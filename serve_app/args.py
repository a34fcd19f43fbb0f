"""``AppArgs``: the typed ``args:`` of a serve config, one nested config per deployment.

``configs/*.yaml`` is a normal Serve config whose application has
``import_path: serve_app.app:build_app``; its ``args`` are validated into :class:`AppArgs`
(``extra="forbid"`` at every level, so a typo fails the build). :meth:`AppArgs.from_file`
reads either a bare args file or a whole serve config.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from cosyvoice_runtime.speech_length import ZH_CHARS_PER_S
from deployments.frontend import FrontendConfig
from deployments.model_source import ModelSource
from deployments.options import StrictModel
from deployments.synthesizer_config import SynthesizerConfig
from serve_app.ingress import IngressConfig
from serve_app.speech import MODEL_MIN_SPEED

# The synthesizer's drain covers the longest call the ingress admits (docs/tuning.md, "Scale-in"):
# its audio at the slowest speaking rate per character (Han, 4.5/s) and the lowest model speed,
# times this margin for a voice slower than the typical rate and the call's first-audio time.
DRAIN_MARGIN = 1.25


def longest_call_audio_s(max_input_chars: int) -> float:
    """Seconds of audio in the longest synthesizer call an ingress admitting ``max_input_chars``
    sends: every character a Han syllable (the slowest rate per character), at the model's lowest
    speed. A call makes its audio at least in real time (the SLO), so it lasts no longer."""
    return max_input_chars / ZH_CHARS_PER_S / MODEL_MIN_SPEED


def min_drain_s(max_input_chars: int) -> int:
    """The least ``synthesizer.graceful_shutdown_timeout_s`` that lets a replica chosen to stop
    finish the longest call the ingress admits (whole seconds)."""
    return math.ceil(longest_call_audio_s(max_input_chars) * DRAIN_MARGIN)


class AppArgs(StrictModel):
    """Everything ``build_app`` needs.

    Attributes:
        model_dir: official model directory; None uses ``$FAST_COSY_MODEL_DIR`` or, failing that,
            the tiny random-weight model if ``tiny_family`` asks for it; otherwise replicas refuse
            to start.
        tiny_family: serve the generated tiny random-weight model of this family (it does not
            speak) when no model directory is configured; null: no fallback, a replica without a
            model fails at start.
    """

    model_dir: str | None = None
    tiny_family: Literal["cosyvoice2", "cosyvoice3"] | None = None
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    frontend: FrontendConfig = Field(default_factory=FrontendConfig)
    synthesizer: SynthesizerConfig = Field(default_factory=SynthesizerConfig)

    @model_validator(mode="before")
    @classmethod
    def _derived_drain(cls, data: Any) -> Any:
        """Unset ``synthesizer.graceful_shutdown_timeout_s``: :func:`min_drain_s` of the ingress's
        ``max_input_chars``, so a scale-in cuts no stream by construction."""
        if not isinstance(data, dict):
            return data
        ingress, synth = data.get("ingress"), data.get("synthesizer")
        if isinstance(ingress, IngressConfig):
            chars = ingress.max_input_chars
        else:
            chars = (ingress or {}).get("max_input_chars", IngressConfig.model_fields["max_input_chars"].default)
        if not isinstance(chars, int) or chars <= 0:
            return data  # the ingress's own validation names the error
        drain = float(min_drain_s(chars))
        if isinstance(synth, SynthesizerConfig):
            if "graceful_shutdown_timeout_s" not in synth.model_fields_set:
                synth = synth.model_copy(update={"graceful_shutdown_timeout_s": drain})
        elif synth is None or isinstance(synth, dict):
            synth = {"graceful_shutdown_timeout_s": drain, **(synth or {})}
        return {**data, "synthesizer": synth}

    @model_validator(mode="after")
    def _consistent(self) -> AppArgs:
        fm, sm = self.frontend.model_dir, self.synthesizer.model_dir
        if fm and sm and fm != sm:
            raise ValueError("frontend.model_dir and synthesizer.model_dir must name the same model")
        need = min_drain_s(self.ingress.max_input_chars)
        if self.synthesizer.graceful_shutdown_timeout_s < need:
            raise ValueError(
                f"synthesizer.graceful_shutdown_timeout_s ({self.synthesizer.graceful_shutdown_timeout_s:g}) is shorter "
                f"than the longest call the ingress admits: {need} s for ingress.max_input_chars "
                f"{self.ingress.max_input_chars} (docs/tuning.md, Scale-in); a scale-in would cut such a stream. "
                "Raise it, leave it unset (derived), or lower max_input_chars")
        return self

    @property
    def configured_model_dir(self) -> str | None:
        """The model directory the config names (the synthesizer's, the frontend's, then the app's);
        None: the replicas fall back to ``$FAST_COSY_MODEL_DIR``, then the tiny model."""
        return self.synthesizer.model_dir or self.frontend.model_dir or self.model_dir

    def model_source(self) -> ModelSource:
        """Where every replica of this app finds its model (resolved on the replica's own node)."""
        return ModelSource(self.configured_model_dir, self.tiny_family)

    @classmethod
    def from_file(cls, path: str | Path, app_name: str | None = None) -> AppArgs:
        """Read a YAML/JSON file: bare args, or a serve config (``applications[].args``)."""
        data = yaml.safe_load(Path(path).read_text()) or {}
        if isinstance(data, dict) and "applications" in data:
            data = application_of(data, app_name).get("args") or {}
        return cls.model_validate(data)


def application_of(serve_config: dict[str, Any], app_name: str | None = None) -> dict[str, Any]:
    """The application entry of a serve config that runs ``build_app`` (by name if given)."""
    apps = [a for a in serve_config.get("applications") or [] if a.get("import_path") == "serve_app.app:build_app"]
    if app_name is not None:
        apps = [a for a in apps if a.get("name") == app_name]
    if len(apps) != 1:
        raise ValueError(f"expected exactly one serve_app.app:build_app application, found {len(apps)}")
    return apps[0]
