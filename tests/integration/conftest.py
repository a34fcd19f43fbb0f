"""Real local Ray for the serving tests: one ``ray.init`` and one ``serve.run`` per session.

Pattern of ray-serve-notes §6: logical CPUs above the machine's 2 cores (deployments ask for
fractions), dashboard off, token auth off, a free HTTP port on 127.0.0.1, and ``ray.shutdown()``
without ``serve.shutdown()`` (saves ~5 s).
"""
from __future__ import annotations

import os
import socket

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # before Ray starts anything
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest

APP_NAME = "tts"

# Injected fakes (runtime_factory) keep this suite about the serving layer: engine contract
# (slots, abort), hop schedule and batching are real; the model math is not.
TEST_ARGS = {
    "ingress": {"num_replicas": 1, "max_ongoing_requests": 64, "max_queued_requests": 64,
                "resources": {"num_cpus": 0.1}, "max_input_chars": 2000},
    "frontend": {"num_replicas": 1, "max_ongoing_requests": 32, "max_queued_requests": 64,
                 "resources": {"num_cpus": 0.1}, "runtime_factory": "tests.deployments.fakes:fake_frontend_runtime"},
    "synthesizer": {"num_replicas": 1, "max_running": 4, "max_ongoing_requests": 4, "max_queued_requests": 4,
                    "retry_after_s": 3, "device": "cpu", "resources": {"num_cpus": 0.2},
                    "token2wav": {"max_batch_size": 4, "batch_wait_timeout_s": 0.02},
                    "runtime_factory": "tests.deployments.fakes:fake_synthesis_runtime"},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_session():
    import ray
    from ray import serve

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=256 * 1024**2,
             namespace="tests", runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield {"base_url": f"http://127.0.0.1:{port}"}
    ray.shutdown()


@pytest.fixture(scope="session")
def tts_app(ray_session):
    from ray import serve

    from serve_app.app import build_app
    from serve_app.args import AppArgs

    handle = serve.run(build_app(AppArgs.model_validate(TEST_ARGS)), name=APP_NAME, route_prefix="/")
    yield {
        "handle": handle,
        "synth": serve.get_deployment_handle("Synthesizer", app_name=APP_NAME),
        "base_url": ray_session["base_url"],
    }


def replica_ongoing(app: str, deployment: str) -> dict[str, int]:
    """Requests inside each live replica of ``deployment`` (Serve's own count, read from the replica
    actors: unlike a handle call, it answers while the replica's slots are all taken)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return {name: ray.get(ray.get_actor(name, namespace="serve").get_num_ongoing_requests.remote(), timeout=30)
            for name in names}
