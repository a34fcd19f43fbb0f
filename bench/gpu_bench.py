"""Streaming throughput of one synthesizer replica: a closed loop per concurrency, for each arm.

Each arm is the product's replica built with config overrides (``bench/replica.py``): its
execution plan resolved and its runtime assembled as in a Serve replica, its engine loop and
token2wav driver serving the requests, in this process (no Ray actor, no HTTP). The base config
is the serve config's synthesizer (``--config``, default ``configs/single-gpu.yaml``); an arm
changes what it names (``--arm NAME:KEY=VALUE,...``; ``--arm default`` is the config as it is).

Every request does the same work, so rows compare: the zero-shot shapes of the official
baseline (87 prompt speech tokens, 14 prompt text tokens) and exactly ``--tokens`` speech tokens
(the replica's ``speech_length: text_rate`` without jitter, over a text whose reading time is that
long). The model is a random-weight directory (``--size full``: the official architectures) or
``--model-dir``. The sequential baseline runs one request at a time through the single-request
reference pipeline in eager fp32, which is how the official implementation serves.

    python -m bench.gpu_bench --family cosyvoice2 --arm default --arm fp32:dtype=float32 --out bench/results
    fastcosy bench throughput --arm default --arm torchscript:mode=torchscript
"""
from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import itertools
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.metrics import RequestTrace, summarize
from bench.random_model import PROMPT_SPEECH, PROMPT_TEXT, sync
from bench.replica import Arm, random_model_dir, require_stepped, wait_for_graphs
from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.speech_length import SpeakingRate, target_tokens
from cosyvoice_runtime.tiny_model import is_random_weight_model
from cosyvoice_runtime.yaml_config import read_model_spec
from deployments.model_source import ModelSource, resolve_device
from deployments.protocol import PreparedRequest, TextPiece, VoicePrompt
from deployments.synthesizer import Synthesizer
from serve_app.args import AppArgs

logger = logging.getLogger("bench")
WARMUP_TOKENS = 60  # per arm, two requests this long before the rows (allocations, kernel choice)


class Requests:
    """The benchmark's requests for one model: one random voice, text of an exact reading length."""

    def __init__(self, model_dir: Path, seed: int = 1) -> None:
        from cosyvoice_runtime.frontend.tokenizer import TextTokenizer

        self.spec = spec = read_model_spec(model_dir)
        self.tokenizer = TextTokenizer(Path(model_dir) / "CosyVoice-BlankEN", spec.family)
        g = np.random.default_rng(seed)
        prompt_text = g.integers(0, 150000, PROMPT_TEXT, dtype=np.int32)
        if spec.family == "cosyvoice3":
            prompt_text[0] = ENDOFPROMPT_TOKEN_ID  # CosyVoice3's LLM needs it in prompt text + text
        self.voice = VoicePrompt(
            family=spec.family, text_tokens=prompt_text,
            speech_tokens=g.integers(0, spec.llm.speech_token_size, PROMPT_SPEECH, dtype=np.int32),
            mel=g.standard_normal((2 * PROMPT_SPEECH, spec.flow.output_size), dtype=np.float32),
            embedding=g.standard_normal(spec.flow.spk_embed_dim, dtype=np.float32))
        self._text: dict[int, np.ndarray] = {}

    def text_ids(self, n_tokens: int) -> np.ndarray:
        """Text ids that the ``text_rate`` rule reads as exactly ``n_tokens`` speech tokens."""
        if n_tokens not in self._text:
            text = text_for_tokens(n_tokens, self.spec.token_frame_rate)
            ids = self.tokenizer.encode(text)
            if self.tokenizer.decode(ids) != text:  # the rule reads the decoded text
                raise ValueError(f"the tokenizer does not give back {text!r}: its length would differ")
            self._text[n_tokens] = np.asarray(ids, dtype=np.int32)
        return self._text[n_tokens]

    def prepared(self, i: int, n_tokens: int) -> PreparedRequest:
        return PreparedRequest(request_id=f"r{i}", pieces=[TextPiece("", self.text_ids(n_tokens))], prompt=self.voice,
                               llm_prompt_text_ids=self.voice.text_tokens, llm_use_prompt_speech=True, stream=True,
                               seed=i)


def text_for_tokens(n_tokens: int, token_rate: float) -> str:
    """A text whose reading time at the ``text_rate`` rule's rates is exactly ``n_tokens`` tokens:
    letters (as "an" pairs, one id each in the random-weight models' tokenizer) and as few Han
    characters as make the count exact (a letter is ~2.13 tokens, a Han character ~5.56)."""
    for han in range(12):
        rest = n_tokens - target_tokens("好" * han, token_rate, jitter=0) if han else n_tokens
        guess = max(0, round(rest * SpeakingRate().letters_per_s / token_rate))
        for letters in (guess, guess - 1, guess + 1):
            text = "an" * (letters // 2) + "a" * (letters % 2) + "好" * han
            if letters >= 0 and text and target_tokens(text, token_rate, jitter=0) == n_tokens:
                return text
    raise ValueError(f"no text reads as exactly {n_tokens} speech tokens")


async def one_request(synth: Synthesizer, req: PreparedRequest) -> RequestTrace:
    """One streamed request; its trace keeps the replica's first-audio stamps (ms from its start)."""
    trace = RequestTrace(submitted_s=time.perf_counter(), sample_rate=synth.sample_rate)
    try:
        async for chunk in synth.synthesize(req):
            if chunk.timing:
                trace.stages_ms = dict(chunk.timing)
            if chunk.samples.size:
                trace.add_chunk(time.perf_counter(), chunk.samples.size)
    except Exception as exc:  # noqa: BLE001 - a failed request is a row's figure, not the run's end
        trace.error = f"{type(exc).__name__}: {exc}"
    return trace


async def closed_loop(synth: Synthesizer, requests: Requests, concurrency: int, total: int, n_tokens: int,
                      deadline_s: float) -> tuple[list[RequestTrace], float]:
    """``concurrency`` streams in flight until ``total`` requests have finished. A row that takes
    longer than ``deadline_s`` dumps every thread's stack and raises TimeoutError, so one stuck
    row cannot use the whole device call."""
    ids = itertools.count()
    traces: list[RequestTrace] = []

    async def stream() -> None:
        while (i := next(ids)) < total:
            traces.append(await one_request(synth, requests.prepared(i, n_tokens)))

    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(stream() for _ in range(concurrency))), deadline_s)
    except TimeoutError:
        faulthandler.dump_traceback(all_threads=True)
        raise TimeoutError(f"row c={concurrency} not done after {deadline_s:.0f} s: {len(traces)}/{total} "
                           f"finished; engine {synth.loop.stats()}") from None
    return traces, time.perf_counter() - t0


def _median_ms(traces: list[RequestTrace], stamp: str) -> float | None:
    values = [t.stages_ms[stamp] for t in traces if stamp in t.stages_ms]
    return round(statistics.median(values), 1) if values else None


COUNTERS = ("cuda_graph_captures_total", "cuda_graph_misses_total", "flow_passes_total", "flow_rows_in_passes_total")


async def measure_arm(arm: Arm, cfg, source: ModelSource, requests: Requests, concurrencies: list[int],
                      n_tokens: int, min_requests: int, deadline_s: float, on_plan, on_row) -> None:
    """Build the arm's replica (``on_plan(plan=...)``: the plan it resolved), run its rows
    (``on_row`` after each), shut it down."""
    synth = Synthesizer(cfg, source)
    try:
        plan = synth.plan.as_dict()
        on_plan(plan=plan)
        logger.info("arm %s (%s): plan %s", arm.name, arm.describe(), plan)
        require_stepped(synth, "gpu_bench")
        wait_for_graphs(synth)
        await closed_loop(synth, requests, 2, 2, min(WARMUP_TOKENS, n_tokens), deadline_s)
        for c in concurrencies:
            cuda = synth.runtime.device.startswith("cuda")
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            before = synth.stats()
            traces, wall = await closed_loop(synth, requests, c, max(2 * c, min_requests), n_tokens, deadline_s)
            after = synth.stats()
            delta = {k.removesuffix("_total"): after[k] - before[k] for k in COUNTERS}
            passes = delta.pop("flow_passes")
            row = {"arm": arm.name, "concurrency": c, **summarize(traces, wall),
                   # first audio's parts (ms from the request's start, medians): first speech token, the
                   # first chunk's job taken by the token2wav driver
                   "first_token_ms_p50": _median_ms(traces, "first_token"),
                   "first_job_ms_p50": _median_ms(traces, "t2w_started"),
                   "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                   "graph_captures": delta["cuda_graph_captures"], "graph_misses": delta["cuda_graph_misses"],
                   "flow_passes": passes,
                   "flow_rows_per_pass": round(delta["flow_rows_in_passes"] / passes, 2) if passes else None}
            print(json.dumps(row), flush=True)
            on_row(row)
    finally:
        await synth.loop.close()  # the step thread ended: nothing holds the model once the replica goes
        synth.shutdown()
        del synth
        gc.unfreeze()  # the replica's frozen start-up heap (gc_freeze) collectable, so its model goes
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next arm loads its own model on the same GPU


def run_baseline(model_dir: Path, device: str, requests: Requests, n_tokens: int, count: int) -> dict:
    """One request at a time, eager fp32, through the single-request reference pipeline (after
    one short request of warm-up)."""
    from cosyvoice_runtime.llm.generate import default_sample_fn
    from cosyvoice_runtime.model import load_model
    from cosyvoice_runtime.pipeline import Pipeline

    pipe = Pipeline(load_model(model_dir, device=device))
    eos = pipe.spec.llm.eos

    def run(n: int, count: int) -> dict:
        def forced(logp, state):  # exactly n tokens, as the replica's text_rate rule decodes
            return eos if state.step >= n else default_sample_fn(logp, state)

        text = torch.as_tensor(requests.text_ids(n))
        traces = []
        t0 = time.perf_counter()
        for i in range(count):
            trace = RequestTrace(submitted_s=time.perf_counter(), sample_rate=pipe.spec.sample_rate)
            for chunk in pipe.tts(text, requests.voice, stream=True, seed=i, sample_fn=forced):
                sync(pipe.model.device)
                trace.add_chunk(time.perf_counter(), chunk.numel())
            traces.append(trace)
        return summarize(traces, time.perf_counter() - t0)

    run(min(WARMUP_TOKENS, n_tokens), 1)
    return run(n_tokens, count)


def bench_settings(base, concurrencies: list[int], n_tokens: int, text_ids: int, args) -> dict:
    """What the benchmark sets under every arm: room for the highest concurrency and the longest
    request, exact lengths, no admission refusals (a closed loop measures, it is not refused)."""
    running = max(base.max_running, *concurrencies)
    fixed = {"max_running": running, "max_ongoing_requests": running, "speech_length": "text_rate",
             "speech_length_jitter": 0.0, "admission": {"enabled": False}, "runtime_factory": None,
             "max_model_len": max(base.max_model_len, PROMPT_SPEECH + PROMPT_TEXT + text_ids + n_tokens + 8)}
    if args.device:
        fixed["device"] = args.device
    if args.flow_batch:
        fixed["token2wav"] = {"max_batch_size": args.flow_batch}
    return fixed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"],
                    help="the random-weight model's family (a --model-dir has its own)")
    ap.add_argument("--size", default="full", choices=["full", "tiny"], help="the random-weight model's size")
    ap.add_argument("--model-dir", default=None, help="a model directory instead of the random-weight one")
    ap.add_argument("--config", default="configs/single-gpu.yaml", help="serve config whose synthesizer is the base")
    ap.add_argument("--arm", action="append", default=[], type=Arm.parse, metavar="NAME[:KEY=VALUE,...]",
                    help="a replica config to measure (repeat for an A/B); default: the base config alone")
    ap.add_argument("--device", default=None, help="the replicas' device (default: the config's)")
    ap.add_argument("--flow-batch", type=int, default=None, help="token2wav.max_batch_size (default: the config's)")
    ap.add_argument("--concurrency", default="1,4,8,16,32,64")
    ap.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 = 1 s)")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--baseline-requests", type=int, default=3, help="0: no sequential baseline")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--deadline-s", type=float, default=180.0, help="a row taking longer fails (stacks dumped)")
    ap.add_argument("--tag", default="", help="suffix of the report name (several runs on one day)")
    ap.add_argument("--debug", action="append", default=[], metavar="LOGGER",
                    help="set this logger to DEBUG, e.g. cosyvoice_runtime: one timestamped line per captured graph")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in args.debug:
        logging.getLogger(name).setLevel(logging.DEBUG)
    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = Path(args.model_dir) if args.model_dir else random_model_dir(args.family, args.size)
    requests = Requests(model_dir)
    family = requests.spec.family
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    base = AppArgs.from_file(args.config).synthesizer
    fixed = bench_settings(base, concurrencies, args.tokens, len(requests.text_ids(args.tokens)), args)
    arms = args.arm or [Arm("default")]
    configs = {arm.name: arm.config(base, fixed) for arm in arms}  # every arm validated before any runs
    if len(configs) < len(arms):
        raise SystemExit("two arms share a name")
    device = resolve_device(next(iter(configs.values())).device)
    baseline = None
    if args.baseline_requests:
        baseline = run_baseline(model_dir, device, requests, args.tokens, args.baseline_requests)
        print(json.dumps({"baseline": baseline}), flush=True)
        gc.collect()  # its model goes before the replicas load theirs
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    weights = "random weights" if is_random_weight_model(model_dir) else "trained weights"
    model = (f"{family} from `{model_dir}` ({weights}); text of {len(requests.text_ids(args.tokens))} ids "
             "read as exactly the tokens")
    rows: list[dict] = []
    errors: list[str] = []
    described: dict[str, dict] = {arm.name: {"overrides": arm.describe()} for arm in arms}
    from bench.report import write_report

    def report(row=None):  # rewritten after every row, so a timeout still leaves results
        if row is not None:
            rows.append(row)
        if rows:
            write_report(Path(args.out), device_name, family, args.tokens, baseline, rows, arms=described,
                         model=model, config=args.config, notes="\n".join(f"- arm failed: {e}" for e in errors),
                         tag=args.tag)

    source = ModelSource(str(model_dir))
    for arm in arms:
        try:
            asyncio.run(measure_arm(arm, configs[arm.name], source, requests, concurrencies, args.tokens,
                                    args.min_requests, args.deadline_s, described[arm.name].update, report))
        except Exception as exc:  # keep measuring the other arms; the report lists the failure
            logger.exception("arm %s failed", arm.name)
            errors.append(f"{arm.name}: {type(exc).__name__}: {exc}")
        report()
    if errors:
        print(json.dumps({"errors": errors}), flush=True)


if __name__ == "__main__":
    main()
