"""Token -> mel for both families (spec §4.1, §4.3): token front + CFM over an estimator.

``CausalMaskedDiffWithXvec`` (CV2: conformer encoder + projection + U-Net) and
``CausalMaskedDiffWithDiT`` (CV3: pre-look-ahead conv, x2 repetition + DiT) share one
``inference`` with the official argument meaning; parameter names are the official keys.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import FlowSpec
from cosyvoice_runtime.flow.cfm import CFMSolver
from cosyvoice_runtime.flow.dit import DiT
from cosyvoice_runtime.flow.encoder import PreLookaheadLayer, UpsampleConformerEncoder
from cosyvoice_runtime.flow.unet import CausalUNet


class Flow(nn.Module):
    def __init__(self, spec: FlowSpec) -> None:
        super().__init__()
        self.spec = spec
        self.input_embedding = nn.Embedding(spec.vocab_size, spec.input_size)
        self.spk_embed_affine_layer = nn.Linear(spec.spk_embed_dim, spec.output_size)
        if spec.family == "cosyvoice2":
            self.encoder = UpsampleConformerEncoder(spec.encoder)
            self.encoder_proj = nn.Linear(spec.encoder.output_size, spec.output_size)
            estimator: nn.Module = CausalUNet(spec.unet)
        else:
            self.pre_lookahead_layer = PreLookaheadLayer(spec.input_size, spec.pre_lookahead_channels,
                                                         spec.pre_lookahead_len)
            estimator = DiT(spec.dit)
        self.decoder = CFMSolver(spec, estimator)

    @property
    def estimator(self) -> nn.Module:
        return self.decoder.estimator

    def encode(self, tokens: torch.Tensor, finalize: bool, streaming: bool) -> torch.Tensor:
        """(1, L + N) token ids -> mu (1, 80, frames); the last look-ahead tokens are context only
        when not finalizing."""
        emb = self.input_embedding(tokens.clamp(min=0).long())
        la = self.spec.pre_lookahead_len
        context = None
        if not finalize:
            emb, context = emb[:, :-la], emb[:, -la:]
        if self.spec.family == "cosyvoice2":
            pad = torch.ones(emb.shape[0], 1, emb.shape[1], dtype=torch.bool, device=emb.device)
            h = self.encoder_proj(self.encoder(emb, pad, context=context, streaming=streaming))
        else:
            h = self.pre_lookahead_layer(emb, context=context).repeat_interleave(self.spec.token_mel_ratio, dim=1)
        return h.transpose(1, 2)

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True,
                  trace: dict | None = None) -> torch.Tensor:
        """Mel of the generated tokens.

        Args:
            token: (1, N) speech ids; prompt_token: (1, L); prompt_feat: (1, 2L, 80) frames-major;
            embedding: (1, 192) raw speaker embedding.
            streaming: chunk attention masks; finalize: False treats the last 3 tokens as context.
            trace: receives mu, spks, cond and the solver intermediates (parity tests).

        Returns:
            (1, 80, frames - 2L) float32.
        """
        dtype = self.spk_embed_affine_layer.weight.dtype
        spks = self.spk_embed_affine_layer(F.normalize(embedding.to(dtype), dim=1))
        tokens = torch.cat([prompt_token, token], dim=1).to(self.input_embedding.weight.device)
        mu = self.encode(tokens, finalize, streaming)
        total = mu.shape[2]
        n_prompt = prompt_feat.shape[1]
        cond = torch.zeros(1, self.spec.output_size, total, device=mu.device, dtype=mu.dtype)
        cond[:, :, :n_prompt] = prompt_feat.transpose(1, 2).to(mu)
        mask = torch.ones(1, 1, total, device=mu.device, dtype=mu.dtype)
        if trace is not None:
            trace.update(mu=mu.clone(), spks=spks.clone(), cond=cond.clone())
        feat = self.decoder(mu, mask, spks, cond, streaming=streaming, trace=trace)
        if trace is not None:
            trace["feat_full"] = feat.clone()
        return feat[:, :, n_prompt:]


def build_flow(spec: FlowSpec) -> Flow:
    """The flow module for ``spec`` (random init; load ``flow.pt`` with ``weights.load_checkpoint``)."""
    return Flow(spec)
