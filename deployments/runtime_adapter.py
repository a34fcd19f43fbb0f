"""The production runtime of a synthesizer replica: adapters over :mod:`cosyvoice_runtime`.

:class:`RuntimeTokenEngine` and :class:`RuntimeToken2Wav` implement the protocols of
:mod:`deployments.runtime_protocol`, each built from its part of the replica's
:class:`~deployments.execution_plan.ExecutionPlan`; :mod:`deployments.assembler` loads the model and
assembles them. Swapping a runtime component is a change here, not in a deployment.
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from cosyvoice_runtime.lm_messages import BistreamLMRequest, LMRequest, TokenEvent
from deployments.execution_plan import LLMPlan, Token2WavPlan
from deployments.protocol import InvalidInputError, VoicePrompt
from deployments.runtime_protocol import FrontendRuntime

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- adapters
# Stream priority of the LLM lane (lower is higher; CUDA maps it into the device's range): a decode
# step's blocks are scheduled ahead of a running flow batch's as SMs free up: in the benchmark's
# replica simulation that cut the first-audio tail and raised the sessions at the SLO
# (docs/tuning.md §2, ``overlap_stages``).
LLM_STREAM_PRIORITY = -1


def own_stream(device, priority: int = 0):
    """A CUDA stream of its own for one compute lane (None off CUDA: ``torch.cuda.stream(None)`` is a no-op).

    The LLM lane and the token2wav lane each work on their own stream, so a decode step and a flow
    batch submitted from the two lane threads run side by side on the GPU instead of queueing on
    the default stream. No tensor crosses from one lane's stream to the other's: tokens reach
    token2wav as host ints.
    """
    import torch

    device = torch.device(device)
    return torch.cuda.Stream(device, priority=priority) if device.type == "cuda" else None


class RuntimeTokenEngine:
    """:class:`TokenEngine` over ``cosyvoice_runtime.llm.engine.LLMEngine``, bistream requests included.

    Builds each request's prefill input (spec §3.3) and applies CosyVoice3's silent-token
    filter per request (dropped tokens were still fed back to the LLM; only the flow skips them).
    Bistream text ids are fed one id per chunk, as the official frontend streams them: the engine
    consumes one chunk each time the model asks for text (a ``fill``), so a many-id chunk would be
    read 5 ids at a time with its surplus left until the end (:mod:`cosyvoice_runtime.llm.bistream_seq`).

    ``length_rule`` (``speech_length: text_rate``, :mod:`cosyvoice_runtime.speech_length`): text
    ids and seed -> the speech tokens a request decodes, exactly (its min and max length); a
    bistream request gets it from its whole text when that ends.
    """

    def __init__(self, model, max_running: int, max_model_len: int, plan: LLMPlan | None = None,
                 length_rule: Callable[[Sequence[int], int | None], int] | None = None,
                 capture_graphs: bool = True) -> None:
        """``plan``: the replica's :class:`~deployments.execution_plan.LLMPlan`; None: the eager
        step with the model's norms as they are (tests). ``capture_graphs=False``: the caller
        captures them (:meth:`graph_owners`, the assembler's graph schedule)."""
        from cosyvoice_runtime.llm.bistream_seq import FINISH_PROTOCOL
        from cosyvoice_runtime.llm.engine import NONFINITE_LOGITS, LLMEngine

        self._errors = {NONFINITE_LOGITS: "non-finite logits (NaN/Inf) in speech token generation",
                        # official-quirk mode only: a control id the bistream protocol does not allow
                        FINISH_PROTOCOL: "the model produced a control id the bistream protocol does not allow"}

        self.model = model
        self.spec = model.spec
        self.llm = model.llm
        # CUDA graphs per (batch, key window) bucket (the plan has them on CUDA only)
        if plan is None:
            self.engine = LLMEngine(model.llm, max_batch_size=max_running, max_seq_len=max_model_len)
        else:
            self.engine = LLMEngine(model.llm, max_batch_size=max_running, max_seq_len=max_model_len,
                                    use_cuda_graphs=plan.cuda_graphs, prefill_graphs=plan.prefill_graphs,
                                    compile_backend=plan.compile_backend, run_ahead=plan.run_ahead,
                                    fused_norms=plan.fused_norms)
        # NOTE: capture every decode graph now, before token2wav work runs concurrently: a lazy
        # capture beside other GPU work fails ("capturing stream has unjoined work", seen in
        # bench/gpu_bench.py on a GPU). Graphed, a decode step takes a fraction of its eager time
        # (docs/tuning.md §1). Returns 0 on the CPU.
        if capture_graphs and (captured := self.engine.capture_graphs()):
            logger.info("captured %d CUDA graphs for the LLM decode step", captured)
        self.max_running = max_running
        self.max_model_len = max_model_len
        self._filters: dict[str, Any] = {}
        self._pending: list[TokenEvent] = []  # continuations' prefix events, handed out by the next step
        self.length_rule = length_rule
        self._bistream_text: dict[str, tuple[list[int], int | None]] = {}  # with length_rule: (ids so far, seed)
        self._stream = own_stream(next(model.llm.parameters()).device, priority=LLM_STREAM_PRIORITY)

    def graph_owners(self) -> list[tuple[str, Any]]:
        """(name, owner) of the LLM's decode and prefill graphs (none without graphs)."""
        runners = (("llm.decode", self.engine.runner), ("llm.prefill", self.engine.prefill_runner))
        return [(name, r) for name, r in runners if r is not None and r.use_graphs]

    def add(self, request_id: str, request: LMRequest) -> None:
        import torch

        with torch.cuda.stream(self._stream):  # the prefill input is built where it is used
            self._add(request_id, request)

    def _add(self, request_id: str, request: LMRequest) -> None:
        import torch

        from cosyvoice_runtime.llm.inputs import build_lm_input
        from cosyvoice_runtime.llm.sampling import SamplingParams
        from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter

        lm = build_lm_input(self.llm, torch.as_tensor(request.text_ids, dtype=torch.long),
                            torch.as_tensor(request.prompt_text_ids, dtype=torch.long),
                            torch.as_tensor(request.prompt_speech_ids, dtype=torch.long))
        # The 20x text-length bound is a worst case that real speech does not approach; cap it at
        # what one KV slot holds (finish reason "length") instead of refusing the request.
        room = self.max_model_len - int(lm.embeds.shape[0]) + 1
        if self.length_rule is not None:  # random weights: the text's length, not a random stop
            n = self.length_rule(request.text_ids, request.seed)
            lm = replace(lm, min_len=min(n, max(room, 1)), max_len=n)
        if room < max(lm.min_len, 1):
            need = int(lm.embeds.shape[0]) + lm.min_len
            raise InvalidInputError(f"text piece too long for a decode slot: needs at least {need} positions, "
                                    f"slots hold {self.max_model_len}")
        params = SamplingParams.from_spec(self.spec.llm, seed=request.seed)
        keep = SilentTokenFilter(self.spec)
        prefix = [] if request.prefix is None else [int(t) for t in request.prefix]
        if not request.prefix_done:
            self.engine.add_request(request_id, lm.embeds, lm.min_len, min(lm.max_len, room), params,
                                    prefix=prefix or None)
        if prefix or request.prefix_done:  # a continuation: its first event is what it had emitted
            self._pending.append(TokenEvent(request_id, [t for t in prefix if keep.keep(t)], request.prefix_done,
                                            "stop" if request.prefix_done else None, raw=prefix))
        if not request.prefix_done:
            self._filters[request_id] = keep

    def add_bistream(self, request_id: str, request: BistreamLMRequest) -> None:
        import torch

        from cosyvoice_runtime.llm.sampling import SamplingParams
        from cosyvoice_runtime.llm.silent_tokens import SilentTokenFilter

        params = SamplingParams.from_spec(self.spec.llm, seed=request.seed)
        with torch.cuda.stream(self._stream):
            self.engine.add_bistream_request(request_id, request.prompt_text_ids, request.prompt_speech_ids, params)
        self._filters[request_id] = SilentTokenFilter(self.spec)
        if self.length_rule is not None:
            self._bistream_text[request_id] = ([], request.seed)

    def feed_text(self, request_id: str, ids: Sequence[int], end: bool) -> bool:
        length, text = None, self._bistream_text.get(request_id)
        if text is not None:
            text[0].extend(int(i) for i in ids)
            if end:
                length = self.length_rule(self._bistream_text.pop(request_id)[0], text[1])
        return self.engine.feed_text(request_id, [[int(i)] for i in ids], end, length)

    def step(self) -> list[TokenEvent]:
        import torch

        out, self._pending = self._pending, []  # continuations' prefixes go before their new ids
        with torch.cuda.stream(self._stream):
            events = self.engine.step() if self.engine.has_unfinished() or not out else []
        for ev in events:
            keep = self._filters.get(ev.request_id)
            kept = [keep is None or keep.keep(t) for t in ev.tokens]
            tokens = [t for t, k in zip(ev.tokens, kept) if k]
            read = None if ev.text_read is None else [r for r, k in zip(ev.text_read, kept) if k]
            out.append(TokenEvent(ev.request_id, tokens, ev.finished, ev.finish_reason,
                                  self._errors.get(ev.finish_reason), raw=list(ev.tokens), text_read=read))
            if ev.finished:
                self._filters.pop(ev.request_id, None)
                self._bistream_text.pop(ev.request_id, None)
        return out

    def abort(self, request_id: str) -> None:
        self._pending = [ev for ev in self._pending if ev.request_id != request_id]
        self.engine.abort(request_id)
        self._filters.pop(request_id, None)
        self._bistream_text.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.engine.has_unfinished()

    def num_running(self) -> int:
        return self.engine.num_running()

    def num_waiting(self) -> int:
        return self.engine.num_waiting()

    def open_entries(self) -> dict[str, int]:
        """Sizes of this adapter's and its engine's per-request bookkeeping (leak probes)."""
        return {"filters": len(self._filters), "pending_events": len(self._pending),
                "bistream_texts": len(self._bistream_text), **self.engine.open_entries()}


class RuntimeToken2Wav:
    """:class:`Token2WavRuntime` over ``cosyvoice_runtime.token2wav.Token2Wav``."""

    def __init__(self, model, plan: Token2WavPlan, flow_cache_bytes: int | None = None,
                 prompt_cache_bytes: int | None = None) -> None:
        """``plan``: the replica's :class:`~deployments.execution_plan.Token2WavPlan` (its CUDA graphs
        are captured on the model before, by the assembler); ``flow_cache_bytes``: the plan's budget
        as fitted to this replica's memory (None: the plan's); ``prompt_cache_bytes``: the plan's
        prompt prefix cache resolved (:func:`deployments.assembler.prompt_cache_budget`; None: the
        plan's, which must then be a number)."""
        import torch

        from cosyvoice_runtime.token2wav import Token2Wav

        if prompt_cache_bytes is None:
            prompt_cache_bytes = plan.prompt_cache_bytes
        if not isinstance(prompt_cache_bytes, int):
            raise TypeError(f"prompt_cache_bytes {prompt_cache_bytes!r} is not resolved "
                             "(deployments.assembler.prompt_cache_budget resolves 'auto' from the free GPU memory)")
        # None: the official first chunk (one hop + alignment pad); else the early one (Token2Wav min_first_hop)
        self.t2w = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=plan.first_chunk_min_tokens,
                             cv3_vocoder=plan.cv3_vocoder, cv2_flow=plan.cv2.streamed,
                             prompt_cache_bytes=prompt_cache_bytes, cv3_flow=plan.cv3.streamed,
                             flow_cache_bytes=plan.flow_cache_bytes if flow_cache_bytes is None else flow_cache_bytes)
        prefixes = self.t2w.prompt_prefixes
        # what the voice prompt prefixes may hold (0: none kept, e.g. the flow recomputes)
        self.prompt_cache_bytes = prefixes.max_bytes if prefixes is not None else 0
        self.sample_rate = model.spec.sample_rate
        self.n_mels = model.spec.flow.output_size
        self.embedding_dim = model.spec.flow.spk_embed_dim
        self.device = model.device
        self.dtype = next(model.flow.parameters()).dtype
        self._stream = own_stream(model.device)
        # scheduler "steps": the flow passes on the GPU (off CUDA nothing is queued: no marks)
        self._passes = PassQueue(plan.passes_in_flight, torch.cuda.Event if self._stream is not None else None)

    def new_stream(self, prompt: VoicePrompt, stream: bool, speed: float, seed: int | None) -> Any:
        import torch

        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(seed))
        return self.t2w.new_stream(prompt, stream=stream, speed=speed, generator=generator)

    def next_job(self, state: Any, tokens: Sequence[int], llm_done: bool) -> Any | None:
        return self.t2w.next_job(state, tokens, llm_done)

    def flow_stats(self) -> dict[str, float]:
        t2w = self.t2w
        prefixes = t2w.prompt_prefixes
        return {"flow_cache_bytes": float(t2w.live_cache_bytes()), "flow_cache_fallbacks_total": float(t2w.flow_fallbacks),
                "flow_prompt_prefix_hits_total": float(prefixes.hits if prefixes else 0),
                "flow_prompt_prefix_misses_total": float(prefixes.misses if prefixes else 0),
                "flow_prompt_prefix_primed_total": float(prefixes.primed if prefixes else 0),
                "flow_prompt_cache_budget_bytes": float(self.prompt_cache_bytes)}

    def tokens_needed(self, state: Any) -> int | None:
        return self.t2w.tokens_needed(state)

    def prefix_job(self, state: Any) -> Any | None:
        return self.t2w.prefix_job(state)

    def run_batch(self, jobs: list[Any]) -> list[np.ndarray]:
        import torch

        with torch.cuda.stream(self._stream):  # .cpu() waits for this stream's work only
            return _host_audio(self.t2w.run_batch(jobs))

    # -- token2wav.scheduler "steps" (deployments.token2wav_loop) ---------------------------
    @property
    def n_steps(self) -> int:
        return self.t2w.n_steps

    def start_solves(self, jobs: list[Any]) -> list[Any]:
        import torch

        with torch.cuda.stream(self._stream):
            return self.t2w.start_solves(jobs)

    def advance(self, rows: list[Any]) -> None:
        """One flow pass, queued on the GPU behind at most ``passes_in_flight - 1`` others."""
        import torch

        with torch.cuda.stream(self._stream):
            self._passes.make_room()
            self.t2w.advance(rows)
            self._passes.queued(self._stream)

    def finish(self, rows: list[Any]) -> Callable[[], list[np.ndarray]]:
        """Vocode finished rows (queued now); returns what waits for their audio on the host."""
        import torch

        with torch.cuda.stream(self._stream):
            return _audio_later(self.t2w.finish(rows))


class PassQueue:
    """The flow passes queued on the token2wav stream, at most ``depth`` of them.

    ``make_room`` before a pass waits until fewer than ``depth`` are on the GPU; ``queued`` after
    it marks the pass's end on the stream. Depth 1 waits for the previous pass to end before the
    next is prepared, so the GPU's token2wav lane idles through the driver's host work between
    passes (about a millisecond a pass in a profiled one-stream request: Python, then the pass's
    input copies and launch; docs/tuning.md, ``passes_in_flight``); depth 2 prepares a pass while the one
    before it runs, and a job that arrives meanwhile joins one pass later.
    """

    def __init__(self, depth: int, event: Callable[[], Any] | None) -> None:
        if depth < 1:
            raise ValueError("passes_in_flight is at least 1")
        self.depth = depth
        self._event = event  # a factory of CUDA events; None: nothing is queued (CPU)
        self._marks: deque = deque()

    def make_room(self) -> None:
        while len(self._marks) >= self.depth:
            self._marks.popleft().synchronize()

    def queued(self, stream: Any) -> None:
        if self._event is not None:
            mark = self._event()
            mark.record(stream)
            self._marks.append(mark)


def _host_audio(chunks: list) -> list[np.ndarray]:
    return _audio_later(chunks)()


def _audio_later(chunks: list) -> Callable[[], list[np.ndarray]]:
    """Each (samples,) audio tensor as float32 numpy, through one device->host copy for the whole
    batch, queued on the current stream into pinned memory; the function returned waits for it.
    Why: the token2wav thread that waited on its stream for every finished batch left new first
    chunks queued behind a vocoder (the queue's tail: docs/tuning.md §1, "Under load")."""
    import torch

    if not chunks:
        return list  # list() is the empty batch's audio
    flat = torch.cat([a.detach().reshape(-1).float() for a in chunks])
    splits = np.cumsum([a.numel() for a in chunks])[:-1]
    if flat.device.type != "cuda":
        host = flat.numpy()
        return lambda: np.split(host, splits)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def wait() -> list[np.ndarray]:
        copied.synchronize()
        return np.split(host.numpy().copy(), splits)  # the pinned block goes back to PyTorch's cache
    return wait


# --------------------------------------------------------------------------------------- loaders
def load_frontend_runtime(cfg, model_dir: str) -> FrontendRuntime:
    """The runtime frontend (normaliser, splitter, tokenizer, prompt features, voice store)."""
    from deployments.frontend_runtime import RuntimeFrontend

    return RuntimeFrontend(cfg, model_dir)


def call_with_timeout(fn, timeout_s: float, what: str):
    """Run a blocking constructor step with a deadline (house style §2.3 rule 11).

    A replica whose model load hangs (stuck filesystem, wedged driver) fails with a clear error
    instead of sitting in STARTING; Serve then retries or reports it.
    """
    import concurrent.futures

    from cosyvoice_runtime.errors import ModelLoadError

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="startup")
    try:
        return pool.submit(fn).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ModelLoadError(what, f"not ready after {timeout_s:.0f} s") from None
    finally:
        pool.shutdown(wait=False)
