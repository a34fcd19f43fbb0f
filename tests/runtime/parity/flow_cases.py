"""Parity of the flow (token -> mel), stage by stage: spks, mu, cond, noise, t per step, the
estimator at the first and last step, the CFM output and the mel.

Everything the run depends on comes from the case: inputs from its tensors, ``streaming`` /
``finalize`` / ``n_timesteps`` / ``inference_cfg_rate`` from its params, the model from its
model directory. Every stored tensor is either an input or compared; an unknown one fails.
"""
from __future__ import annotations

import dataclasses
import functools

from cosyvoice_runtime.flow.flow import Flow, build_flow
from cosyvoice_runtime.weights import load_checkpoint
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import ParityCase, assert_matches, checker

INPUTS = ("token", "prompt_token", "prompt_feat", "embedding")
# Intermediates the flow trace provides under the case's tensor names, compared in this order
# (stages first, so a failure points at the earliest stage that differs).
STAGES = ("spks", "mu", "cond", "noise", "t_steps", "est0_out", "est_last_x", "est_last_out", "feat_full")
# Stages without a tolerance entry of their own: cond is the prompt mel copied verbatim, t a
# value of the time grid (both as tight as spks); est_last_x is the ODE state like feat_full.
FALLBACK_TOL = {"cond": "spks", "t_steps": "spks", "est_last_x": "feat_full"}


@functools.lru_cache(maxsize=8)
def _flow(model_dir: str, n_timesteps: int | None, cfg_rate: float | None) -> Flow:
    spec = read_model_spec(model_dir).flow
    overrides = {k: v for k, v in (("n_timesteps", n_timesteps), ("inference_cfg_rate", cfg_rate)) if v is not None}
    flow = build_flow(dataclasses.replace(spec, **overrides))
    load_checkpoint(flow, f"{model_dir}/{read_model_spec(model_dir).files['flow']}")
    return flow.eval()


def _tol_key(case: ParityCase, name: str) -> str:
    return name if name in case.meta.get("tolerance", {}) else FALLBACK_TOL.get(name, "mel")


@checker("flow_nonstream", "flow_stream_finalize", "flow_stream_chunk")
def check_flow(case: ParityCase) -> None:
    p = case.params
    flow = _flow(str(case.model_dir), p.get("n_timesteps"), p.get("inference_cfg_rate"))
    unknown = sorted(set(case.tensors) - set(INPUTS) - set(STAGES) - {"mel"})
    assert not unknown, f"{case.id}: stored tensors this checker does not know how to compare: {unknown}"

    trace: dict = {}
    mel = flow.inference(token=case.t("token"), prompt_token=case.t("prompt_token"), prompt_feat=case.t("prompt_feat"),
                         embedding=case.t("embedding"), streaming=bool(p["streaming"]), finalize=bool(p["finalize"]),
                         trace=trace)
    for name in STAGES:
        if name in case.tensors:
            assert_matches(case, name, trace[name], tol_key=_tol_key(case, name))
    assert_matches(case, "mel", mel)
    # T_mel_total covers prompt + generated frames (look-ahead context excluded when not finalizing).
    if "T_mel_total" in p:
        assert trace["mu"].shape[2] == p["T_mel_total"]
    if "prompt_mel_frames" in p and "T_mel_total" in p:
        assert mel.shape[2] == p["T_mel_total"] - p["prompt_mel_frames"]
