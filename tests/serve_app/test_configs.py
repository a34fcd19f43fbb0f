"""configs/*.yaml and cluster.yaml: strict validation, and every replica fits a node."""
from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from serve_app.args import AppArgs, application_of

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _unknown_keys(data: dict, model) -> set[str]:
    return set(data) - set(model.model_fields)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses_strictly(path: Path):
    from ray.serve.schema import HTTPOptionsSchema, LoggingConfig, ServeApplicationSchema, ServeDeploySchema

    data = _load(path)
    ServeDeploySchema.model_validate(data)
    # Serve's schemas ignore unknown keys, so check them ourselves (ray-serve-notes §4.4).
    assert not _unknown_keys(data, ServeDeploySchema)
    assert not _unknown_keys(data.get("http_options", {}), HTTPOptionsSchema)
    assert not _unknown_keys(data.get("logging_config", {}), LoggingConfig)
    app = application_of(data)
    assert not _unknown_keys(app, ServeApplicationSchema)
    # All deployment knobs live in `args` (validated, computed into options); no silent overrides.
    assert "deployments" not in app
    args = AppArgs.model_validate(app["args"])
    assert args == AppArgs.from_file(path)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_build_app_binds_three_deployments_with_backpressure(path: Path):
    from deployments.frontend import TextFrontend
    from deployments.synthesizer import Synthesizer
    from serve_app.app import build_app
    from serve_app.ingress import TTSIngress

    args = AppArgs.from_file(path)
    build_app(args)  # binding needs no cluster
    for cls, cfg in ((TTSIngress, args.ingress), (TextFrontend, args.frontend), (Synthesizer, args.synthesizer)):
        opts = cls.deployment_options(cfg)
        assert opts["backpressure_config"].status_code == 429
        assert opts["backpressure_config"].retry_after_s == cfg.retry_after_s
        assert opts["max_queued_requests"] == cfg.max_queued_requests > 0


@pytest.mark.parametrize("where", [(), ("ingress",), ("frontend",), ("synthesizer",), ("synthesizer", "token2wav"),
                                   ("synthesizer", "resources"), ("frontend", "autoscaling"),
                                   ("frontend", "autoscaling", "load_band")])
def test_unknown_key_is_rejected_at_every_level(where):
    args = copy.deepcopy(application_of(_load(ROOT / "configs/local.yaml"))["args"])
    node = args
    for key in where:
        node = node.setdefault(key, {})
    node["max_ongoing_request"] = 3  # the typo Serve itself accepts silently
    with pytest.raises(ValidationError, match="max_ongoing_request"):
        AppArgs.model_validate(args)


@pytest.mark.parametrize("patch, message", [
    ({"synthesizer": {"num_replicas": 1, "autoscaling": {"max_replicas": 2}}}, "either num_replicas or autoscaling"),
    ({"frontend": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas"),
    ({"synthesizer": {"autoscaling": {"load_band": {"low_pct": 80, "high_pct": 70}}}}, "low_pct"),
    ({"synthesizer": {"autoscaling": {"load_band": {"slo_streams": 0}}}}, "slo_streams"),
    ({"synthesizer": {"max_running": 4, "max_ongoing_requests": 8}}, "max_running"),
    ({"ingress": {"max_queued_requests": -1}}, "greater than 0"),
    ({"synthesizer": {"dtype": "int4"}}, "dtype"),
])
def test_semantic_errors(patch, message):
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(patch)


def test_load_band_policy_is_wired_into_autoscaling_config():
    args = AppArgs.from_file(ROOT / "configs/production.yaml")
    cfg = args.synthesizer.serve_options("Synthesizer")["autoscaling_config"]
    assert cfg["policy"]["policy_function"] == "deployments.autoscaling_policy:LoadBandPolicy"
    assert cfg["policy"]["policy_kwargs"] == {"low_pct": 70.0, "high_pct": 80.0, "slo_streams": 8.0,
                                              "metric": "streams_in_flight"}
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**cfg)  # Serve accepts it (imports and pickles the policy)


# ------------------------------------------------------------------ cluster.yaml resource fit
def _declared_nodes(cluster: dict) -> dict[str, dict[str, float]]:
    """Resources each node kind declares in its `ray start` command (local provider)."""
    nodes = {}
    for kind in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmd = " ".join(cluster[kind])
        start = cmd[cmd.index("ray start"):]
        flags = dict(re.findall(r"--([\w-]+)=('[^']*'|\S+)", start))
        res = {"CPU": float(flags["num-cpus"]), "GPU": float(flags.get("num-gpus", 0))}
        if "resources" in flags:
            res.update({k: float(v) for k, v in json.loads(shlex.split(flags["resources"])[0]).items()})
        nodes[kind] = res
    return nodes


def _request(actor_options: dict) -> dict[str, float]:
    req = {"CPU": actor_options.get("num_cpus", 0), "GPU": actor_options.get("num_gpus", 0)}
    req.update(actor_options.get("resources", {}))
    return req


def test_cluster_yaml_is_valid_for_the_launcher():
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_load(ROOT / "cluster.yaml")))


def test_production_replicas_fit_cluster_nodes():
    nodes = _declared_nodes(_load(ROOT / "cluster.yaml"))
    args = AppArgs.from_file(ROOT / "configs/production.yaml")
    for name, cfg in (("ingress", args.ingress), ("frontend", args.frontend), ("synthesizer", args.synthesizer)):
        req = _request(cfg.resources.actor_options())
        fits = [n for n, have in nodes.items() if all(have.get(k, 0) >= v for k, v in req.items())]
        assert fits, f"{name} requests {req}, no node declares that: {nodes}"
    # One synthesizer replica per GPU node, and max_replicas never exceeds the GPU workers.
    assert args.synthesizer.resources.num_gpus == 1
    cluster = _load(ROOT / "cluster.yaml")
    assert args.synthesizer.autoscaling.max_replicas <= cluster["max_workers"]


def test_local_config_fits_one_two_core_cpu_machine():
    args = AppArgs.from_file(ROOT / "configs/local.yaml")
    total_cpu = 0.0
    for cfg in (args.ingress, args.frontend, args.synthesizer):
        replicas = cfg.autoscaling.max_replicas if cfg.autoscaling else cfg.num_replicas
        total_cpu += replicas * cfg.resources.num_cpus
        assert cfg.resources.num_gpus == 0
    assert total_cpu <= 2.0
    assert args.synthesizer.device == "cpu" and args.model_dir is None


def test_serve_builder_path_validates_args():
    """What `serve run`/`serve deploy` do with `args`: call the builder through Serve's helper."""
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    from serve_app.app import build_app

    args = application_of(_load(ROOT / "configs/local.yaml"))["args"]
    assert isinstance(call_user_app_builder_with_args_if_necessary(build_app, args), Application)
    with pytest.raises(ValidationError, match="replicas_max"):
        call_user_app_builder_with_args_if_necessary(build_app, {**args, "replicas_max": 3})
