"""Streaming TTS benchmark: full-size CosyVoice architectures with random weights on one GPU.

Every request does the same work: zero-shot shapes of the official baseline (87 prompt speech
tokens, 14 prompt text tokens, 40 text tokens) and exactly ``--tokens`` generated speech tokens
(min_len = max_len), so runs are comparable. For each mode and concurrency a closed loop keeps
``c`` streams in flight; a replica-like server runs the continuous-batching LLM engine in one
thread and token2wav (flow + HiFT, first chunks first) in another, each on its own CUDA stream.
The sequential baseline runs one request at a time through the single-request reference
pipeline in eager fp32, which is how the official implementation serves.

    python -m bench.gpu_bench --family cosyvoice2 --out bench/results
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import faulthandler
import json
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.metrics import RequestTrace, summarize
from cosyvoice_runtime.hift.graphs import graph_streaming_vocoder
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.inputs import build_lm_input
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.model import CosyVoiceModel, build_modules
from cosyvoice_runtime.modes import compile_model
from cosyvoice_runtime.pipeline import Pipeline, VoicePrompt
from cosyvoice_runtime.tiny_model import _TINY, write_config_dir
from cosyvoice_runtime.token2wav import FlowPrompt, StreamState, Token2Wav
from deployments.deadlines import DEFAULT_SLACK_S

logger = logging.getLogger("bench")

PROMPT_SPEECH, PROMPT_TEXT, TEXT = 87, 14, 40
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EDF_SLACK_S = DEFAULT_SLACK_S  # mode extra "edf": jobs due within this are served first (the replica's default)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(family: str, size: str, device: str, seed: int = 0) -> CosyVoiceModel:
    spec = write_config_dir(tempfile.mkdtemp(prefix="bench-spec-"), family, None if size == "full" else _TINY[family])
    torch.manual_seed(seed)
    mods = build_modules(spec, device=device)
    for m in mods.values():
        fold = getattr(m, "remove_weight_norm", None)
        if callable(fold):
            fold()
        m.eval().requires_grad_(False)
    return CosyVoiceModel(spec=spec, **mods)


def cast(model: CosyVoiceModel, dtype: torch.dtype) -> CosyVoiceModel:
    """Copies of the LLM and flow in ``dtype``; the vocoder stays float32 (phase accumulation).

    ``Module.to`` works in place: copying keeps the fp32 base intact, so a mode measured after a
    bf16 one does not run on weights rounded to bf16.
    """
    return CosyVoiceModel(spec=model.spec, llm=copy.deepcopy(model.llm).to(dtype),
                          flow=copy.deepcopy(model.flow).to(dtype), hift=model.hift)


def make_voice(model: CosyVoiceModel, seed: int = 1) -> tuple[VoicePrompt, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dev = model.device
    dtype = next(model.flow.parameters()).dtype
    s = model.spec
    voice = VoicePrompt(
        prompt_text_ids=torch.randint(0, 150000, (PROMPT_TEXT,), generator=g).to(dev),
        llm_prompt_speech_ids=torch.randint(0, s.llm.speech_token_size, (PROMPT_SPEECH,), generator=g).to(dev),
        flow=FlowPrompt(
            tokens=torch.randint(0, s.llm.speech_token_size, (1, PROMPT_SPEECH), generator=g, dtype=torch.int32).to(dev),
            feat=torch.randn(1, 2 * PROMPT_SPEECH, s.flow.output_size, generator=g).to(dev, dtype),
            embedding=torch.randn(1, s.flow.spk_embed_dim, generator=g).to(dev, dtype),
        ),
    )
    text = torch.randint(0, 150000, (TEXT,), generator=g).to(dev)
    if s.family == "cosyvoice3":
        text[0] = 151646  # <|endofprompt|> must be present
    return voice, text


@dataclass
class _Stream:
    trace: RequestTrace
    state: StreamState
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    first_token_s: float | None = None  # time-to-first-audio breakdown
    first_job_s: float | None = None  # the first token2wav job started
    on_finish: Callable[[_Stream], None] | None = None


class ReplicaSim:
    """Two threads around one model: LLM engine steps and token2wav jobs, like one GPU replica."""

    def __init__(self, model: CosyVoiceModel, max_batch: int, n_tokens: int, cuda_graphs: bool = False,
                 flow_batch: int = 16, min_first_hop: int | None = None, edf_slack_s: float | None = None,
                 llm_compile: str | None = None, cv3_vocoder: str = "recompute", stream_priority: bool = False,
                 max_text: int = TEXT, length_ratio: float | None = None):
        self.model = model
        self.edf_slack_s = edf_slack_s  # None: first chunks first (see _pick)
        self.n_tokens = n_tokens  # per request unless submit() says otherwise (then the most it may say)
        self.flow_batch = flow_batch
        # extra "prio": decode steps on a high-priority CUDA stream, token2wav on a low-priority one,
        # so a step's kernels are scheduled ahead of a running flow batch's as SMs free up
        self.priorities = (-1, 0) if stream_priority else (0, 0)
        # extra "lenbatch" (with edf): a batch holds only jobs at most this many times as long as its
        # most urgent one, so a first chunk is not padded to a 20 s stream's prefix
        self.length_ratio = length_ratio
        self.engine = LLMEngine(model.llm, max_batch_size=max_batch,
                                max_seq_len=PROMPT_SPEECH + PROMPT_TEXT + max_text + n_tokens + 8,
                                use_cuda_graphs=cuda_graphs and model.device.type == "cuda",
                                compile_backend=llm_compile)
        if cuda_graphs and model.device.type == "cuda":
            # NOTE: capture every bucket now, on the default stream with nothing else running: a
            # capture started lazily on the LLM thread while the token2wav thread works fails
            # ("capturing stream has unjoined work", H200 2026-12-02).
            self.engine.capture_graphs()
            sync(model.device)
        self.t2w = Token2Wav(model.spec, model.flow, model.hift, min_first_hop=min_first_hop, cv3_vocoder=cv3_vocoder)
        self.lock = threading.Condition()
        self.streams: dict[str, _Stream] = {}
        self.open: dict[str, _Stream] = {}  # streams with audio still to make (token2wav scans only these)
        self.pending: list[tuple[str, torch.Tensor, int]] = []
        self.stop = False
        self.error: BaseException | None = None
        self.llm_steps = self.t2w_batches = self.t2w_jobs = 0  # progress counters for a timed-out row
        # where the time goes: (start, end) of every decode step; (start, end, jobs, first chunks) of every batch
        self.step_log: list[tuple[float, float]] = []
        self.batch_log: list[tuple[float, float, int, int]] = []
        self._threads: list[threading.Thread] = []
        self.on_error: Callable[[BaseException], None] | None = None  # called once a worker thread failed

    def submit(self, rid: str, voice: VoicePrompt, text: torch.Tensor, t_s: float, n_tokens: int | None = None,
               on_finish=None) -> None:
        """Queue a request of ``n_tokens`` speech tokens (default: the sim's); ``on_finish(stream)``
        is called from the token2wav thread, under the lock, when its last chunk is out."""
        n = n_tokens or self.n_tokens
        if n > self.n_tokens:
            raise ValueError(f"{n} tokens: this sim holds at most {self.n_tokens} per request")
        lm = build_lm_input(self.model.llm, text, voice.prompt_text_ids, voice.llm_prompt_speech_ids)
        state = self.t2w.new_stream(voice.flow, stream=True)
        with self.lock:
            st = _Stream(RequestTrace(submitted_s=t_s), state, on_finish=on_finish)
            self.streams[rid] = self.open[rid] = st
            self.pending.append((rid, lm.embeds, n))
            self.lock.notify_all()

    def start(self) -> None:
        """Start the two worker threads (for a caller that drives submissions itself)."""
        self._threads = [threading.Thread(target=self._guard(f), daemon=True) for f in (self._llm_loop, self._t2w_loop)]
        for t in self._threads:
            t.start()

    def close(self) -> None:
        with self.lock:
            self.stop = True
            self.lock.notify_all()
        for t in self._threads:
            t.join(timeout=5 if self.error else 30)

    def _llm_loop(self) -> None:
        cuda = self.model.device.type == "cuda"
        stream = torch.cuda.Stream(priority=self.priorities[0]) if cuda else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            while not self.stop:
                with self.lock:
                    while not self.stop and not self.pending and not self.engine.has_unfinished():
                        self.lock.wait()
                    adds, self.pending = self.pending, []
                for rid, embeds, n in adds:
                    self.engine.add_request(rid, embeds, n, n, SamplingParams.from_spec(self.model.spec.llm,
                                                                                       seed=hash(rid) % 2**31))
                if self.stop:
                    return
                start = time.perf_counter()
                events = self.engine.step()
                self.llm_steps += 1
                now = time.perf_counter()
                self.step_log.append((start, now))
                with self.lock:
                    for ev in events:
                        st = self.streams[ev.request_id]
                        if ev.token is not None:
                            st.tokens.append(ev.token)
                            st.first_token_s = st.first_token_s or now
                        st.llm_done = st.llm_done or ev.finished
                    self.lock.notify_all()

    def _t2w_loop(self) -> None:
        device = self.model.device
        stream = torch.cuda.Stream(priority=self.priorities[1]) if device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream else contextlib.nullcontext():
            while not self.stop:
                with self.lock:
                    jobs = []
                    while not self.stop:
                        jobs = [(rid, j) for rid, st in self.open.items()
                                if (j := self.t2w.next_job(st.state, list(st.tokens), st.llm_done)) is not None]
                        if jobs:
                            break
                        self.lock.wait()
                if self.stop:
                    return
                jobs = self._pick(jobs, time.perf_counter())
                start = time.perf_counter()
                firsts = 0
                for rid, job in jobs:
                    if job.state.calls == 0:
                        self.streams[rid].first_job_s = start
                        firsts += 1
                audios = self.t2w.run_batch([j for _, j in jobs], max_batch=self.flow_batch)
                sync(device)
                self.t2w_batches += 1
                self.t2w_jobs += len(jobs)
                now = time.perf_counter()
                self.batch_log.append((start, now, len(jobs), firsts))
                with self.lock:
                    for (rid, job), audio in zip(jobs, audios):
                        st = self.streams[rid]
                        if audio.numel():
                            st.trace.add_chunk(now, audio.numel())
                        if job.state.finished:
                            del self.open[rid]
                            if st.on_finish is not None:
                                st.on_finish(st)
                    self.lock.notify_all()

    def _pick(self, jobs: list, now: float) -> list:
        """The token2wav batch to run now out of the ready jobs (caller holds the lock).

        Default: first chunks first, then up to ``flow_batch`` of the rest. With ``edf_slack_s``:
        earliest playback deadline first (a stream's audio so far runs out; first audio is due at
        once), and while some job is due within the slack, only those run: a smaller batch
        returns sooner, and streams with audio to spare wait for the next one.
        """
        if self.edf_slack_s is None:
            jobs.sort(key=lambda rj: rj[1].state.calls)  # first chunks first
            return jobs[: self.flow_batch]
        deadline = {rid: self.streams[rid].trace.playback_deadline_s() for rid, _ in jobs}
        return edf_batch(jobs, deadline, now, self.edf_slack_s, self.flow_batch, self.length_ratio)

    def run(self, voice: VoicePrompt, text: torch.Tensor, concurrency: int, total: int,
            deadline_s: float = 180.0) -> tuple[list[RequestTrace], float]:
        """Closed loop of ``concurrency`` streams until ``total`` requests finished.

        Raises TimeoutError (after dumping every thread's stack) when the row takes longer than
        ``deadline_s``, so one stuck row cannot eat the whole lease.
        """
        self.start()
        t0 = time.perf_counter()
        while True:
            with self.lock:
                submitted = len(self.streams)
                active = sum(1 for s in self.streams.values() if not s.state.finished)
                if self.error or submitted - active == total:
                    break
                if time.perf_counter() - t0 > deadline_s:
                    faulthandler.dump_traceback(all_threads=True)
                    self.error = TimeoutError(f"row c={concurrency} not done after {deadline_s:.0f} s: "
                                              f"{submitted - active}/{total} finished; {self._progress()}")
                    break
                if active >= concurrency or submitted >= total:
                    self.lock.wait(timeout=1.0)
                    continue
            self.submit(f"r{submitted}", voice, text, time.perf_counter())
        wall = time.perf_counter() - t0
        self.close()
        if self.error:
            raise self.error
        self.breakdown = _ttfa_breakdown(list(self.streams.values()))
        return [s.trace for s in self.streams.values()], wall

    def _progress(self) -> str:
        """Where the unfinished streams stand (caller holds the lock): tells a hang from slowness."""
        open_ = [s for s in self.streams.values() if not s.state.finished]
        rows = [f"{len(s.tokens)}tok/{'done' if s.llm_done else 'gen'}/off{s.state.token_offset}/calls{s.state.calls}"
                for s in open_[:8]]
        return (f"llm steps {self.llm_steps}, t2w batches {self.t2w_batches} (jobs {self.t2w_jobs}), "
                f"engine unfinished {self.engine.has_unfinished()}; open streams: {', '.join(rows)}")

    def _guard(self, fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # surfaced by run()
                logger.exception("worker failed")
                with self.lock:
                    self.error = exc
                    self.stop = True
                    self.lock.notify_all()
                if self.on_error is not None:
                    self.on_error(exc)
        return run


def _flow_tokens(job) -> int:
    """Tokens a flow job solves over (prompt + generated so far): its share of a padded batch."""
    return job.state.prompt.n_tokens + int(job.tokens.shape[1])


def edf_batch(jobs: list, deadline: dict, now: float, slack_s: float, flow_batch: int,
              length_ratio: float | None = None) -> list:
    """Earliest playback deadline first: while some ``(rid, job)`` is due within ``slack_s``,
    only those; at most ``flow_batch``; with ``length_ratio``, only jobs at most that many
    times as long (:func:`_flow_tokens`) as the most urgent one, which the batch pads to."""
    jobs = sorted(jobs, key=lambda rj: deadline[rj[0]])
    batch = [rj for rj in jobs if deadline[rj[0]] - now < slack_s] or jobs
    if length_ratio:
        limit = length_ratio * _flow_tokens(batch[0][1])
        batch = [rj for rj in batch if _flow_tokens(rj[1]) <= limit]
    return batch[:flow_batch]


def _ttfa_breakdown(streams: list[_Stream]) -> dict:
    """Median ms from submission to the first token, to the first token2wav job, to first audio."""
    import statistics

    def med(values):
        values = [v for v in values if v is not None]
        return round(statistics.median(values) * 1e3, 1) if values else None

    return {"first_token_ms_p50": med([s.first_token_s and s.first_token_s - s.trace.submitted_s for s in streams]),
            "first_job_ms_p50": med([s.first_job_s and s.first_job_s - s.trace.submitted_s for s in streams])}


def run_baseline(model: CosyVoiceModel, voice: VoicePrompt, text: torch.Tensor, n_tokens: int, requests: int) -> dict:
    """One request at a time, eager fp32, through the single-request reference pipeline."""
    pipe = Pipeline(model)
    traces = []
    t0 = time.perf_counter()
    for i in range(requests):
        tr = RequestTrace(submitted_s=time.perf_counter())
        forced = _forced_sampler(model, n_tokens)
        for chunk in pipe.tts(text, voice, stream=True, seed=i, sample_fn=forced):
            sync(model.device)
            tr.add_chunk(time.perf_counter(), chunk.numel())
        traces.append(tr)
    return summarize(traces, time.perf_counter() - t0)


def _forced_sampler(model: CosyVoiceModel, n_tokens: int):
    from cosyvoice_runtime.llm.generate import default_sample_fn

    eos = model.spec.llm.eos

    def sample(logp, state):
        return eos if state.step >= n_tokens else default_sample_fn(logp, state)

    return sample


def bench_mode(base: CosyVoiceModel, mode: str, concurrencies: list[int], n_tokens: int, min_requests: int,
               flow_batch: int, on_row=None, deadline_s: float = 180.0,
               compile_backend: str = "inductor") -> list[dict]:
    """``mode`` = ``<kind>-<precision>[-<extra>...]``: kind pytorch | compile (torch.compile of
    the flow estimator, the CV2 encoder and the vocoder body, as replica mode torchscript),
    precision fp32 | fp16 | bf16; extras: ``graphs`` = CUDA graphs for the LLM decode step and
    the flow solve, ``allgraphs`` = those and the CV2 flow encoder and vocoder (the serving
    default), ``llmgraphs`` = for the LLM decode step only, ``early`` = the first chunk
    ends at the first attention-chunk boundary >= 10 tokens on (Token2Wav ``min_first_hop=10``),
    ``fastswitch`` = a 0.5 ms GIL switch interval (default 5 ms) while the mode runs, ``edf`` =
    token2wav batches by earliest playback deadline, only the jobs due within 0.5 s while any is
    (:meth:`ReplicaSim._pick`), ``llmcompile`` = the LLM decode step through torch.compile before
    its graphs are captured (what replica mode torchscript adds on CUDA), ``vinc`` = CosyVoice3's
    vocoder in the incremental strategy (the replica's default, ``token2wav.cv3_vocoder``; without
    it the official full recompute), ``prio`` = decode steps on a high-priority CUDA stream and
    token2wav on a low-priority one, ``lenbatch`` = (with edf) a token2wav batch holds only jobs at
    most 1.5x as long (prompt + tokens) as its most urgent one."""
    _, _, extra = parse_mode(mode)
    switch = sys.getswitchinterval()
    if "fastswitch" in extra:
        sys.setswitchinterval(0.0005)
    try:
        return _bench_mode(base, mode, concurrencies, n_tokens, min_requests, flow_batch, on_row, deadline_s,
                           compile_backend)
    finally:
        sys.setswitchinterval(switch)


KNOWN_EXTRAS = {"graphs", "allgraphs", "llmgraphs", "early", "fastswitch", "edf", "llmcompile", "vinc", "prio",
                "lenbatch"}
LENGTH_RATIO = 1.5  # extra "lenbatch"


def parse_mode(mode: str) -> tuple[str, str, list[str]]:
    """``<kind>-<precision>[-<extra>...]`` -> (kind, precision, extras); see :func:`bench_mode`."""
    kind, prec, *extra = mode.split("-")
    if kind not in ("pytorch", "compile") or prec not in DTYPES or set(extra) - KNOWN_EXTRAS:
        raise ValueError(f"unknown mode {mode!r}: expected <pytorch|compile>-<fp32|fp16|bf16>"
                         f"[-{'|-'.join(sorted(KNOWN_EXTRAS))}]")
    return kind, prec, extra


def mode_setup(base: CosyVoiceModel, mode: str, flow_batch: int, n_tokens: int,
               compile_backend: str = "inductor") -> tuple[CosyVoiceModel, dict]:
    """The prepared model of a mode and the :class:`ReplicaSim` keyword arguments it implies
    (requests of up to ``n_tokens`` speech tokens)."""
    kind, prec, extra = parse_mode(mode)
    llm_graphs = bool({"graphs", "allgraphs", "llmgraphs"} & set(extra))
    min_first_hop = 10 if "early" in extra else None  # the serving default (token2wav.first_chunk_min_tokens)
    edf = EDF_SLACK_S if "edf" in extra else None
    sim_args = {"cuda_graphs": llm_graphs, "flow_batch": flow_batch, "min_first_hop": min_first_hop, "edf_slack_s": edf,
                "llm_compile": compile_backend if "llmcompile" in extra else None,
                "cv3_vocoder": "incremental" if "vinc" in extra else "recompute", "stream_priority": "prio" in extra,
                "length_ratio": LENGTH_RATIO if "lenbatch" in extra else None}
    graphs = "all" if "allgraphs" in extra else "solve" if "graphs" in extra else None
    return _prepared(base, kind, prec, graphs, flow_batch, n_tokens, min_first_hop, compile_backend), sim_args


def _bench_mode(base, mode, concurrencies, n_tokens, min_requests, flow_batch, on_row, deadline_s, compile_backend):
    model, sim_args = mode_setup(base, mode, flow_batch, n_tokens, compile_backend)
    voice, text = make_voice(model)
    rows = []
    # warm-up: one short request (allocations, kernel selection, compilation)
    ReplicaSim(model, 4, 60, **sim_args).run(voice, text, 2, 2)
    for c in concurrencies:
        if model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sim = ReplicaSim(model, max_batch=c, n_tokens=n_tokens, **sim_args)
        traces, wall = sim.run(voice, text, c, max(2 * c, min_requests), deadline_s=deadline_s)
        row = {"mode": mode, "concurrency": c, **summarize(traces, wall), **sim.breakdown}
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if model.device.type == "cuda" else None
        row.update(_graph_counters(model))
        print(json.dumps(row), flush=True)
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def _graph_counters(model: CosyVoiceModel) -> dict:
    """Replays and eager calls so far of each graph owner (0 when it is off): shows the graphs ran."""
    out = {}
    for name, owner in (("solve", model.flow.graphed_solver), ("encoder", model.flow.graphed_encoder),
                        ("vocoder", getattr(model.hift, "graphed_decode", None))):
        out[f"{name}_replays"] = owner.replays if owner else 0
        out[f"{name}_eager"] = owner.eager_calls if owner else 0
    return out


_PREPARED: dict[tuple, CosyVoiceModel] = {}


def _prepared(base: CosyVoiceModel, kind: str, prec: str, graphs: str | None, flow_batch: int,
              n_tokens: int, min_first_hop: int | None, compile_backend: str = "inductor") -> CosyVoiceModel:
    """The cast (compiled / graphed) copy of ``base`` for a mode; modes that differ only in
    scheduling (fastswitch) share it, so graphs are captured once per run.

    ``graphs``: None, "solve" (the flow solve) or "all" (the solve, the CV2 encoder and the CV2
    vocoder on a copy of the vocoder, captured as a replica does it)."""
    key = (id(base), kind, prec, graphs, flow_batch, n_tokens, min_first_hop if graphs == "all" else None)
    if key not in _PREPARED:
        _PREPARED.clear()  # one prepared copy at a time: GPU memory
        model = cast(base, DTYPES[prec])
        if kind == "compile" or graphs == "all":  # both change the vocoder: the base one stays eager for other modes
            model.hift = copy.deepcopy(model.hift)
        if kind == "compile":  # what mode torchscript does in a replica: estimator, encoder, vocoder body
            compile_model(model, backend=compile_backend)
        if graphs and model.device.type == "cuda":
            t0 = time.perf_counter()
            model.flow.enable_graphs(max_batch=flow_batch, max_frames=2 * (PROMPT_SPEECH + n_tokens),
                                     encoder=graphs == "all")
            n = model.flow.capture_graphs()
            n_voc = 0
            if graphs == "all" and hasattr(model.hift, "enable_graphs"):
                n_voc = graph_streaming_vocoder(model.hift, model.spec, flow_batch,
                                                min_first_hop=min_first_hop).num_graphs
            logger.info("captured %d flow and %d vocoder graphs in %.1f s", n, n_voc, time.perf_counter() - t0)
        _PREPARED[key] = model
    return _PREPARED[key]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"])
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--modes", default="pytorch-fp32,pytorch-bf16,pytorch-bf16-graphs")
    ap.add_argument("--flow-batch", type=int, default=16, help="token2wav jobs per batched flow solve")
    ap.add_argument("--concurrency", default="1,4,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 = 1 s)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--baseline-requests", type=int, default=3)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--deadline-s", type=float, default=180.0, help="a row taking longer fails (stacks dumped)")
    ap.add_argument("--tag", default="", help="suffix of the report name (several runs on one day)")
    ap.add_argument("--compile-backend", default="inductor",
                    help="torch.compile backend of compile modes (tests: eager)")
    ap.add_argument("--debug", action="append", default=[], metavar="LOGGER",
                    help="set this logger to DEBUG, e.g. cosyvoice_runtime: one timestamped line per captured graph")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in args.debug:
        logging.getLogger(name).setLevel(logging.DEBUG)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = make_model(args.family, args.size, args.device)
    voice, text = make_voice(base)
    run_baseline(base, voice, text, 30, 1)  # warm-up
    baseline = run_baseline(base, voice, text, args.tokens, args.baseline_requests)
    print(json.dumps({"baseline": baseline}), flush=True)
    rows: list[dict] = []
    errors: list[str] = []
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    from bench.report import write_report

    def report(row=None):  # rewritten after every row, so a timeout still leaves results
        if row is not None:
            rows.append(row)
        if rows:
            notes = "\n".join(f"- mode failed: {e}" for e in errors)
            write_report(Path(args.out), device_name, args.family, args.tokens, baseline, rows, notes=notes,
                         tag=args.tag)

    for mode in args.modes.split(","):
        try:
            bench_mode(base, mode, [int(c) for c in args.concurrency.split(",")], args.tokens,
                       args.min_requests, args.flow_batch, on_row=report, deadline_s=args.deadline_s,
                       compile_backend=args.compile_backend)
        except Exception as exc:  # keep measuring the other modes; the report lists the failure
            logger.exception("mode %s failed", mode)
            errors.append(f"{mode}: {type(exc).__name__}: {exc}")
            report()
    if errors:
        print(json.dumps({"errors": errors}), flush=True)


if __name__ == "__main__":
    main()
