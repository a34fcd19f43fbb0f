"""Continuous-batching speech-token engine: ``add_request`` / ``step`` / ``abort``.

One :meth:`LLMEngine.step` runs one decode step for every running sequence as a single batch
(each at its own position, attending only to its own KV slot), then prefills the requests the
scheduler admitted this step as one padded batch; each prefill yields that request's first token. Requests
therefore join between decode steps and leave as soon as they finish: their KV slot is free for
the next step.

Token selection and the stop/length rules are :func:`~cosyvoice_runtime.llm.generate.select_tokens`
and :func:`~cosyvoice_runtime.llm.generate.commit_token`, the same functions the single-request
reference loop uses (a row with NaN/Inf logits failing alone: :mod:`cosyvoice_runtime.llm.token_choice`);
sampling randomness is per request (its own ``torch.Generator``).

With ``use_cuda_graphs`` on a CUDA model the decode step (model + sampling) runs through
:class:`~cosyvoice_runtime.llm.cuda_graph.DecodeRunner`: one CUDA graph replay per step for a
padded batch bucket, one host sync; the prompts of new requests go through
:class:`~cosyvoice_runtime.llm.prefill_graph.PrefillRunner` (a graph per batch and length
bucket) instead of ~600 eager launches that every running stream would wait behind. Call
:meth:`LLMEngine.capture_graphs` at startup to capture every bucket up front (otherwise each is
captured on first use).

Bistream requests (text-in streaming, spec §3.8; :meth:`LLMEngine.add_bistream_request`,
:meth:`LLMEngine.feed_text`) share the batch: each is a
:class:`~cosyvoice_runtime.llm.bistream_seq.BistreamSequence` of the engine's
:class:`~cosyvoice_runtime.llm.engine_bistream.BistreamRows`. A row whose next input is its
last speech token joins the decode forward; one that must feed several positions (the prompt
groups, 5 more text ids after a ``fill``, the final stage) joins the step's batched prefill
forward as an extension of its slot. A request waiting for text is parked: it keeps its KV slot
and takes no work until text arrives (:meth:`LLMEngine.has_unfinished` does not count it, so a
driver loop sleeps instead of spinning).

Running ahead (``run_ahead``, with the static decode step): a step is queued before the one
before it has been read. Each :meth:`LLMEngine.step` launches the next decode step, feeding
each row that continues the step in flight that step's choice straight from the GPU
(:meth:`~cosyvoice_runtime.llm.cuda_graph.DecodeRunner.launch`), and only then waits for the
step in flight and commits its ids: the GPU has the next step queued while the host commits,
delivers and packs: without it the LLM's lane idles through that host work every step
(docs/tuning.md §1; what it gains: §2, ``llm_run_ahead``). Events therefore
come one call behind. A row whose step in flight may end it
(a stop id) has one wasted step queued after it, dropped when read; one whose step in flight is
certainly its last (its length) is not queued again. Requests the in-step sampler does not
serve and ``return_logits`` need every id on the host before the next step: while any is in the
engine, the step in flight is read first and steps wait as without it. So do the steps that
feed bistream rows (their next input may be text, chosen on the host); a bistream request
parked waiting for text takes no step, and the others run ahead meanwhile.
The tokens are the same either way (a row's draws depend on its seed and step count only).

The engine is synchronous and single-threaded; the deployment's loop task drives it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm import bistream
from cosyvoice_runtime.llm.batch_sampling import NONFINITE
from cosyvoice_runtime.llm.bistream import BistreamState
from cosyvoice_runtime.llm.bistream_seq import BistreamSequence, embed_segments
from cosyvoice_runtime.llm.cuda_graph import DEFAULT_HISTORY_WIDTH, DecodeRunner, Launched
from cosyvoice_runtime.llm.engine_bistream import BistreamRows
from cosyvoice_runtime.llm.generate import (
    DecodeState,
    SampleFn,
    commit_token,
    default_sample_fn,
)
from cosyvoice_runtime.llm.inputs import with_prefix
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.prefill_graph import PrefillRunner
from cosyvoice_runtime.llm.sampling import SamplingParams, make_generator, min_len_mask_ids
from cosyvoice_runtime.llm.scheduler import Scheduler
from cosyvoice_runtime.llm.token_choice import NONFINITE_LOGITS, select_finite, settle
from cosyvoice_runtime.lm_messages import TokenEvent

logger = logging.getLogger(__name__)

# Padded prompt positions per batched prefill forward: bounds its activations (16 prompts of
# 1,024 positions); admitted requests beyond it are prefilled in further forwards of the step.
PREFILL_TOKEN_BUDGET = 16384
# Sampler inputs of a bistream row in the static decode step: official_rng makes the in-step
# sampler skip it (a placeholder id); the engine chooses its token from the logits.
_SAMPLED_OUTSIDE = DecodeState(min_len=0, max_len=1, params=SamplingParams(method="greedy", official_rng=True),
                               rng_seed=0)


@dataclass
class _Request:
    request_id: str
    lm_input: torch.Tensor  # (T0, H); dropped after prefill
    state: DecodeState
    sample_fn: SampleFn


@dataclass
class _InFlight:
    """A decode step launched ahead (``run_ahead``) and not yet read: its rows, in order."""

    reqs: list[_Request]
    launched: Launched


class LLMEngine:
    """Batched decoding of many requests over one :class:`~cosyvoice_runtime.llm.model.SpeechLM`.

    Args:
        model: the speech LM (eval mode; its device and dtype are used for the cache).
        max_batch_size: KV slots = largest decode batch.
        max_seq_len: positions per slot (prompt + generated); longer requests are refused.
        max_prefills_per_step: requests admitted (and prefilled together) per step.
        official_quirks: the official min-length rule (mask only index S) instead of masking
            every stop id.
        return_logits: attach each step's logits to the events.
        use_cuda_graphs: on a CUDA model, decode through captured CUDA graphs (ignored on CPU).
        static_decode: decode through the padded, bucketed step of the graphs even without
            capturing (default: iff graphs are used; True on CPU runs that step eagerly, tests).
        history_width: emitted ids per row the in-graph RAS repetition check sees.
        compile_backend: ``torch.compile`` the model part of the static decode step with this
            backend (mode torchscript: ``inductor``; tests: ``eager``); None = not compiled.
        prefill_graphs: with the static decode step, prefill new requests through
            :class:`~cosyvoice_runtime.llm.prefill_graph.PrefillRunner` (False: eager prefill,
            the benchmarks' baseline).
        run_ahead: with the static decode step, queue each step before reading the one before
            (module docstring).
        fused_norms: each residual add and the RMSNorm after it as one Triton kernel in the
            model's layers (``cosyvoice_runtime.kernels.add_rms_norm``; PyTorch's ops where it
            cannot run); set before any step is traced or captured. None: as the model has it.
    """

    def __init__(self, model, max_batch_size: int = 16, max_seq_len: int = 2048, *, max_prefills_per_step: int = 16,
                 official_quirks: bool = False, return_logits: bool = False, use_cuda_graphs: bool = False,
                 static_decode: bool | None = None, history_width: int = DEFAULT_HISTORY_WIDTH,
                 compile_backend: str | None = None, prefill_graphs: bool = True, run_ahead: bool = False,
                 fused_norms: bool | None = None) -> None:
        if fused_norms is not None:
            model.use_fused_norms(fused_norms)
        self.model = model
        self.spec = model.spec
        self.max_running = max_batch_size
        self.official_quirks = official_quirks
        self.return_logits = return_logits
        device = next(model.parameters()).device
        graphs = use_cuda_graphs and device.type == "cuda"
        static = graphs if static_decode is None else static_decode
        # The static step pads its batch with rows that write into one extra, never scheduled slot.
        self.cache = KVCache.for_model(model, max_batch_size + (1 if static else 0), max_seq_len)
        self.scheduler = Scheduler(max_batch_size, max_batch_size, max_seq_len, max_prefills_per_step)
        self.runner = None
        self.prefill_runner = None
        if static:
            self.runner = DecodeRunner(model, self.cache, max_batch_size, pad_slot=max_batch_size,
                                       stop_mask_ids=min_len_mask_ids(self.spec, official_quirks),
                                       history_width=history_width, use_graphs=graphs,
                                       compile_backend=compile_backend, feed_on_device=run_ahead)
            if prefill_graphs:
                self.prefill_runner = PrefillRunner(model, self.cache, pad_slot=max_batch_size,
                                                    stop_mask_ids=min_len_mask_ids(self.spec, official_quirks),
                                                    history_width=history_width, use_graphs=graphs)
        self._requests: dict[str, _Request] = {}
        self.bistream = BistreamRows(self.scheduler, self.cache, return_logits)
        self.run_ahead = run_ahead and self.runner is not None
        self._in_flight: _InFlight | None = None

    def capture_graphs(self) -> int:
        """Capture every decode and prefill graph now (startup); returns how many exist (0
        without graphs)."""
        if self.runner is None:
            return 0
        with torch.inference_mode():
            return self.runner.capture() + (self.prefill_runner.capture() if self.prefill_runner else 0)

    @property
    def device(self) -> torch.device:
        return self.cache.device

    # -- request lifecycle -----------------------------------------------------------------
    def add_request(self, request_id: str, lm_input: torch.Tensor, min_len: int, max_len: int,
                    params: SamplingParams | None = None, sample_fn: SampleFn | None = None,
                    generator: torch.Generator | None = None, prefix=None) -> None:
        """Queue one sequence.

        Args:
            lm_input: (T0, H) prefill embeddings (:func:`~cosyvoice_runtime.llm.inputs.build_lm_input`).
            min_len / max_len: generated-token limits of the request.
            params: sampling settings (default: the spec's RAS); ``params.seed`` seeds the
                request's generator unless ``generator`` is given.
            sample_fn: override of the sampler (tests).
            prefix: speech ids the sequence already emitted (a continuation on another replica,
                ``LMRequest.prefix``): prefilled after ``lm_input`` as the decode steps would have
                fed them, and the request's state starts after them (its RAS history, its step:
                the counter-based sampler's next draw is the one an unbroken run made there).

        Raises:
            InvalidInputError: bad shape, or the request cannot fit in a KV slot.
            KeyError: ``request_id`` is already in the engine.
        """
        if lm_input.dim() != 2 or lm_input.shape[1] != self.spec.llm_input_size or lm_input.shape[0] == 0:
            raise InvalidInputError(f"lm_input must be (T, {self.spec.llm_input_size}), got {tuple(lm_input.shape)}")
        if max_len < 1:
            raise InvalidInputError(f"max_len must be >= 1, got {max_len}")
        params = params or SamplingParams.from_spec(self.spec)
        gen = generator or make_generator(params.seed, self.device)
        state = DecodeState(min_len=min_len, max_len=max_len, generator=gen, params=params)
        if prefix is not None and len(prefix):  # a continuation: its emitted ids are prompt positions now
            lm_input, state.tokens = with_prefix(self.model, lm_input, prefix, max_len)
            state.step = len(state.tokens)
            max_len -= state.step  # positions still to generate (the slot's size below)
        # The last emitted token is never fed, so T0 + max_len - 1 positions suffice.
        try:
            self.scheduler.add(request_id, lm_input.shape[0] + max_len - 1)
        except ValueError as exc:
            raise InvalidInputError(str(exc)) from exc
        self._requests[request_id] = _Request(request_id, lm_input.to(self.device, self.cache.dtype), state,
                                              sample_fn or default_sample_fn)

    def add_bistream_request(self, request_id: str, prompt_text_ids, prompt_speech_ids,
                             params: SamplingParams | None = None, sample_fn: bistream.SampleFn | None = None,
                             generator: torch.Generator | None = None, max_tokens: int | None = None) -> None:
        """Queue a bistream request (spec §3.8); its text comes later through :meth:`feed_text`.

        Args:
            prompt_text_ids / prompt_speech_ids: the prompt, as ``bistream_decode`` takes it.
            params / generator: as :meth:`add_request`; sampling is ``bistream_decode``'s
                (``bistream.default_sample_fn``, the request's own generator) unless ``sample_fn``.
            max_tokens: cap on emitted tokens (default: ``bistream_decode``'s). The KV slot is a
                cap too: a request whose next input does not fit finishes with reason "length".

        Raises:
            InvalidInputError: CV3 prompt text without ``<|endofprompt|>``, or a prompt that
                cannot fit in a KV slot.
            KeyError: ``request_id`` is already in the engine.
        """
        params = params or SamplingParams.from_spec(self.spec)
        state = BistreamState(generator=generator or make_generator(params.seed, self.device), params=params)
        seq = BistreamSequence(self.spec, prompt_text_ids, prompt_speech_ids, state,
                               official_quirks=self.official_quirks, max_tokens=max_tokens,
                               sample_fn=sample_fn or bistream.default_sample_fn)
        self.bistream.add(request_id, seq)

    def feed_text(self, request_id: str, chunks, end: bool = False, length: int | None = None) -> bool:
        """More text for a bistream request: ``chunks`` of text ids (one id per chunk, as the
        official frontend streams them); ``end``: the text is complete, and ``length`` (optional,
        with ``end``): the speech tokens it is said in (``BistreamSequence.feed``). False if the
        request is unknown (finished or aborted).

        Raises:
            InvalidInputError: text after the end of the text.
        """
        return self.bistream.feed(request_id, chunks, end, length)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its KV slot now; False if unknown."""
        self._requests.pop(request_id, None)
        self.bistream.drop(request_id)
        freed = self.scheduler.abort(request_id)
        if freed:
            logger.debug("aborted %s", request_id)
        return freed

    def has_unfinished(self) -> bool:
        """Whether :meth:`step` has work; a parked bistream request is none (until ``feed_text``)."""
        return self.scheduler.has_unfinished()

    def num_running(self) -> int:
        return self.scheduler.num_running

    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def num_parked(self) -> int:
        """Bistream requests holding a slot while they wait for text."""
        return self.scheduler.num_parked

    def open_entries(self) -> dict[str, int]:
        """Sizes of the per-request bookkeeping, 0 once every request has ended (leak probes)."""
        return {"engine_requests": len(self._requests), "scheduler_entries": self.scheduler.num_tracked}

    def state_of(self, request_id: str) -> DecodeState | BistreamState | None:
        req = self._requests.get(request_id)
        if req is not None:
            return req.state
        seq = self.bistream.seqs.get(request_id)
        return None if seq is None else seq.state

    # -- stepping --------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """One decode step of the running batch, then the prefill of admitted requests (with the
        multi-position inputs of bistream requests)."""
        events: list[TokenEvent] = []
        plan = self.scheduler.schedule()
        with torch.inference_mode():
            admitted = self.bistream.admit(plan.prefill)
            feeds, extends = self.bistream.route([s for s in plan.decode if s.request_id in self.bistream] + admitted,
                                                 events)
            ahead = self._may_run_ahead() and not feeds and not extends  # parked bistream rows step nowhere
            if self._in_flight is not None and not ahead:  # every id on the host before a step that needs them
                events += self._read_in_flight()  # the requests it ended leave _requests
            decode = [s for s in plan.decode if s.request_id in self._requests]
            if ahead:
                events += self._decode_ahead(decode)
            elif decode or feeds:
                events += self._decode(decode, feeds)
            prefill = [s for s in plan.prefill if s.request_id in self._requests]
            if prefill or extends:
                events += self._prefill(prefill, extends)
        return events

    def _decode(self, decode: list, feeds: list) -> list[TokenEvent]:
        """One forward for every row that feeds one speech id: running requests, then bistream rows."""
        reqs = [self._requests[s.request_id] for s in decode]
        seqs = [self.bistream.seqs[s.request_id] for s in feeds]
        slots = [s.slot for s in decode] + [s.slot for s in feeds]
        fed = [r.state.tokens[-1] for r in reqs] + [seq.take_input()[0][1][0] for seq in seqs]
        n = len(reqs)
        bad_bistream = None  # the bistream rows with NaN/Inf logits, when the step marked them
        if self.runner is None:
            ids = torch.tensor(fed, device=self.device)
            logits = self.model.logits(self.model.decode(self.model.embed_speech(ids), self.cache, slots))
            tokens = select_finite(self.spec, reqs, logits[:n], self.official_quirks) if reqs else []
        else:
            ids, logits = self.runner.step(fed, slots, [r.state for r in reqs] + [_SAMPLED_OUTSIDE] * len(seqs))
            if self.return_logits:
                logits = logits.clone()  # the runner's buffer is overwritten by the next step
            tokens = settle(self.spec, reqs, ids[:n], logits, self.runner.can_sample, self.official_quirks)
            bad_bistream = {i for i, tok in enumerate(ids[n:]) if tok == NONFINITE}
        events = [self._commit(r, tok, logits[i]) if tok is not None else self._fail(r)
                  for i, (r, tok) in enumerate(zip(reqs, tokens))]
        return events + self.bistream.choose(feeds, seqs, logits[n:], bad_bistream)

    def _may_run_ahead(self) -> bool:
        """Whether this step may be queued before the one in flight is read: no request needs its
        ids on the host first (sampled outside the step) and no logits are returned; bistream rows
        in the step are :meth:`step`'s to check (parked ones take no step)."""
        return (self.run_ahead and not self.return_logits
                and all(r.sample_fn is default_sample_fn and self.runner.can_sample(r.state.params)
                        for r in self._requests.values()))

    def _decode_ahead(self, decode: list) -> list[TokenEvent]:
        """Launch this step (rows continuing the step in flight fed its ids on the GPU), then read
        the step in flight: its events are the ones returned."""
        flight = self._in_flight
        row_of = {id(r): j for j, r in enumerate(flight.reqs)} if flight is not None else {}
        reqs, carry = [], []
        for s in decode:
            req = self._requests[s.request_id]
            j = row_of.get(id(req), -1)
            if j >= 0 and len(req.state.tokens) + 1 >= req.state.max_len:
                continue  # its step in flight is its last: emitted, it reaches max_len
            reqs.append(req)
            carry.append(j)
        launched = None
        if reqs:
            launched = self.runner.launch([r.state.tokens[-1] if j < 0 else 0 for r, j in zip(reqs, carry)],
                                          [r.state.slot for r in reqs], [r.state for r in reqs], carry)
        events = self._read_in_flight() if flight is not None else []
        self._in_flight = _InFlight(reqs, launched) if launched is not None else None
        if self._in_flight is not None and all(self._ended(r) for r in reqs):
            self._read_in_flight()  # wasted work only (the last requests stopped): not left behind
        return events

    def _read_in_flight(self) -> list[TokenEvent]:
        """Wait for the step in flight and commit its ids; rows it ran for requests that ended
        meanwhile (a stop id the step before, an abort) are dropped."""
        flight, self._in_flight = self._in_flight, None
        events = []
        for req, tok in zip(flight.reqs, self.runner.collect(flight.launched)):
            if not self._ended(req):
                events.append(self._commit(req, tok, None) if tok != NONFINITE else self._fail(req))
        return events

    def _ended(self, req: _Request) -> bool:
        return req.state.finished or self._requests.get(req.request_id) is not req

    def _prefill(self, prefill: list, extends: list) -> list[TokenEvent]:
        """The admitted requests' prompts (through the prefill graphs when they fit) and the
        bistream rows' multi-position inputs (eager, as padded batched forwards of at most
        ``PREFILL_TOKEN_BUDGET`` padded positions each); each row yields a token (a bistream
        row: per its state machine)."""
        reqs = [self._requests[s.request_id] for s in prefill]
        for req, s in zip(reqs, prefill):
            req.state.slot = s.slot
            self.cache.reset(s.slot)
        seqs = [self.bistream.seqs[s.request_id] for s in extends]
        parts, tokens = [], []
        if reqs:
            fresh, slots = [r.lm_input for r in reqs], [s.slot for s in prefill]
            if self.prefill_runner is not None and self.prefill_runner.fits([len(x) for x in fresh]):
                ids, logits = self.prefill_runner.run(fresh, slots, [r.state for r in reqs])
                tokens = settle(self.spec, reqs, ids, logits, self.prefill_runner.can_sample, self.official_quirks)
            else:
                logits = self._forward_padded(fresh, slots)
                tokens = select_finite(self.spec, reqs, logits, self.official_quirks)
            parts.append(logits)
        if seqs:
            parts.append(self._forward_padded([embed_segments(self.model, seq.take_input(), self.device)
                                               for seq in seqs], [s.slot for s in extends]))
        logits = parts[0] if len(parts) == 1 else torch.cat(parts)
        n = len(reqs)
        events = []
        for i, req in enumerate(reqs):
            req.lm_input = req.lm_input[:0]  # the prompt now lives in the cache
            self.scheduler.mark_prefilled(req.request_id)
            events.append(self._commit(req, tokens[i], logits[i]) if tokens[i] is not None else self._fail(req))
        return events + self.bistream.choose(extends, seqs, logits[n:])

    def _forward_padded(self, inputs: list[torch.Tensor], slots: list[int]) -> torch.Tensor:
        """Eager prefill: (n, V) logits of each input's last position, in padded batched forwards."""
        return self.model.logits(torch.cat([self.model.prefill_batch([inputs[i] for i in g], self.cache,
                                                                     [slots[i] for i in g])
                                            for g in self._prefill_groups(inputs, slots)]))

    def _prefill_groups(self, inputs: list[torch.Tensor], slots: list[int]) -> list[list[int]]:
        """Consecutive rows per forward: within the token budget, and the right padding fits every
        row's slot (a bistream row extends a slot that already holds positions)."""
        groups: list[list[int]] = [[]]
        for i in range(len(inputs)):
            group = groups[-1] + [i]
            longest = max(inputs[j].shape[0] for j in group)
            fits = all(self.cache.lengths[slots[j]] + longest <= self.cache.max_len for j in group)
            if groups[-1] and (longest * len(group) > PREFILL_TOKEN_BUDGET or not fits):
                groups.append([])
            groups[-1].append(i)
        return groups

    def _fail(self, req: _Request) -> TokenEvent:
        """End a request whose logits were not finite; its slot is freed, the batch goes on."""
        logger.warning("request %s: non-finite logits (NaN/Inf); failing it alone", req.request_id)
        req.state.finished, req.state.finish_reason = True, NONFINITE_LOGITS
        self._requests.pop(req.request_id, None)
        self.scheduler.finish(req.request_id)
        return TokenEvent(req.request_id, [], True, NONFINITE_LOGITS)

    def _commit(self, req: _Request, token: int, logits: torch.Tensor | None) -> TokenEvent:
        state = req.state
        emitted = commit_token(self.spec, state, token)
        event = TokenEvent(req.request_id, [token] if emitted else [], state.finished, state.finish_reason,
                           logits=logits if self.return_logits else None)
        if state.finished:
            self._requests.pop(req.request_id, None)
            self.scheduler.finish(req.request_id)
        return event
