"""Streaming capacity at an SLO: real-time streams per replica with p99 first audio <= 300 ms,
no underrun and no failure (issue 14). Throughput delivered outside the SLO is not capacity. The
Poisson rate is also searched for p95 first audio <= 150 ms (issue 39: ``slo_rate_rps_p95``).

Load and search live in ``bench/capacity_load.py`` (voice-agent sessions, Poisson arrivals,
doubling then bisection), the workload in ``bench/workload.py`` (``--workload production``, the
default: corpus sentences, a voice pool and cold voices; ``synthetic``: the ``--mix`` lengths as
one made-up word in one voice, what every figure before it measured), the targets in
``bench/capacity_targets.py``:

    # whole Serve application over HTTP (ingress, frontend, synthesizer) from a config
    FAST_COSY_MODEL_DIR=/tmp/cv2-full python -m bench.capacity --level serve --config configs/single-gpu.yaml
    # the config's frontend and synthesizer objects in this process: no Ray, no HTTP (what those cost)
    FAST_COSY_MODEL_DIR=/tmp/cv2-full python -m bench.capacity --level synth --config configs/single-gpu.yaml
    # the same, one search per arm: the config's synthesizer with overrides (bench/replica.py)
    python -m bench.capacity --level synth --arm default --arm recompute:token2wav.cv2_flow=recompute
    # either of those two without a GPU: the synthesizer's runtime takes the H200's times
    # (bench/timed_runtime.py), so the serving layer meets GPU-like load on a CPU machine
    python -m bench.capacity --level serve --timed --config configs/single-gpu.yaml --num-cpus 8

The synth level is one replica's own code in one process; the replica simulation that an earlier
``--level replica`` ran (``bench/replica_sim.py``, a second replica beside the product's, lacking
its newer code paths) is gone: its figures stay in the records under ``_sim`` keys.

Writes ``capacity-<level>[-cosyvoice3]-<device>-<date>[-tag].{md,json}`` with plots (first audio
and underruns against load, GPU utilisation against load), rewritten after every probe so a run cut
short keeps what it measured, and adds the level's figures, with their device and date, to
``latest.json`` (``cosyvoice3-latest.json`` for CosyVoice3; not a ``--timed`` run's: no GPU served
them).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import gc
import json
import logging
import math
import os
import tempfile
import time
from pathlib import Path

import httpx
import torch
import yaml

from bench.capacity_counters import GpuSampler, probe_counters
from bench.capacity_load import Mix, Probe, Slo, Workload, closed_loop, open_loop, rate_search, sessions_search
from bench.capacity_report import update_latest, write_report
from bench.capacity_targets import TOKENS_PER_S, HttpTarget, InProcessTarget
from bench.load import register_voices, synthetic_prompt_wav
from bench.random_model import PROMPT_SPEECH
from bench.replica import GRAPHS_WAIT_S, Arm, require_stepped, wait_for_graphs
from bench.report import slug
from bench.soak import config_env, start_local, wait_idle
from bench.timed_fleet import factory_name
from bench.timed_runtime import PROFILES
from bench.workload import add_args, length_summary, register_pool, source_from_args
from deployments.frontend import TextFrontend
from deployments.synthesizer import Synthesizer
from serve_app.args import AppArgs, application_of

logger = logging.getLogger("bench.capacity")
DEFAULT_MIX = "40:1-3,40:3-8,20:8-20"


class Run:
    """Everything measured so far in one invocation; rewrites its report after each probe."""

    def __init__(self, args: argparse.Namespace, work: Workload, slo: Slo, device: str) -> None:
        self.args, self.work, self.slo, self.device = args, work, slo, device
        # the Poisson target of issue 39 (p95 first audio), searched beside the p99 SLO
        self.slo_p95 = Slo(ttfa_p99_ms=math.inf, max_underruns=slo.max_underruns,
                           ttfa_p95_ms=getattr(args, "ttfa_p95_ms", 150.0))
        self.lengths: list[tuple[float, float]] = []  # (drawn, served) s of every judged request served
        self.date = dt.date.today().isoformat()
        self.searches: list[dict] = []  # {"mode", "kind": sessions|rate, "capacity", "probes": [summary...]}
        # CosyVoice3 runs are named apart: the same day's CosyVoice2 report of that level is not overwritten
        family = "" if args.family == "cosyvoice2" else f"-{args.family}"
        stem = f"capacity-{args.level}{family}-{slug(device)}-{self.date}" + (f"-{args.tag}" if args.tag else "")
        self.out = Path(args.out)
        self.stem = stem

        # what served the probes (the serve level reads it from the service's /health)
        self.model = f"{args.family}, model not reported"  # the level reads what its synthesizer loaded
        self.random_weights = True
        self.http_proxy: str | None = None  # the serve level's HTTP path
        self.notes: list[str] = []  # what the report's reader must know about the setup

    def search(self, mode: str, kind: str) -> dict:
        entry = {"mode": mode, "kind": kind, "capacity": None, "probes": []}
        self.searches.append(entry)
        return entry

    def record(self, entry: dict, probe: Probe, extra: dict) -> None:
        probe.extra.update(extra)
        row = probe.summary(self.slo)
        row["meets_slo_p95"] = self.slo_p95.meets(row)
        self.lengths += [(t.drawn_s, t.audio_s) for t in probe.traces if t.error is None and t.chunk_times_s]
        entry["probes"].append(row)
        print(json.dumps({"mode": entry["mode"], "kind": entry["kind"], **row}, default=str), flush=True)
        self.write()

    def workload(self) -> dict:
        return {**self.work.source.describe(), "seed": self.work.seed, "window_s": self.work.window_s,
                "ramp_s": self.work.ramp_s, "c1_window_s": self.args.c1_window_s,
                "served_length": length_summary(self.lengths), "slo_ttfa_p99_ms": self.slo.ttfa_p99_ms,
                "slo_ttfa_p95_ms": self.slo_p95.ttfa_p95_ms,
                "slo_underruns": self.slo.max_underruns, "family": self.args.family, "level": self.args.level,
                "model": self.model, "random_weights": self.random_weights, "timing_model": self.args.timed,
                "http_proxy": self.http_proxy, "notes": self.notes}

    def write(self) -> dict:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"device": self.device, "date": self.date, "workload": self.workload(), "searches": self.searches}
        (self.out / f"{self.stem}.json").write_text(json.dumps(doc, indent=1, default=str))
        write_report(self.out, self.stem, doc)
        return update_latest(self)  # after every probe: a run cut short still leaves its finished searches there


def _probe_extra(probe: Probe, sampler: GpuSampler | None) -> dict:
    t0, t1 = probe.span
    return {"gpu_util_pct": sampler.mean(t0, t1) if sampler else None}


def graph_coverage(app: AppArgs, work: Workload) -> str | None:
    """Why a probe may measure eager flow calls: the config's flow graphs (``flow_graph_max_s``)
    are shorter than the workload's longest request, voice prompt included. H100 2026-12-05: 20 s graphs
    broke at 24 sessions what 24 s graphs held at 36 (bench/results/2026-12-05-h100-capacity/capacity-h100-2026-12-05.md)."""
    synth = app.synthesizer
    need_s = work.source.prompt_s_max + work.source.longest_s
    if not synth.cuda_graphs or synth.device == "cpu" or synth.flow_graph_max_s >= need_s:
        return None
    return (f"the config's flow graphs cover {synth.flow_graph_max_s:g} s of prompt + audio and the workload's "
            f"longest request (its voice's prompt included) is {need_s:.1f} s: its last chunks run eagerly on a GPU (`graph misses`); raise "
            "`synthesizer.flow_graph_max_s` to measure the replica, not that")


def _note_coverage(run: Run, app: AppArgs) -> None:
    if note := graph_coverage(app, run.work):
        logger.warning("%s", note)
        run.notes.append(note)


def run_serve(args: argparse.Namespace, run: Run, sampler: GpuSampler | None) -> None:
    _note_coverage(run, AppArgs.from_file(args.config))
    url = start_local(Path(args.config), num_cpus=args.num_cpus)
    voice = register_voices(url, 1, prefix="capacity", prompt_seconds=(PROMPT_SPEECH / TOKENS_PER_S,))[0]
    target = HttpTarget(url, voice)
    asyncio.run(register_pool(target, run.work.source.voices))
    run.model, run.random_weights = served_model(url)
    # Ray reads it from the environment when it starts (not a Serve config key)
    run.http_proxy = ("HAProxy with direct ingress" if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
                      else "Serve's proxy actor")

    def settle() -> None:  # the next probe starts on an idle service
        if not wait_idle(url, timeout_s=120):
            logger.warning("service not idle 120 s after a probe")

    if not wait_idle(url, timeout_s=GRAPHS_WAIT_S):  # also: every replica's background graphs captured
        logger.warning("service not idle (background CUDA graphs?) %.0f s after start", GRAPHS_WAIT_S)
    _searches(args, run, Path(args.config).stem, target, sampler, settle=settle)


def apply_replica_env(config: Path) -> None:
    """The environment the config gives its replicas, in this process (the in-process level), set
    before CUDA reads its allocator settings; torch read its thread count at import already."""
    for key, value in config_env(application_of(yaml.safe_load(config.read_text()))).items():
        os.environ.setdefault(key, value)
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def in_process_target(app: AppArgs, work: Workload, arm: Arm | None = None) -> InProcessTarget:
    """The config's frontend and synthesizer (with ``arm``'s overrides) in this process with the
    benchmark's voices registered (the caller closes it)."""
    source = app.model_source()
    frontend_cfg = app.frontend.model_copy(update={"voices_dir": tempfile.mkdtemp(prefix="capacity-voices-")})
    synth_cfg = arm.config(app.synthesizer) if arm is not None else app.synthesizer

    async def make():
        return TextFrontend(frontend_cfg, source), Synthesizer(synth_cfg, source)

    target = InProcessTarget(make, "capacity0")
    try:
        # the steady state is measured: the graphs left to the background first (graphs_before_ready: first)
        wait_for_graphs(target.synth, GRAPHS_WAIT_S)
        require_stepped(target.synth, "--level synth")
        target.register(synthetic_prompt_wav(PROMPT_SPEECH / TOKENS_PER_S), "Prompt number 0.")
        target.call(register_pool(target, work.source.voices))
    except BaseException:
        target.close()
        raise
    return target


def run_synth(args: argparse.Namespace, run: Run, sampler: GpuSampler | None) -> None:
    """The config's frontend and synthesizer in this process (:class:`InProcessTarget`), once per
    ``--arm`` (each a fresh replica of the config with its overrides), else once as configured."""
    app = AppArgs.from_file(args.config)
    _note_coverage(run, app)
    for arm in args.arm:  # every arm's overrides validated before the first arm's searches
        arm.config(app.synthesizer)
    for arm in args.arm or [None]:
        label = Path(args.config).stem + "-in-process" + (f"-{arm.name}" if arm else "")
        if arm is not None:
            run.notes.append(f"arm {arm.name}: {arm.describe()}")
        target = in_process_target(app, run.work, arm)
        try:
            run.model, run.random_weights = describe_served({"mode": target.synth.mode,
                                                             "runtime": target.synth.runtime.details})
            _searches(args, run, label, target, sampler)
        except RuntimeError as exc:  # this arm's replica died: report it, measure the next arm
            if arm is None:
                raise
            logger.exception("arm %s failed", arm.name)
            run.searches[-1]["error"] = f"{exc}: {exc.__cause__!r}"
            run.write()
        finally:
            target.close()
            target.synth.shutdown()  # before the next arm loads its model on the same device
            gc.unfreeze()  # its start-up heap (gc_freeze) collectable again, as the next arm's starts unfrozen


TIMED_SYNTHESIZER = {"device": "cpu", "dtype": "float32", "cuda_graphs": False, "max_mem_gb": None}
# --timed profiles: the H200's fixed times, and h100: the live ramp's replica, calibrated from the
# newest H100 production reading (bench/timed_fleet.py), starting at once
TIMED_FACTORIES = {**{name: f"bench.timed_runtime:{name}" for name in PROFILES}, "h100": factory_name(0.0)}


def timed_config(path: Path, profile: str = "h200") -> Path:
    """A copy of the Serve config whose synthesizer takes a GPU's times without a GPU
    (``profile`` one of TIMED_FACTORIES): that runtime, the CPU, no GPU resource, the stepped scheduler."""
    if profile not in TIMED_FACTORIES:
        raise ValueError(f"unknown timing profile {profile!r}; known: {', '.join(TIMED_FACTORIES)}")
    document = yaml.safe_load(path.read_text())
    app = application_of(document)
    args = app.setdefault("args", {})
    if not args.get("model_dir") and not os.environ.get("FAST_COSY_MODEL_DIR"):
        args["tiny_family"] = "cosyvoice2"  # the frontend's tokenizer and prompt features; the synthesizer loads none
    synth = args.setdefault("synthesizer", {})
    synth.update(TIMED_SYNTHESIZER, runtime_factory=TIMED_FACTORIES[profile])
    synth["token2wav"] = {**(synth.get("token2wav") or {}), "scheduler": "steps"}
    synth["resources"] = {**(synth.get("resources") or {}), "num_gpus": 0}
    out = Path(tempfile.mkdtemp(prefix="capacity-timed-")) / path.name
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    return out


def served_model(url: str) -> tuple[str, bool]:
    """What the service's synthesizer loaded, from its /health: a description, random weights."""
    replicas = httpx.get(f"{url}/health?detail=1", timeout=30).json().get("synthesizer_replicas") or {}
    return describe_served(next(iter(replicas.values()), {}))


def describe_served(info: dict) -> tuple[str, bool]:
    """A description of what a synthesizer loaded (its /health entry: ``mode``, ``runtime``) and
    whether its weights are random."""
    rt = info.get("runtime") or {}
    random = bool(rt.get("random_weights"))
    parts = [str(rt.get("family", "family not reported"))]
    if rt.get("llm_params_m"):
        parts.append(f"{rt['llm_params_m']}M-parameter LLM")
    parts.append(("random weights" if random else "trained weights") if "random_weights" in rt
                 else "weights not reported")
    parts += [f"mode {info['mode']}"] if info.get("mode") else []
    parts += [f"token2wav scheduler {rt['t2w_scheduler']}"] if rt.get("t2w_scheduler") else []
    parts += [f"timing model: {rt['timing_model']}"] if rt.get("timing_model") else []
    return ", ".join(parts), random


def _searches(args, run: Run, mode: str, target, sampler, settle=lambda: None) -> None:
    def probe_fn(kind: str, entry: dict, work: Workload):
        async def probe(load):
            logger.info("%s %s: probing %s", mode, kind, load)
            loop_fn = closed_loop if kind == "sessions" else open_loop
            before = await target.counters()
            result = await loop_fn(target, load, work, run.slo)
            deltas = probe_counters(before, await target.counters())
            run.record(entry, result, {**_probe_extra(result, sampler), **deltas})
            if getattr(target, "failed", None) is not None:  # not an SLO miss: the search stops here
                raise RuntimeError(f"{mode}: the replica failed during the {kind} probe at {load}") from target.failed
            settle()
            return result
        return probe

    probes: list[dict] = []
    if args.loads:  # A/B arms at fixed loads: every load probed, nothing searched, no capacity claimed
        entry = run.search(mode, "loads")
        for load in args.loads:
            asyncio.run(probe_fn("sessions", entry, run.work)(load))
        probes = entry["probes"]
        run.write()
    elif args.sessions:
        entry = run.search(mode, "sessions")
        entry["capacity"], _ = sessions_search(probe_fn("sessions", entry, run.work), run.slo, start=args.start,
                                               ceiling=args.max_sessions, tolerance=args.tolerance)
        entry["at_ceiling"] = entry["capacity"] == args.max_sessions  # a lower bound, not the capacity
        probes = entry["probes"]
        run.write()
    if not any(p["load"] == 1 for p in probes):  # first audio at one stream, for latest.json
        short = dataclasses.replace(run.work, window_s=args.c1_window_s, ramp_s=0.0, wait_playback=False)
        one = run.search(mode, "one-session")
        asyncio.run(probe_fn("sessions", one, short)(1))
    if args.open_loop:  # two searches, one set of probes: a rate probed once is judged by both SLOs
        rates = run.search(mode, "rate")
        measured: dict[float, Probe] = {}
        rate_probe = probe_fn("rate", rates, run.work)

        async def once(rate: float) -> Probe:
            if rate not in measured:
                measured[rate] = await rate_probe(rate)
            return measured[rate]

        rates["capacity"], _ = rate_search(once, run.slo, start=args.rate_start, tolerance=args.tolerance)
        rates["capacity_p95"], _ = rate_search(once, run.slo_p95, start=args.rate_start, tolerance=args.tolerance)
        run.write()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--level", choices=["serve", "synth"], default="synth",
                    help="synth: the config's frontend and synthesizer in this process, without Ray or HTTP")
    ap.add_argument("--family", default="cosyvoice2", choices=["cosyvoice2", "cosyvoice3"])
    ap.add_argument("--arm", action="append", default=[], type=Arm.parse, metavar="NAME[:KEY=VALUE,...]",
                    help="synth level: one search per arm, the config's synthesizer with these overrides "
                         "(bench/replica.py; repeat for an A/B)")
    ap.add_argument("--config", default="configs/single-gpu.yaml", help="serve and synth levels: the Serve config")
    ap.add_argument("--timed", nargs="?", const="h200", default=None, choices=sorted(TIMED_FACTORIES),
                    help="serve and synth levels: the synthesizer's runtime takes a GPU's times on the CPU "
                    "(bench/timed_runtime.py; default profile h200; h100: the live ramp's replica calibrated "
                    "by bench/timed_fleet.py) instead of loading the model")
    ap.add_argument("--num-cpus", type=float, default=16, help="serve level: CPUs given to local Ray")
    ap.add_argument("--mix", default=DEFAULT_MIX, help="synthetic workload: utterance lengths, WEIGHT:LO-HI "
                    "seconds, comma-separated")
    add_args(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window-s", type=float, default=60.0, help="steady-load window judged per probe")
    ap.add_argument("--ramp-s", type=float, default=5.0, help="span over which sessions start")
    ap.add_argument("--ttfa-ms", type=float, default=300.0, help="SLO: p99 time to first audio")
    ap.add_argument("--ttfa-p95-ms", type=float, default=150.0,
                    help="the Poisson rate's second search: p95 time to first audio (slo_rate_rps_p95)")
    ap.add_argument("--start", type=int, default=4, help="sessions of the first probe")
    ap.add_argument("--max-sessions", type=int, default=256)
    ap.add_argument("--tolerance", type=float, default=0.1, help="bisection stops within this fraction")
    ap.add_argument("--sessions", action=argparse.BooleanOptionalAction, default=True,
                    help="search the sessions at the SLO (--no-sessions: the one-session probe and the rate only)")
    ap.add_argument("--open-loop", action=argparse.BooleanOptionalAction, default=True,
                    help="also search the Poisson arrival rate")
    ap.add_argument("--loads", type=lambda s: [int(x) for x in s.split(",")], default=[],
                    help="probe exactly these session counts (comma-separated) instead of searching: A/B arms "
                         "on one machine (a missed probe does not send the search down and use the arm's time)")
    ap.add_argument("--rate-start", type=float, default=1.0)
    ap.add_argument("--c1-window-s", type=float, default=20.0, help="window of the one-session probe")
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    return measure(argv)[0]


def measure(argv: list[str] | None = None) -> tuple[dict, Path]:
    """Runs the tool; returns ``latest.json``'s figures and the path of the report's JSON
    (``fastcosy calibrate`` derives the load band's setpoint from it)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    if args.arm and args.level != "synth":
        raise SystemExit("--arm is for the synth level (the serve level runs the config as it is)")
    if args.timed:
        if args.workload == "production":  # real text would run to the timed engine's 20 tokens a text id
            args.workload = "production-lengths"
            logger.info("--timed: the production workload's lengths as one-word requests (--workload production-lengths)")
        args.config = str(timed_config(Path(args.config), args.timed))
        args.tag = "-".join(t for t in ("timed", args.timed.replace("_", "-"), args.tag) if t)
    if args.level == "synth":
        apply_replica_env(Path(args.config))
    torch.backends.cuda.matmul.allow_tf32 = False
    mix = Mix.parse(args.mix)
    work = Workload(mix, seed=args.seed, window_s=args.window_s, ramp_s=args.ramp_s, source=source_from_args(args, mix))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.timed else "cpu"
    run = Run(args, work, Slo(ttfa_p99_ms=args.ttfa_ms), device)
    sampler = GpuSampler() if torch.cuda.is_available() and not args.timed else None
    t0 = time.perf_counter()
    try:
        {"serve": run_serve, "synth": run_synth}[args.level](args, run, sampler)
    finally:
        if sampler:
            sampler.close()
        latest = run.write()
    logger.info("done in %.0f s: %s", time.perf_counter() - t0,
                {k: latest.get(k) for k in ("slo_streams", "slo_streams_serve", "slo_rate_rps", "slo_rate_rps_p95",
                                            "ttfb_p50_ms_c1")})
    return latest, run.out / f"{run.stem}.json"


if __name__ == "__main__":
    main()
