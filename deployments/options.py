"""Serving knobs shared by every deployment config, and their translation to Serve options.

Every deployment config (``FrontendConfig``, ``SynthesizerConfig``, ``IngressConfig``) extends
:class:`DeploymentKnobs`; :meth:`DeploymentKnobs.serve_options` is the single translation into
``serve.deployment(**options)`` keyword arguments. All models forbid unknown keys, so a typo in
``configs/*.yaml`` is an error at build time instead of a silently ignored setting (Serve's own
schemas ignore unknown keys, see ray-serve-notes §4.4).
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class ReplicaResources(StrictModel):
    """``ray_actor_options`` of one replica. Fractions pack several replicas on one CPU/GPU."""

    num_cpus: float = Field(0.5, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    memory_bytes: int | None = Field(None, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)
    accelerator_type: str | None = None

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_bytes is not None:
            opts["memory"] = self.memory_bytes
        if self.resources:
            opts["resources"] = dict(self.resources)
        if self.accelerator_type:
            opts["accelerator_type"] = self.accelerator_type
        return opts


class LoadBandConfig(StrictModel):
    """Custom policy: keep each replica's load within ``[low_pct, high_pct]`` of its SLO capacity.

    load = (streams in flight + queued) / (replicas * ``slo_streams``); see
    ``deployments.autoscaling_policy``. ``slo_streams``: the mean syntheses in flight of one replica
    at its SLO capacity, measured with ``bench/capacity.py`` (``streams_in_flight_mean`` of the
    largest load that met the SLO). The GPU configs' value is written by ``fastcosy calibrate``
    from a recorded measurement (``configs/calibration/``, docs/tuning.md §5); the default here is
    only a placeholder for configs without one: measure the target GPU.
    """

    enabled: bool = False
    low_pct: float = Field(70.0, gt=0)
    high_pct: float = Field(80.0, gt=0)
    slo_streams: PositiveFloat = 12.0
    metric: str = "streams_in_flight"

    @model_validator(mode="after")
    def _band(self) -> LoadBandConfig:
        if self.low_pct >= self.high_pct:
            raise ValueError(f"low_pct ({self.low_pct}) must be below high_pct ({self.high_pct})")
        return self


class AutoscalingKnobs(StrictModel):
    """Subset of Serve's ``AutoscalingConfig`` we expose (queue-length based by default)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: PositiveInt = 1
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: PositiveFloat = 2.0
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    # Must exceed the 10 s metrics push interval (Serve warns, and will reject, otherwise).
    look_back_period_s: float = Field(30.0, gt=10)
    load_band: LoadBandConfig = Field(default_factory=LoadBandConfig)

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingKnobs:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas ({self.max_replicas})")
        if self.initial_replicas is not None and not (self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("initial_replicas must lie within [min_replicas, max_replicas]")
        return self

    def serve_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = self.model_dump(exclude={"load_band"}, exclude_none=True)
        if self.load_band.enabled:
            cfg["policy"] = {
                "policy_function": "deployments.autoscaling_policy:LoadBandPolicy",
                "policy_kwargs": self.load_band.model_dump(exclude={"enabled"}),
            }
        return cfg


class DeploymentKnobs(StrictModel):
    """Replica count, backpressure and lifecycle knobs of one deployment.

    Exactly one of ``num_replicas`` / ``autoscaling`` is used: a config with ``autoscaling``
    ignores nothing silently, it is an error to give both.
    """

    num_replicas: PositiveInt | None = None
    autoscaling: AutoscalingKnobs | None = None
    max_ongoing_requests: PositiveInt = 8
    # There is no "unlimited" mode (house style §2.3 rule 12).
    max_queued_requests: PositiveInt = 16
    retry_after_s: PositiveInt = 1
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    health_check_period_s: PositiveFloat = 10.0
    health_check_timeout_s: PositiveFloat = 30.0
    graceful_shutdown_timeout_s: PositiveFloat = 20.0
    # Freeze the Python objects alive once the replica has started (model, runtime, graphs) out of
    # the cyclic garbage collector's walks, whose full passes otherwise stop every thread of the
    # replica for tens of ms (deployments.python_gc); false only to measure without it.
    gc_freeze: bool = True

    @model_validator(mode="after")
    def _replicas(self) -> DeploymentKnobs:
        if self.num_replicas is not None and self.autoscaling is not None:
            raise ValueError("give either num_replicas or autoscaling, not both")
        if self.autoscaling is not None and self.autoscaling.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError("autoscaling.target_ongoing_requests must not exceed max_ongoing_requests")
        return self

    def serve_options(self, name: str) -> dict[str, Any]:
        """Keyword arguments for ``serve.deployment``."""
        from ray.serve.config import BackpressureConfig  # ray is a deployments-layer dependency

        opts: dict[str, Any] = {
            "name": name,
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=self.retry_after_s),
            "ray_actor_options": self.resources.actor_options(),
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
        }
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.serve_config()
        else:
            opts["num_replicas"] = self.num_replicas or 1
        return opts
