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

from bench.calibrate import named_record
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
    # the setpoint is fastcosy calibrate's (tests/bench/test_calibrate.py checks it against its measurement)
    (record,) = set(named_record((ROOT / "configs/production.yaml").read_text()))
    slo_streams = json.loads((ROOT / record).read_text())["slo_streams"]
    assert cfg["policy"]["policy_kwargs"] == {"low_pct": 70.0, "high_pct": 80.0, "slo_streams": slo_streams,
                                              "metric": "streams_in_flight"}
    from ray.serve.config import AutoscalingConfig

    AutoscalingConfig(**cfg)  # Serve accepts it (imports and pickles the policy)


# ------------------------------------------------------------------ cluster launcher files
CLUSTERS = {"cluster.yaml": ROOT / "cluster.yaml", "cluster-trt.yaml": ROOT / "cluster-trt.yaml"}
STANDARD = {"CPU", "GPU", "memory"}


def _launcher_view(path: Path) -> dict:
    """The config as `ray up` hands it to the autoscaler: Ray's own preparation and validation."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(_load(path))
    validate_config(prepared)
    return prepared


def _declared_hosts(cluster: dict) -> dict[str, dict[str, float]]:
    """Resources each host kind declares in its `ray start` command (what Ray's scheduler sees)."""
    hosts = {}
    for kind in ("head_start_ray_commands", "worker_start_ray_commands"):
        cmd = " ".join(cluster[kind])
        start = cmd[cmd.index("ray start"):]
        flags = dict(re.findall(r"--([\w-]+)=('[^']*'|\S+)", start))
        res = {"CPU": float(flags["num-cpus"]), "GPU": float(flags.get("num-gpus", 0))}
        if "resources" in flags:
            res.update({k: float(v) for k, v in json.loads(shlex.split(flags["resources"])[0]).items()})
        hosts[kind] = res
    return hosts


def _request(actor_options: dict) -> dict[str, float]:
    req = {"CPU": actor_options.get("num_cpus", 0), "GPU": actor_options.get("num_gpus", 0)}
    if actor_options.get("memory"):
        req["memory"] = actor_options["memory"]
    req.update(actor_options.get("resources", {}))
    return req


def _requests(args: AppArgs) -> dict[str, dict[str, float]]:
    return {name: _request(cfg.resources.actor_options())
            for name, cfg in (("ingress", args.ingress), ("frontend", args.frontend), ("synthesizer", args.synthesizer))}


def _fits(req: dict[str, float], have: dict[str, float]) -> bool:
    return all(have.get(k, 0) >= v for k, v in req.items())


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_file_passes_the_launchers_validation_and_starts_every_host(name):
    prepared = _launcher_view(CLUSTERS[name])
    raw = _load(CLUSTERS[name])
    # The local provider gives its one node type no resources: the autoscaler could not start a host
    # for a replica's demand, so every host must be started up front.
    (node_type,) = prepared["available_node_types"].values()
    hosts = len(raw["provider"]["worker_ips"])
    assert node_type["resources"] == {} and node_type["min_workers"] == node_type["max_workers"] == hosts
    # Ray token auth on every node, the dashboard (Jobs API) not on all interfaces.
    for kind in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "RAY_AUTH_MODE=token" in " ".join(raw[kind])
    assert "dashboard-host=0.0.0.0" not in " ".join(raw["head_start_ray_commands"])
    assert "/home/ray/.ray/auth_token" in raw["file_mounts"]


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_replica_fits_a_host_of_every_cluster_file(cluster, path):
    hosts = _declared_hosts(_load(CLUSTERS[cluster]))
    for name, req in _requests(AppArgs.from_file(path)).items():
        assert set(req) <= STANDARD | set().union(*hosts.values()), f"{name} requests an undeclared resource: {req}"
        assert any(_fits(req, have) for have in hosts.values()), f"{name} requests {req}, no host declares it: {hosts}"


def test_production_configs_run_on_what_their_cluster_installs():
    pytorch = AppArgs.from_file(ROOT / "configs/production.yaml")
    assert pytorch.synthesizer.mode == "pytorch" and pytorch.synthesizer.dtype == "bfloat16"
    assert pytorch.synthesizer.cuda_graphs
    plain = " ".join(_load(CLUSTERS["cluster.yaml"])["setup_commands"])
    assert "pip install -q -e ." in plain and "[trt]" not in plain
    trt = AppArgs.from_file(ROOT / "configs/production-trt.yaml")
    cluster = _launcher_view(CLUSTERS["cluster-trt.yaml"])
    assert trt.synthesizer.mode == "trt" and "'.[trt]'" in " ".join(cluster["setup_commands"])
    build = " ".join(_load(CLUSTERS["cluster-trt.yaml"])["worker_setup_commands"])
    flags = dict(re.findall(r"--([\w-]+)\s+([^-\s]\S*)", build))
    assert build.startswith("fastcosy build-trt") and "--fp16" in build and trt.synthesizer.dtype == "float16"
    assert flags["out"] == trt.synthesizer.trt_plan_dir and flags["model-dir"] == trt.model_dir
    assert int(flags["max-batch"]) >= trt.synthesizer.token2wav.max_batch_size
    for args, name in ((pytorch, "cluster.yaml"), (trt, "cluster-trt.yaml")):
        hosts = _load(CLUSTERS[name])
        # One synthesizer replica per GPU host; max_replicas never exceeds the GPU hosts.
        assert args.synthesizer.resources.num_gpus == 1
        assert args.synthesizer.autoscaling.max_replicas <= len(hosts["provider"]["worker_ips"])
        # The keys file the ingress requires is copied to every host.
        assert args.ingress.auth.required and args.ingress.auth.keys_file in hosts["file_mounts"]


def test_production_configs_differ_only_in_the_execution_mode():
    pytorch = application_of(_load(ROOT / "configs/production.yaml"))["args"]
    trt = application_of(_load(ROOT / "configs/production-trt.yaml"))["args"]
    assert {k: v for k, v in trt.items() if k != "synthesizer"} == {k: v for k, v in pytorch.items() if k != "synthesizer"}
    changed = {k for k in set(pytorch["synthesizer"]) | set(trt["synthesizer"])
               if pytorch["synthesizer"].get(k) != trt["synthesizer"].get(k)}
    assert changed == {"dtype", "mode", "trt_plan_dir"}


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


# What one replica does, against what places it in a fleet (how many, where, how it starts and
# stops) and the TensorRT variant's own mode and precision.
FLEET_KEYS = {"model_dir", "num_replicas", "autoscaling", "resources", "health_check_period_s",
              "health_check_timeout_s", "graceful_shutdown_timeout_s", "startup_timeout_s"}
TRT_KEYS = {"mode", "trt_plan_dir", "dtype"}


@pytest.mark.parametrize("path", [ROOT / "configs/multi-gpu.yaml", ROOT / "configs/production.yaml",
                                  ROOT / "configs/production-trt.yaml", ROOT / "deploy/docker/single-gpu.yaml"],
                         ids=lambda p: p.name if p.parent.name == "configs" else f"docker-{p.name}")
def test_every_gpu_config_runs_the_measured_replica(path):
    """configs/single-gpu.yaml is the config the capacity figures measure (README, Performance):
    a GPU config a user can start runs its replica with the same settings, so each figure holds
    for it (issue 39: every GPU config measured or made identical to a measured one)."""
    measured = AppArgs.from_file(ROOT / "configs/single-gpu.yaml").synthesizer.model_dump()
    other = AppArgs.from_file(path).synthesizer.model_dump()
    skip = FLEET_KEYS | (TRT_KEYS if other["mode"] == "trt" else set())
    differ = {k: (measured[k], other[k]) for k in measured if k not in skip and measured[k] != other[k]}
    assert differ == {}


def test_the_docker_image_serves_the_measured_cpu_tier():
    """The Docker image's config is a user's one-GPU service: its ingress and frontend queue as the
    measured config's do (it had half their limits, never measured), so the serve-level figures hold
    for it; only API keys (on in the container) and the CPU reservations differ."""
    measured, docker = AppArgs.from_file(ROOT / "configs/single-gpu.yaml"), AppArgs.from_file(ROOT / "deploy/docker/single-gpu.yaml")
    for section in ("ingress", "frontend"):
        a, b = getattr(measured, section).model_dump(), getattr(docker, section).model_dump()
        differ = {k: (a[k], b[k]) for k in a if k not in FLEET_KEYS | {"auth"} and a[k] != b[k]}
        assert differ == {}, section
    assert docker.ingress.auth.required and not measured.ingress.auth.required


# ------------------------------------------------------------------ scale-in drain (issue 40)
def test_drain_covers_the_longest_call_the_ingress_admits():
    """4096 Han characters at 4.5 a second, at model speed 0.5: 1820.4 s of audio, made at least in
    real time; times the 1.25 margin, 2276 s (docs/tuning.md, "Scale-in")."""
    from serve_app.args import DRAIN_MARGIN, longest_call_audio_s, min_drain_s

    assert longest_call_audio_s(4096) == pytest.approx(4096 / 4.5 / 0.5)
    assert min_drain_s(4096) == 2276 and DRAIN_MARGIN == 1.25
    assert min_drain_s(100) < min_drain_s(4096)


@pytest.mark.parametrize("path", [*CONFIGS, ROOT / "deploy/docker/single-gpu.yaml"], ids=lambda p: p.name)
def test_every_config_drains_its_longest_call(path):
    from serve_app.args import min_drain_s

    args = AppArgs.from_file(path)
    assert args.synthesizer.graceful_shutdown_timeout_s >= min_drain_s(args.ingress.max_input_chars)


@pytest.mark.parametrize("drain", [20, 60, 120])  # the default and what the configs had before issue 40
def test_a_drain_shorter_than_the_longest_call_is_an_error(drain):
    with pytest.raises(ValidationError, match="graceful_shutdown_timeout_s"):
        AppArgs.model_validate({"synthesizer": {"graceful_shutdown_timeout_s": drain}})
    # the same drain is enough for an ingress that admits only short inputs
    short = AppArgs.model_validate({"ingress": {"max_input_chars": 30},  # 17 s
                                    "synthesizer": {"graceful_shutdown_timeout_s": drain}})
    assert short.synthesizer.graceful_shutdown_timeout_s == drain


def test_an_unset_drain_is_derived_from_the_ingress_limit():
    from deployments.synthesizer_config import SynthesizerConfig
    from serve_app.args import min_drain_s

    assert AppArgs().synthesizer.graceful_shutdown_timeout_s == min_drain_s(4096)
    assert AppArgs.model_validate({"ingress": {"max_input_chars": 1000}}).synthesizer.graceful_shutdown_timeout_s \
        == min_drain_s(1000)
    built = AppArgs(synthesizer=SynthesizerConfig(device="cpu"))  # an object, not a dict
    assert built.synthesizer.graceful_shutdown_timeout_s == min_drain_s(4096)
    assert built.synthesizer.serve_options("Synthesizer")["graceful_shutdown_timeout_s"] == min_drain_s(4096)
