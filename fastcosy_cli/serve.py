"""``fastcosy serve``: run a serve config locally, or deploy it to a running Ray cluster.

Local (default): starts an in-process Ray (dashboard off unless ``--dashboard``), starts Serve
with the config's ``proxy_location`` / ``http_options``, runs ``build_app(args)`` and blocks
until SIGINT/SIGTERM, then shuts Serve and Ray down. It prints how to call the service.

Cluster (``--address http://HEAD:8265``): validates the config here (so a typo fails before
anything is sent), then submits it to the cluster's Serve REST API, as ``serve deploy`` does;
Serve applies it in place (changed ``args`` roll the replicas).

Both paths validate the whole config with :class:`~serve_app.args.AppArgs` first.
"""
from __future__ import annotations

import argparse
import copy
import logging
import shlex
import signal
import threading
from typing import Any, Protocol

from deployments import constants
from fastcosy_cli.common import CliError, LoadedConfig, load_serve_config, out

logger = logging.getLogger(__name__)

EXAMPLE_TEXT = "Hello world."
EXAMPLE_VOICE = "default"


class ServeBackend(Protocol):
    """What the command needs from Ray; tests substitute a fake."""

    def start_local(self, cfg: LoadedConfig, num_cpus: float | None, dashboard: bool) -> None: ...
    def wait(self) -> None: ...
    def shutdown(self) -> None: ...
    def deploy(self, address: str, document: dict[str, Any]) -> None: ...


class RayBackend:
    """The real thing (imports Ray only when used)."""

    def __init__(self) -> None:
        self._stop = threading.Event()

    def start_local(self, cfg: LoadedConfig, num_cpus: float | None, dashboard: bool) -> None:
        import ray
        from ray import serve

        from serve_app.app import build_app

        runtime_env = cfg.app.get("runtime_env") or None
        ray.init(num_cpus=num_cpus, include_dashboard=dashboard, namespace="serve", runtime_env=runtime_env,
                 log_to_driver=True, _system_config=constants.RAY_SYSTEM_CONFIG)
        http = dict(cfg.document.get("http_options") or {})
        serve.start(proxy_location=cfg.document.get("proxy_location", "HeadOnly"), http_options=http)
        if cfg.app.get("deployments"):
            logger.warning("applications[].deployments overrides are not applied by a local run; put the settings "
                           "under args (AppArgs), or deploy with --address where Serve applies them")
        serve.run(build_app(cfg.args), name=cfg.app.get("name", "default"),
                  route_prefix=cfg.app.get("route_prefix", "/"), blocking=False)

    def wait(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self._stop.set())
        while not self._stop.wait(1.0):
            pass

    def shutdown(self) -> None:
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def deploy(self, address: str, document: dict[str, Any]) -> None:
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

        try:
            ServeSubmissionClient(address).deploy_applications(document)
        except Exception as exc:  # noqa: BLE001 - connection refused, auth, version: all reported the same way
            raise CliError(f"could not deploy to {address}: {exc}{deploy_hint(str(exc), constants.ray_auth_mode())} "
                           f"(check with: fastcosy doctor --ray-address {address})") from None


def deploy_hint(error: str, auth_mode: str | None) -> str:
    """What to do about a failed deploy that Ray's own message leaves out: Ray 2.60's client
    sends the cluster's token only with ``RAY_AUTH_MODE=token`` in its own environment."""
    if ("401" in error or "nauthori" in error) and (auth_mode or "").lower() != "token":
        return (f"; the cluster asks for Ray's token and this shell does not send it: set RAY_AUTH_MODE=token "
                f"(RAY_AUTH_MODE is {auth_mode or 'unset'} here; the token comes from $RAY_AUTH_TOKEN or "
                "~/.ray/auth_token)")
    return ""


def status_command(address: str, auth_mode: str | None) -> str:
    """The ``serve status`` line to print after a deploy, runnable as printed: a token cluster
    needs ``RAY_AUTH_MODE=token`` on each command, not only on the one that deployed."""
    prefix = "RAY_AUTH_MODE=token " if (auth_mode or "").lower() == "token" else ""
    return f"{prefix}serve status --address {address}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the service locally from a serve config, or deploy it to a cluster")
    p.add_argument("--config", required=True, help="serve config (configs/local.yaml) or a bare AppArgs file")
    p.add_argument("--app", help="application name, when the config holds several build_app applications")
    p.add_argument("--address", help="deploy to the running cluster whose dashboard is here (http://HEAD:8265) "
                   "instead of starting locally")
    p.add_argument("--host", help="override http_options.host (0.0.0.0 inside a container)")
    p.add_argument("--port", type=int, help="override http_options.port")
    p.add_argument("--model-dir", help="override args.model_dir")
    p.add_argument("--num-cpus", type=float, help="logical CPUs of the local Ray (default: detected)")
    p.add_argument("--dashboard", action="store_true", help="start the Ray dashboard locally (~0.9 GiB; needed for "
                   "`serve status`)")
    p.set_defaults(func=run)


def apply_overrides(cfg: LoadedConfig, host: str | None, port: int | None, model_dir: str | None) -> LoadedConfig:
    """A copy of ``cfg`` with command-line overrides, re-validated."""
    doc = copy.deepcopy(cfg.document)
    http = doc.setdefault("http_options", {})
    if host:
        http["host"] = host
    if port:
        http["port"] = port
    from serve_app.args import AppArgs, application_of

    app = application_of(doc, cfg.app.get("name"))
    if model_dir:
        app.setdefault("args", {})["model_dir"] = model_dir
    return LoadedConfig(path=cfg.path, document=doc, app=app, args=AppArgs.model_validate(app.get("args") or {}))


def _served_family(cfg: LoadedConfig) -> str:
    args = cfg.args
    model_dir = args.configured_model_dir
    if model_dir:
        from pathlib import Path

        from fastcosy_cli.doctor_checks import detect_family

        return detect_family(Path(model_dir)) or "cosyvoice2"
    return args.tiny_family or "cosyvoice2"


def usage_banner(cfg: LoadedConfig) -> str:
    """How to call the service that ``cfg`` starts (printed once it is up)."""
    http = cfg.document.get("http_options") or {}
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    prefix = (cfg.app.get("route_prefix") or "/").rstrip("/")
    base = f"http://{host}:{http.get('port', 8000)}{prefix}"
    args = cfg.args
    model = args.ingress.model_names[0] if args.ingress.model_names else _served_family(cfg)
    tiny = not args.configured_model_dir
    body = f'{{"model": "{model}", "input": "{EXAMPLE_TEXT}", "voice": "{EXAMPLE_VOICE}", "response_format": "wav"}}'
    lines = [f"FastCosyVoice is serving at {base}"]
    if tiny:
        lines.append(f"  model: the tiny RANDOM-WEIGHT {args.tiny_family} model: valid audio, NOT speech "
                     "(set model_dir for a real model)")
    lines += [
        f"  in a browser: {base}/playground (play as it is made, register voices, text-in streaming)",
        ("  register your own voice (a 3-10 s prompt recording and its transcript; the tiny model "
         f"already has '{EXAMPLE_VOICE}'):"),
        (f"    curl -s {base}/v1/voices -F voice_id=myvoice -F prompt_text='<transcript>' "
         "-F audio=@prompt.wav"),
        "  synthesize to a WAV file:",
        f"    curl -s {base}/v1/audio/speech -H 'Content-Type: application/json' \\",
        f"      -d {shlex.quote(body)} -o hello.wav",
        f"  or: fastcosy synth --url {base} --voice {EXAMPLE_VOICE} '{EXAMPLE_TEXT}' -o hello.wav",
        f"  health: curl -s {base}/health   metrics: curl -s {base}/metrics",
        "  stop: Ctrl-C",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, backend: ServeBackend | None = None) -> int:
    cfg = load_serve_config(args.config, args.app)
    try:
        cfg = apply_overrides(cfg, args.host, args.port, args.model_dir)
    except ValueError as exc:  # pydantic ValidationError is a ValueError
        raise CliError(f"{args.config} with the command-line overrides does not validate:\n{exc}") from None
    backend = backend or RayBackend()
    if args.address:
        if constants.api_keys_env():
            logger.warning("%s is set in this shell: it does not reach the cluster's replicas, which read API keys "
                           "on their own node (ingress.auth.keys_file; docs/kuberay.md)", constants.ENV_API_KEYS)
        backend.deploy(args.address, cfg.document)
        name = cfg.app.get("name", "default")
        out(f"submitted {cfg.path} (application '{name}') to {args.address}")
        out(f"  watch it: {status_command(args.address, constants.ray_auth_mode())}")
        out("  then call it through the cluster's Serve proxy (port "
            f"{(cfg.document.get('http_options') or {}).get('port', 8000)}), e.g. POST /v1/audio/speech")
        return 0
    logger.info("starting %s locally (first start may write the tiny model and take a minute)", cfg.path)
    backend.start_local(cfg, args.num_cpus, args.dashboard)
    try:
        out(usage_banner(cfg))
        backend.wait()
    finally:
        out("shutting down")
        backend.shutdown()
    return 0
