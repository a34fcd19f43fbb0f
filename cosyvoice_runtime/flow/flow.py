"""Token -> mel for both families (spec §4.1, §4.3): token front + CFM over an estimator.

``CausalMaskedDiffWithXvec`` (CV2: conformer encoder + projection + U-Net) and
``CausalMaskedDiffWithDiT`` (CV3: pre-look-ahead conv, x2 repetition + DiT) share one
``inference`` with the official argument meaning; parameter names are the official keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import FlowSpec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.flow.cached_pass import plain_estimator
from cosyvoice_runtime.flow.cfm import CFMSolver
from cosyvoice_runtime.flow.dit import DiT
from cosyvoice_runtime.flow.encoder import PreLookaheadLayer, UpsampleConformerEncoder
from cosyvoice_runtime.flow.flow_cache import FlowCache
from cosyvoice_runtime.flow.incremental import IncrementalRow, IncrementalStepper
from cosyvoice_runtime.flow.stepper import FlowStepper, SolveRow
from cosyvoice_runtime.flow.unet import CausalUNet
from cosyvoice_runtime.host_copy import to_device

if TYPE_CHECKING:  # the wrappers are attached by cosyvoice_runtime.flow.graph_setup; never imported here
    from cosyvoice_runtime.flow.encoder_graphs import GraphedEncoder
    from cosyvoice_runtime.flow.graphs import GraphedSolver


class Flow(nn.Module):
    """Token-to-mel module of either family (official keys: ``input_embedding``,
    ``spk_embed_affine_layer``, CV2 ``encoder`` + ``encoder_proj`` / CV3 ``pre_lookahead_layer``,
    and ``decoder.estimator``).

    The module holds no per-request state; ``inference`` is one request, ``inference_batch``
    several requests in one CFM solve.
    """

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
        # Attached by flow.graph_setup.enable_flow_graphs: plain attributes (not submodules), so checkpoint
        # keys are unchanged.
        self.graphed_solver: GraphedSolver | None = None
        self.graphed_encoder: GraphedEncoder | None = None
        self.stepper: FlowStepper | None = None  # solves run step by step (start_rows); eager until enabled
        # incremental streamed solves (start_incremental_rows); exact-size and eager until enabled
        self.incremental: IncrementalStepper | None = None

    @property
    def estimator(self) -> nn.Module:
        return self.decoder.estimator

    def encode(self, items: list[FlowItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """mu (B, 80, T_max) and frame lengths (B,) for a batch of token sequences.

        Each item's sequence is ``prompt_token ++ token``; a non-final item's last look-ahead
        tokens are placed right after its output tokens as context (they produce no frames).
        """
        dev = self.input_embedding.weight.device
        n_out = self.output_tokens(items)
        if min(n_out) < 1:
            raise InvalidInputError("a flow job needs at least one token besides its look-ahead context")
        # the jobs' new tokens (host ints from the LLM) and the lengths: one queued copy each
        new = to_device(torch.cat([it.token.reshape(-1) for it in items]), dev).split([it.token.numel() for it in items])
        seqs = [torch.cat([it.prompt_token.reshape(-1).to(dev), t]) for it, t in zip(items, new)]
        lengths = to_device(torch.tensor(n_out), dev)
        t_ext = max(s.numel() for s in seqs)
        ids = torch.zeros(len(items), t_ext, dtype=torch.long, device=dev)
        valid = torch.zeros(len(items), t_ext, dtype=torch.bool, device=dev)
        for i, s in enumerate(seqs):
            ids[i, : s.numel()] = s.clamp(min=0)
            valid[i, : s.numel()] = True
        streaming = _streaming_flags(items, dev)
        if self.graphed_encoder is not None:
            h = self.graphed_encoder(ids, valid, lengths, streaming, max(n_out))
        else:
            h = self.encode_ids(ids, valid, lengths, streaming, max(n_out))
        return h.transpose(1, 2), lengths * self.spec.token_mel_ratio

    def output_tokens(self, items: list[FlowItem]) -> list[int]:
        """Tokens of each job that produce frames: all but a non-final job's look-ahead context."""
        la = self.spec.pre_lookahead_len
        return [it.prompt_token.numel() + it.token.numel() - (0 if it.finalize else la) for it in items]

    def encode_ids(self, ids: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor,
                   streaming: bool | torch.Tensor, n_keep: int) -> torch.Tensor:
        """The tensor part of :meth:`encode` (what the encoder graphs capture).

        ids / valid: (B, T_in) right-padded sequences; lengths: (B,) tokens with output; n_keep:
        tokens of output kept (>= max(lengths)). Returns (B, ratio * n_keep, 80).
        """
        emb = self.input_embedding(ids) * valid[..., None].to(self.input_embedding.weight.dtype)
        if self.spec.family == "cosyvoice2":
            return self.encoder_proj(self.encoder(emb, valid, lengths, streaming=streaming, n_keep=n_keep))
        h = self.pre_lookahead_layer(emb)[:, :n_keep]
        return h.repeat_interleave(self.spec.token_mel_ratio, dim=1)

    def _condition(self, items: list[FlowItem]) -> tuple[torch.Tensor, ...]:
        """The solver's inputs for a batch of jobs: mu, mask, cond (B, 80|1, T_max), spks (B, 80),
        and the frames of each job (a list)."""
        dev = self.spk_embed_affine_layer.weight.device
        spks = self._speakers(items)
        mu, frames = self.encode(items)
        n_frames = [n * self.spec.token_mel_ratio for n in self.output_tokens(items)]  # frames, known on the host
        b, _, total = mu.shape
        mask = (torch.arange(total, device=dev)[None, :] < frames[:, None])[:, None].to(mu.dtype)
        cond = torch.zeros(b, self.spec.output_size, total, device=dev, dtype=mu.dtype)
        for i, it in enumerate(items):
            n_prompt = it.prompt_feat.shape[1]
            if n_prompt > n_frames[i]:
                raise InvalidInputError(f"prompt mel of {n_prompt} frames is longer than the {n_frames[i]} flow frames")
            cond[i, :, :n_prompt] = it.prompt_feat[0].transpose(0, 1).to(mu)
        return mu * mask, mask, cond, spks, n_frames

    def _speakers(self, items: list[FlowItem]) -> torch.Tensor:
        """(B, 80): each job's speaker vector as the estimator takes it."""
        weight = self.spk_embed_affine_layer.weight
        emb = torch.cat([it.embedding.reshape(1, -1) for it in items]).to(weight.device, weight.dtype)
        return self.spk_embed_affine_layer(F.normalize(emb, dim=1))

    @torch.inference_mode()
    def inference_batch(self, items: list[FlowItem], trace: dict | None = None) -> list[torch.Tensor]:
        """One CFM solve for jobs of several requests (right-padded, per-item masks).

        Every item gets exactly what it would get alone: causal convolutions and key-padding
        masks keep padding out of valid frames, the fixed noise is indexed by absolute frame, and
        each item has its own prompt mel, speaker vector and streaming/final attention.

        Returns:
            per item (1, 80, frames_i - 2 L_i) float32.
        """
        if not items:
            return []
        mu, mask, cond, spks, n_frames = self._condition(items)
        dev = mu.device
        if trace is not None:
            trace.update(mu=mu.clone(), spks=spks.clone(), cond=cond.clone())
        solve = self.graphed_solver or self.decoder
        feat = solve(mu, mask, spks, cond, streaming=_streaming_flags(items, dev), trace=trace)
        if trace is not None:
            trace["feat_full"] = feat.clone()
        return [feat[i: i + 1, :, it.prompt_feat.shape[1]: n_frames[i]] for i, it in enumerate(items)]

    @torch.inference_mode()
    def start_rows(self, items: list[FlowItem], tags: list) -> list[SolveRow]:
        """Encode jobs (one batch) into rows at step 0 of :attr:`stepper`'s step-by-step solve.

        A finished row's mel is :meth:`row_mel`; it equals :meth:`inference_batch`'s.
        """
        if self.stepper is None:
            self.stepper = FlowStepper(self.decoder, use_graphs=False)
        mu, _, cond, spks, n_frames = self._condition(items)
        return [self.stepper.new_row(mu[i, :, :n], cond[i, :, :n], spks[i], bool(it.streaming), tag)
                for i, (it, n, tag) in enumerate(zip(items, n_frames, tags))]

    def _attention_chunk(self) -> int:
        """The estimator's attention chunk in mel frames (0: no chunk masks)."""
        est = self.spec.unet if self.spec.family == "cosyvoice2" else self.spec.dit
        return est.static_chunk_size

    @property
    def incremental_capable(self) -> bool:
        """Whether streamed jobs can be solved incrementally (:mod:`cosyvoice_runtime.flow.incremental`):
        chunk masks, and the PyTorch estimator (not a TensorRT engine; compiled by mode torchscript
        or not)."""
        return isinstance(plain_estimator(self.estimator), (CausalUNet, DiT)) and self._attention_chunk() > 0

    def can_solve_incrementally(self, item: FlowItem) -> bool:
        return self.incremental_capable and bool(item.streaming)

    def incremental_stepper(self) -> IncrementalStepper:
        """:attr:`incremental`, made (exact sizes, eager) on first use when the graphs did not attach one."""
        if self.incremental is None:
            self.incremental = IncrementalStepper(self.decoder)
        return self.incremental

    def prompt_prefix_frames(self, n_prompt_tokens: int) -> int:
        """Frames of a voice's prompt that every request with it shares in the incremental flow
        (:class:`~cosyvoice_runtime.flow.flow_cache.PromptPrefixes`): the last attention-chunk
        boundary at or before the prompt taken as a non-final job (its last look-ahead tokens as context)."""
        chunk = self._attention_chunk()
        frames = self.spec.token_mel_ratio * (n_prompt_tokens - self.spec.pre_lookahead_len)
        return max(0, frames) // chunk * chunk

    @torch.inference_mode()
    def start_incremental_rows(self, items: list[FlowItem], caches: list[FlowCache], tags: list,
                               marks: list[int] | None = None) -> list[IncrementalRow]:
        """Encode streamed jobs (one batch) into rows at step 0 of :attr:`incremental`, each over
        its request's cache: the encoder runs over the whole sequence, the estimator will solve the
        frames past the cache. A non-final row keeps its frames up to the last attention-chunk
        boundary at or before its end; ``marks`` (absolute frames, 0 = none) also record the state
        at that frame (a voice's prompt prefix).
        """
        if not all(self.can_solve_incrementally(it) for it in items):
            raise InvalidInputError("the incremental flow needs streamed jobs with chunk masks")
        stepper = self.incremental_stepper()
        mu, _, cond, spks, n_frames = self._condition(items)
        chunk = self._attention_chunk()
        rows = []
        for i, (it, cache, total, tag) in enumerate(zip(items, caches, n_frames, tags)):
            start = cache.frames
            if start >= total:
                raise InvalidInputError(f"flow cache holds {start} frames, the job has {total}")
            keep = 0 if it.finalize else max(0, total // chunk * chunk - start)
            mark = max(0, marks[i] - start) if marks else 0
            rows.append(stepper.new_row(mu[i, :, start:total], cond[i, :, start:total], spks[i], cache, keep, tag,
                                        mark=mark))
        return rows

    @torch.inference_mode()
    def start_prefix_rows(self, items: list[FlowItem], tags: list) -> list[IncrementalRow]:
        """Rows that solve voice prompts' kept prefixes alone (:meth:`prompt_prefix_frames` frames
        each, kept whole in a new cache): ``items`` are the prompts as non-final streamed jobs with
        no tokens of their own. Exact: the encoder output of frames before the prefix's end is
        the same without the request's tokens (their look-ahead context is prompt tokens), and the
        estimator's frames there never see a later frame (chunk masks, causal convolutions)."""
        if not all(self.can_solve_incrementally(it) and not it.finalize and it.token.numel() == 0 for it in items):
            raise InvalidInputError("a prompt prefix is solved from a streamed non-final job without tokens")
        stepper = self.incremental_stepper()
        mu, _ = self.encode(items)
        spks = self._speakers(items)
        rows = []
        for i, (it, tag) in enumerate(zip(items, tags)):
            n = self.prompt_prefix_frames(it.prompt_token.numel())
            if n < 1:
                raise InvalidInputError(f"a prompt of {it.prompt_token.numel()} tokens has no whole attention chunk")
            cond = it.prompt_feat[0, :n].transpose(0, 1).to(mu)
            rows.append(stepper.new_row(mu[i, :, :n], cond, spks[i], FlowCache(), n, tag))
        return rows

    @staticmethod
    def row_mel(row: SolveRow, prompt_frames: int) -> torch.Tensor:
        """(1, 80, frames - prompt_frames) float32 of a finished row."""
        return row.x[None, :, prompt_frames:].float()

    def inference(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool = False, finalize: bool = True,
                  trace: dict | None = None) -> torch.Tensor:
        """Mel of the generated tokens of one request.

        Args:
            token: (1, N) speech ids; prompt_token: (1, L); prompt_feat: (1, 2L, 80) frames-major;
            embedding: (1, 192) raw speaker embedding.
            streaming: chunk attention masks; finalize: False treats the last 3 tokens as context.
            trace: receives mu, spks, cond and the solver intermediates (parity tests).

        Returns:
            (1, 80, frames - 2L) float32.
        """
        item = FlowItem(token, prompt_token, prompt_feat, embedding, streaming, finalize)
        return self.inference_batch([item], trace=trace)[0]


@dataclass
class FlowItem:
    """One flow job: the official ``inference`` arguments of one request."""

    token: torch.Tensor  # (1, N)
    prompt_token: torch.Tensor  # (1, L)
    prompt_feat: torch.Tensor  # (1, 2L, 80)
    embedding: torch.Tensor  # (1, 192)
    streaming: bool = False
    finalize: bool = True


def _streaming_flags(items: list[FlowItem], device: torch.device) -> bool | torch.Tensor:
    """One flag when all items agree (the plain single-pattern path), else a (B,) bool tensor."""
    flags = [bool(it.streaming) for it in items]
    if all(flags) or not any(flags):
        return flags[0]
    return to_device(torch.tensor(flags), device)


def build_flow(spec: FlowSpec) -> Flow:
    """The flow module for ``spec`` (random init; load ``flow.pt`` with ``weights.load_checkpoint``)."""
    return Flow(spec)
