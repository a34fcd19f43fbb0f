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

from tests.ray_env import SERVE_PROXY_TIMERS

# Serve's proxy timers a loaded runner needs (tests/ray_env.py), set before Ray starts: its
# processes inherit the environment
for _timer, _value in SERVE_PROXY_TIMERS.items():
    os.environ.setdefault(_timer, _value)

APP_NAME = "tts"

# Injected fakes (runtime_factory) keep this suite about the serving layer: engine contract
# (slots, abort), hop schedule and batching are real; the model math is not.
TEST_ARGS = {
    "ingress": {"num_replicas": 1, "max_ongoing_requests": 64, "max_queued_requests": 64,
                "resources": {"num_cpus": 0.1}, "max_input_chars": 2000, "health_refresh_s": 1.0},
    "frontend": {"num_replicas": 1, "max_ongoing_requests": 32, "max_queued_requests": 64,
                 "resources": {"num_cpus": 0.1}, "runtime_factory": "tests.deployments.fakes:fake_frontend_runtime"},
    "synthesizer": {"num_replicas": 1, "max_running": 4, "max_ongoing_requests": 4, "max_queued_requests": 4,
                    "retry_after_s": 3, "device": "cpu", "resources": {"num_cpus": 0.2},
                    "token2wav": {"max_batch_size": 4, "batch_wait_timeout_s": 0.02},
                    "runtime_factory": "tests.deployments.fakes:fake_synthesis_runtime"},
}


def pytest_addoption(parser):
    parser.addoption("--playground-screenshot", default=None, metavar="PATH",
                     help="where the playground browser test saves its screenshot (README: docs/playground.png); "
                          "default: the test's temporary directory")


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
    import httpx
    from ray import serve

    from serve_app.app import build_app
    from serve_app.args import AppArgs
    from tests.integration.waiting import wait_for

    handle = serve.run(build_app(AppArgs.model_validate(TEST_ARGS)), name=APP_NAME, route_prefix="/")
    base = ray_session["base_url"]
    # /health answers the background probe's last status: "starting" (503) until the first one lands
    wait_for(lambda: httpx.get(f"{base}/health", timeout=30).status_code == 200, "the first health probe")
    yield {
        "handle": handle,
        "synth": serve.get_deployment_handle("Synthesizer", app_name=APP_NAME),
        "base_url": ray_session["base_url"],
    }


def sine_wav(seconds: float = 3.0, rate: int = 16000) -> bytes:
    """A WAV prompt clip (a 180 Hz tone): what the tiny model's prompt encoder takes as a voice."""
    import io

    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


def _serve_tiny(base_url: str, name: str, model_dir, voices_dir, synthesizer: dict) -> dict:
    """The app with the REAL runtime on ``model_dir`` as application ``name`` (route prefix
    /``name``), with a voice "tiny" registered from :func:`sine_wav`."""
    import httpx
    from ray import serve

    from serve_app.app import build_app
    from serve_app.args import AppArgs

    args = AppArgs.model_validate({
        "model_dir": str(model_dir),
        "ingress": {"num_replicas": 1, "resources": {"num_cpus": 0.1}},
        "frontend": {"num_replicas": 1, "resources": {"num_cpus": 0.1}, "voices_dir": str(voices_dir)},
        "synthesizer": {"num_replicas": 1, "device": "cpu", "max_running": 4, "max_ongoing_requests": 4,
                        "max_model_len": 1024, "resources": {"num_cpus": 0.2}, **synthesizer,
                        "token2wav": {"max_batch_size": 4, **synthesizer.get("token2wav", {})}},
    })
    prefix = f"/{name}"
    serve.run(build_app(args), name=name, route_prefix=prefix)
    url = base_url + prefix
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": "tiny", "prompt_text": "A prompt transcript."},
                   files={"audio": ("p.wav", sine_wav(), "audio/wav")}, timeout=60)
    assert r.status_code == 201, r.text
    assert r.json()["num_prompt_tokens"] == 75
    return {"url": url, "synth": serve.get_deployment_handle("Synthesizer", app_name=name), "model_dir": model_dir}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("model") / "tiny-cosyvoice2", "cosyvoice2")


@pytest.fixture(scope="session")
def tiny_app(ray_session, tiny_model_dir, tmp_path_factory):
    """The app with the REAL runtime (tiny random-weight model) as a second application (route
    prefix /tiny), started once for the session's modules that use it (test_tiny_*), with a voice
    "tiny" registered. Its synthesizer runs a CPU replica's default plan."""
    from ray import serve

    yield _serve_tiny(ray_session["base_url"], "tiny", tiny_model_dir, tmp_path_factory.mktemp("voices"), {})
    serve.delete("tiny")


@pytest.fixture(scope="session")
def tiny_cuda_plan_app(ray_session, tiny_model_dir, tmp_path_factory):
    """The same model and voice as :func:`tiny_app` (application "tinycuda", route prefix /tinycuda),
    its synthesizer running the CUDA replica's default plan on the CPU (stepped token2wav,
    incremental flow, two stage threads; tests/deployments/plans.py)."""
    from ray import serve

    from tests.deployments.plans import cuda_default_overrides

    yield _serve_tiny(ray_session["base_url"], "tinycuda", tiny_model_dir, tmp_path_factory.mktemp("voices"), cuda_default_overrides())
    serve.delete("tinycuda")


def replica_ongoing(app: str, deployment: str) -> dict[str, int]:
    """Requests inside each live replica of ``deployment`` (Serve's own count, read from the replica
    actors: unlike a handle call, it answers while the replica's slots are all taken)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return {name: ray.get(ray.get_actor(name, namespace="serve").get_num_ongoing_requests.remote(), timeout=30)
            for name in names}


def fake_samples(text: str) -> int:
    """The samples the fake runtime (tests/deployments/fakes.py) makes for ``text``."""
    from tests.deployments import fakes

    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


def register_default_voice(url: str) -> None:
    """Voice 'default' (what OpenAI's built-in names alias to) on the app at ``url``."""
    import httpx

    from tests.integration.test_serve_ray import _prompt_wav

    r = httpx.post(f"{url}/v1/voices", data={"voice_id": "default", "prompt_text": "hello", "overwrite": "true"},
                   files={"audio": ("a.wav", _prompt_wav(), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
