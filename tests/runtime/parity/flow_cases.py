"""Parity of the flow (token -> mel), stage by stage: spks, mu, cond, noise, estimator, CFM, mel."""
from __future__ import annotations

import functools

import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.flow.flow import Flow, build_flow
from cosyvoice_runtime.weights import load_checkpoint
from tests.runtime.parity.common import ParityCase, assert_matches, checker

# case tensor name -> trace key (the names are the same; listed to state what is compared)
STAGES = ("spks", "mu", "cond", "noise", "t_steps", "est0_out", "est_last_x", "est_last_out", "feat_full")


@functools.lru_cache(maxsize=4)
def _flow(model_dir: str) -> Flow:
    spec = ModelSpec.from_model_dir(model_dir)
    flow = build_flow(spec.flow)
    load_checkpoint(flow, f"{model_dir}/{spec.files['flow']}")
    return flow.eval()


def _tol_key(case: ParityCase, name: str) -> str:
    tol = case.meta.get("tolerance", {})
    if name in tol:
        return name
    # stages without their own entry: inputs copied verbatim or intermediates of the mel
    return {"cond": "spks", "est_last_x": "feat_full", "t_steps": "spks"}.get(name, "mel")


@checker("flow_nonstream", "flow_stream_finalize", "flow_stream_chunk")
def check_flow(case: ParityCase) -> None:
    flow = _flow(str(case.model_dir))
    p = case.params
    trace: dict = {}
    mel = flow.inference(token=case.t("token"), prompt_token=case.t("prompt_token"), prompt_feat=case.t("prompt_feat"),
                         embedding=case.t("embedding"), streaming=bool(p["streaming"]), finalize=bool(p["finalize"]),
                         trace=trace)
    compared = 0
    for name in STAGES:
        if name in case.tensors:
            assert_matches(case, name, trace[name], tol_key=_tol_key(case, name))
            compared += 1
    assert_matches(case, "mel", mel)
    assert compared >= 2, f"{case.id}: the case stores almost no intermediates"
    # T_mel_total covers prompt + generated frames
    assert trace["mu"].shape[2] == p["T_mel_total"] and mel.shape[2] == p["T_mel_total"] - p["prompt_mel_frames"]

