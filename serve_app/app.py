"""Composition root: ``build_app(args)`` is the only place deployments are bound.

Serve config: ``import_path: serve_app.app:build_app`` with ``args:`` validated as
:class:`~serve_app.args.AppArgs` (Serve calls ``model_validate`` on the annotated parameter).

Graph::

    TTSIngress (HTTP, CPU) --handle--> TextFrontend (CPU, autoscaled)
                           --handle--> Synthesizer  (GPU: engine loop + @serve.batch token2wav)
"""
from __future__ import annotations

import logging

from ray import serve
from ray.serve import Application

from deployments.frontend import TextFrontend
from deployments.synthesizer import Synthesizer
from serve_app.args import AppArgs
from serve_app.ingress import TTSIngress

logger = logging.getLogger(__name__)


def build_app(args: AppArgs) -> Application:
    """Bind the three deployments with options computed from ``args``."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    frontend_opts = TextFrontend.deployment_options(args.frontend)
    synth_opts = Synthesizer.deployment_options(args.synthesizer)
    ingress_opts = TTSIngress.deployment_options(args.ingress)
    for opts in (ingress_opts, frontend_opts, synth_opts):
        logger.info("deployment options: %s", opts)
    source = args.model_source()  # resolved on each replica's node (the tiny default is generated there)
    frontend = serve.deployment(TextFrontend, **frontend_opts).bind(args.frontend, source)
    synthesizer = serve.deployment(Synthesizer, **synth_opts).bind(args.synthesizer, source)
    ingress_cfg = args.ingress
    if ingress_cfg.max_prompt_audio_s is None:  # uploads are refused from their header at the frontend's limit
        ingress_cfg = ingress_cfg.model_copy(update={"max_prompt_audio_s": args.frontend.max_prompt_audio_s})
    return serve.deployment(serve.ingress()(TTSIngress), **ingress_opts).bind(ingress_cfg, frontend, synthesizer)


def build_app_from_file(path: str, app_name: str | None = None) -> Application:
    """Convenience for scripts/tests: ``build_app(AppArgs.from_file(path))``."""
    return build_app(AppArgs.from_file(path, app_name))
