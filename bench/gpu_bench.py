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
import copy
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.metrics import RequestTrace, summarize
from bench.replica_sim import EXPRESS_BATCH, PROMPT_SPEECH, PROMPT_TEXT, TEXT, ReplicaSim, sync
from cosyvoice_runtime.flow.graph_setup import capture_flow_graphs, enable_flow_graphs
from cosyvoice_runtime.hift.graphs import graph_streaming_vocoder
from cosyvoice_runtime.model import CosyVoiceModel, build_modules
from cosyvoice_runtime.modes import compile_model
from cosyvoice_runtime.pipeline import Pipeline
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from cosyvoice_runtime.voice_prompt import VoicePrompt
from deployments.deadlines import DEFAULT_SLACK_S

logger = logging.getLogger("bench")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EDF_SLACK_S = DEFAULT_SLACK_S  # mode extra "edf": jobs due within this are served first (the replica's default)


def make_model(family: str, size: str, device: str, seed: int = 0) -> CosyVoiceModel:
    spec = write_config_dir(tempfile.mkdtemp(prefix="bench-spec-"), family, None if size == "full" else TINY_DIMS[family])
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
    """A random voice (zero-shot: the LLM and the flow read its speech tokens) and text ids on the device."""
    g = torch.Generator().manual_seed(seed)
    dev = model.device
    s = model.spec
    voice = VoicePrompt(
        family=s.family,
        text_tokens=torch.randint(0, 150000, (PROMPT_TEXT,), generator=g, dtype=torch.int32).numpy(),
        speech_tokens=torch.randint(0, s.llm.speech_token_size, (PROMPT_SPEECH,), generator=g,
                                    dtype=torch.int32).numpy(),
        mel=torch.randn(2 * PROMPT_SPEECH, s.flow.output_size, generator=g).numpy(),
        embedding=torch.randn(s.flow.spk_embed_dim, generator=g).numpy(),
    )
    text = torch.randint(0, 150000, (TEXT,), generator=g).to(dev)
    if s.family == "cosyvoice3":
        text[0] = 151646  # <|endofprompt|> must be present
    return voice, text


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
    most 1.5x as long (prompt + tokens) as its most urgent one, ``express`` = a second token2wav
    lane (own flow + vocoder copies and graphs, higher-priority CUDA stream) takes every stream's
    first two chunks (:mod:`bench.replica_sim`); implies prio; ``cvinc`` = the streamed flow
    calls incremental, either family (Token2Wav ``cv2_flow`` / ``cv3_flow`` "incremental": each stream's estimator state of the
    emitted frames kept, only new frames solved, batched, graphed per (batch, new, cached frames)
    bucket with the graphs; the voice's prompt prefix kept across requests unless ``noprefix``;
    without it the official full recompute), ``steps`` = the flow solved one Euler pass at a time over rows picked
    earliest deadline first (:mod:`cosyvoice_runtime.flow.stepper`), so a first chunk joins at the next
    pass instead of waiting for a whole batch; with ``edf``'s slack; ``eagerprefill`` = new
    requests' prompts prefilled eagerly, not through the prefill CUDA graphs (the baseline of
    :mod:`cosyvoice_runtime.llm.prefill_graph`), ``gcfreeze`` = (``bench/capacity.py``) the objects
    alive after the mode's set-up and warm-up frozen out of the garbage collector's walks, as a
    serving replica does (:mod:`deployments.python_gc`)."""
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
                "lenbatch", "express", "cvinc", "steps", "eagerprefill", "noprefix", "gcfreeze"}
PROMPT_CACHE_BYTES = 1024**3  # the replica's default token2wav.cv2_prompt_cache_bytes
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
                "streamed_flow": "incremental" if "cvinc" in extra else "recompute",
                "length_ratio": LENGTH_RATIO if "lenbatch" in extra else None, "stepped": "steps" in extra,
                "prefill_graphs": "eagerprefill" not in extra,
                "prompt_cache_bytes": 0 if "noprefix" in extra else PROMPT_CACHE_BYTES}
    graphs = "all" if "allgraphs" in extra else "solve" if "graphs" in extra else None
    model, sim_args["express"] = _prepared(base, kind, prec, graphs, flow_batch, n_tokens, min_first_hop,
                                           compile_backend, express="express" in extra, stepper="steps" in extra,
                                           incremental="cvinc" in extra)
    return model, sim_args


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
              n_tokens: int, min_first_hop: int | None, compile_backend: str = "inductor",
              express: bool = False, stepper: bool = False,
              incremental: bool = False) -> tuple[CosyVoiceModel, CosyVoiceModel | None]:
    """The cast (compiled / graphed) copy of ``base`` for a mode, and the express lane's model
    (own flow and vocoder copies and graphs) when asked; modes that differ only in scheduling
    (fastswitch) share it, so graphs are captured once per run.

    ``graphs``: None, "solve" (the flow solve) or "all" (the solve, the CV2 encoder and the CV2
    vocoder on a copy of the vocoder, captured as a replica does it)."""
    key = (id(base), kind, prec, graphs, flow_batch, n_tokens, min_first_hop if graphs == "all" else None, express,
           stepper, incremental)
    if key not in _PREPARED:
        _PREPARED.clear()  # one prepared copy at a time: GPU memory
        model = cast(base, DTYPES[prec])
        if kind == "compile" or graphs == "all":  # both change the vocoder: the base one stays eager for other modes
            model.hift = copy.deepcopy(model.hift)
        if kind == "compile":  # what mode torchscript does in a replica: estimator, encoder, vocoder body
            compile_model(model, backend=compile_backend)
        ex = None
        if express:  # the express lane's own flow and vocoder (graphs hold static buffers: one set per lane)
            if kind != "pytorch":
                raise ValueError("extra express: kind pytorch only")
            ex = CosyVoiceModel(spec=model.spec, llm=model.llm, flow=copy.deepcopy(model.flow),
                                hift=copy.deepcopy(model.hift))
        if graphs and model.device.type == "cuda":
            _capture(model, graphs, flow_batch, 2 * (PROMPT_SPEECH + n_tokens), min_first_hop, stepper, incremental)
            if ex is not None:  # first and second chunks only: short solves, small batches
                _capture(ex, graphs, EXPRESS_BATCH, 2 * (PROMPT_SPEECH + 3 * model.spec.stream.token_hop_len),
                         min_first_hop)
        _PREPARED[key] = (model, ex)
    return _PREPARED[key]


def _capture(model: CosyVoiceModel, graphs: str, max_batch: int, max_frames: int, min_first_hop: int | None,
             stepper: bool = False, incremental: bool = False) -> None:
    t0 = time.perf_counter()
    enable_flow_graphs(model.flow, max_batch=max_batch, max_frames=max_frames, encoder=graphs == "all", stepper=stepper,
                       incremental=incremental)
    n = capture_flow_graphs(model.flow)
    n_voc = 0
    if graphs == "all" and not model.spec.hift.causal:  # the CV2 vocoder
        n_voc = graph_streaming_vocoder(model.hift, model.spec, max_batch, min_first_hop=min_first_hop).num_graphs
    logger.info("captured %d flow and %d vocoder graphs (batch <= %d, frames <= %d) in %.1f s", n, n_voc, max_batch,
                max_frames, time.perf_counter() - t0)


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
