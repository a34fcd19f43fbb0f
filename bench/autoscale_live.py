"""A live autoscaling ramp: the real Serve app and policy over a fleet of timed GPU replicas (issue 40).

One local Ray cluster declares ``--gpus`` logical GPUs; the Serve app is ``serve_app.app.build_app``
of a config (``configs/multi-gpu.yaml``: real ingress and frontend, one synthesizer replica per
GPU, the ``LoadBandPolicy`` of ``deployments/autoscaling_policy.py`` with the config's band and
delays). Synthesizer replicas run :mod:`bench.timed_fleet`: the H100 production reading's speed and
the measured GPU cold start (times ``--start-scale``) before they serve. Voice-agent sessions (the
capacity tool's: ask, play the answer out, ask again) follow a ramp in *replicas' worth* (one is
the sessions a replica holds at the band centre of its measured capacity): 0 -> ``--gpus`` over
``up`` s, a plateau, a burst, back down, idle. ``--time-scale`` compresses the ramp and Serve's
autoscaling delays, look-back and metrics push together (the requests themselves stay real time)::

    python -m bench.autoscale_live --gpus 8 --time-scale 0.33 --tag gpu-host
    python -m bench.autoscale_live --gpus 2 --time-scale 0.05 --start-scale 0.01 --tag cpu  # CPU machine

Every ``10 s x time-scale`` it records the replicas starting / running / draining (Serve's states),
each replica's requests in flight, the policy's last decision with its signal (``RecordedPolicy``
writes them from the controller), and the bin's requests: first audio p50 / p99, underruns, 429s,
streams cut. Writes a run folder ``bench/results/<date>-<card>-autoscale[-tag]/`` (``autoscale.json``,
``autoscale.md``, ``replicas.png``, ``first-audio.png``, ``run.json``), ``bench/results/autoscale-latest.json``
(``--latest``), and replays the ramp in the fleet simulation (``bench/fleet_live.py``) for
``sim_vs_live_replica_error``. How to read it: docs/tuning.md, "The live ramp".
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench.autoscale_report import summarise, write_outputs
from bench.capacity_load import Clock, Mix, Workload, exponential_starts, serve_one, stages_with_proxy
from bench.capacity_targets import HttpTarget
from bench.load import register_voices
from bench.timed_fleet import RESULTS, Calibration, calibrate, cold_start_record, factory_name
from bench.workload import LengthsOf, ProductionSource, SyntheticSource
from deployments.constants import RAY_SYSTEM_CONFIG

logger = logging.getLogger("bench.autoscale_live")
ROOT = Path(__file__).resolve().parent.parent
APP, DEPLOYMENT = "tts", "Synthesizer"
SERVE_PUSH_S = 10.0  # Serve's default replica and handle metrics push interval (scaled with the ramp)
MIX = "40:1-3,40:3-8,20:8-20"  # the capacity tool's synthetic voice-agent answers
# A step of sessions (the burst) starts as the capacity tool's sessions do (capacity_load.Workload's
# ramp_s: exponential gaps over ~5 s), the arrivals the replica's measured capacity was read under.
# All at once (0 s) the live2 ramp's burst bin read p99 442 ms where the next read 193 (H100, 2026-12-07).
JOIN_SPREAD_S = Workload.ramp_s  # the dataclass default


@dataclass(frozen=True)
class RampShape:
    """The ramp in reference seconds (before ``--time-scale``) and replicas' worth."""

    up_s: float = 600.0  # 0 -> peak
    plateau_s: float = 180.0
    burst_s: float = 60.0
    burst_share: float = 0.25  # the burst adds this share of the peak
    hold_s: float = 60.0  # back at the peak after the burst
    # peak -> 0 as slowly as the way up: Serve scales in only after downscale_delay_s (and the
    # policy's look-back), so over 180 s the fleet stayed 2-6 replicas above the ideal for 13 of the
    # descent's 18 bins (H100 host, 2026-12-07): that measured the delay, not the policy
    down_s: float = 600.0
    idle_s: float = 180.0  # no load: the fleet scales in

    def points(self, peak: float) -> list[tuple[float, float]]:
        """(reference s, replicas' worth) corners; linear between, a step where two share a time."""
        t, pts = 0.0, [(0.0, 0.0)]
        for dur, level in ((self.up_s, peak), (self.plateau_s, peak), (0, peak * (1 + self.burst_share)),
                           (self.burst_s, peak * (1 + self.burst_share)), (0, peak), (self.hold_s, peak),
                           (self.down_s, 0.0), (self.idle_s, 0.0)):
            t += dur
            pts.append((t, level))
        return pts

    @property
    def total_s(self) -> float:
        return self.up_s + self.plateau_s + self.burst_s + self.hold_s + self.down_s + self.idle_s


def app_config(base: Path, gpus: int, cal: Calibration, start_s: float, frontends: int | None,
               ingresses: int | None) -> dict[str, Any]:
    """The config's application with timed synthesizers on ``gpus`` logical GPUs, its load band's
    setpoint at the calibration's ``slo_streams``; other keys as the config has them."""
    document = yaml.safe_load(base.read_text())
    (app,) = document["applications"]
    args = app["args"]
    args["model_dir"] = None
    args["tiny_family"] = "cosyvoice2"  # the frontend's tokenizer and prompt features; the synthesizer loads none
    synth = args["synthesizer"]
    synth.update(device="cpu", dtype="float32", cuda_graphs=False, runtime_factory=factory_name(start_s),
                 startup_timeout_s=max(float(synth.get("startup_timeout_s", 600)), 3 * start_s + 60))
    synth.pop("max_mem_gb", None)
    synth["token2wav"] = {**(synth.get("token2wav") or {}), "scheduler": "steps"}
    synth["resources"] = {**(synth.get("resources") or {}), "num_gpus": 1, "num_cpus": 1}
    auto = synth["autoscaling"]
    auto["max_replicas"] = gpus
    auto["load_band"] = {**auto["load_band"], "enabled": True, "slo_streams": cal.slo_streams}
    if frontends:
        args["frontend"]["num_replicas"] = frontends
    if ingresses:
        args["ingress"]["num_replicas"] = ingresses
    return app


@contextlib.contextmanager
def recorded_policy(record: Path, time_scale: float, every_s: float):
    """Build-time: the synthesizer's Serve autoscaling options with the policy wrapped by
    :class:`bench.autoscale_record.RecordedPolicy` and its delays, look-back and metrics interval
    times ``time_scale`` (the config's own values are validated unscaled)."""
    from deployments.options import AutoscalingKnobs

    original = AutoscalingKnobs.serve_config

    def scaled(self) -> dict[str, Any]:
        cfg = original(self)
        for key in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s"):
            cfg[key] = cfg[key] * time_scale
        cfg["metrics_interval_s"] = SERVE_PUSH_S * time_scale
        policy = cfg.get("policy")
        if policy:
            cfg["policy"] = {"policy_function": "bench.autoscale_record:RecordedPolicy",
                             "policy_kwargs": {"inner": policy["policy_function"],
                                               "inner_kwargs": policy.get("policy_kwargs") or {},
                                               "record": str(record), "every_s": every_s}}
        return cfg

    AutoscalingKnobs.serve_config = scaled
    try:
        yield
    finally:
        AutoscalingKnobs.serve_config = original


def start_cluster(app: dict[str, Any], gpus: int, cpus: float, time_scale: float, record: Path) -> str:
    """Local Ray with ``gpus`` logical GPUs, Serve on a free port, the app deployed; its URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name in ("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S",
                 "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S"):
        os.environ[name] = f"{SERVE_PUSH_S * time_scale:g}"  # Ray's processes inherit it
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.args import AppArgs

    raw = dict(app["args"])
    raw["frontend"] = {**raw["frontend"], "voices_dir": tempfile.mkdtemp(prefix="autoscale-voices-")}
    args = AppArgs.model_validate(raw)
    env = {"RAY_AUTH_MODE": "disabled", **{k: str(v) for k, v in
                                           ((app.get("runtime_env") or {}).get("env_vars") or {}).items()}}
    ray.init(address="local", num_cpus=cpus, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             namespace="autoscale", runtime_env={"env_vars": env}, _system_config=RAY_SYSTEM_CONFIG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    with recorded_policy(record, time_scale, every_s=max(0.2, time_scale)):
        serve.run(build_app(args), name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


class Sampler(threading.Thread):
    """Every ``every_s``: Serve's replica states and each live replica's requests in flight."""

    def __init__(self, t0: float, every_s: float) -> None:
        super().__init__(daemon=True, name="autoscale-sampler")
        self.t0, self.every_s = t0, every_s
        self.samples: list[dict[str, Any]] = []
        self._halt = threading.Event()

    def sample(self) -> dict[str, Any]:
        import ray
        from ray import serve

        row: dict[str, Any] = {"t_s": round(time.perf_counter() - self.t0, 3)}
        try:
            states = serve.status().applications[APP].deployments[DEPLOYMENT].replica_states
            row["states"] = {str(getattr(k, "value", k)): int(v) for k, v in states.items()}
            prefix = f"SERVE_REPLICA::{APP}#{DEPLOYMENT}#"
            names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
            refs = {n.removeprefix(prefix): ray.get_actor(n, namespace="serve").get_num_ongoing_requests.remote()
                    for n in names}
            row["ongoing"] = {}
            for rid, ref in refs.items():
                with contextlib.suppress(Exception):  # a replica stopping between the listing and the call
                    row["ongoing"][rid] = int(ray.get(ref, timeout=5))
        except Exception as exc:  # noqa: BLE001 - a missed sample is recorded as such
            row["error"] = repr(exc)[:200]
        return row

    def run(self) -> None:
        tick = 0
        while not self._halt.is_set():
            self.samples.append(self.sample())
            # on the bin grid: a slow sample (a loaded machine) skips a tick rather than shifting the rest
            tick = max(tick + 1, math.ceil((time.perf_counter() - self.t0) / self.every_s))
            self._halt.wait(max(0.0, self.t0 + tick * self.every_s - time.perf_counter()))

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=30)


@dataclass(frozen=True)
class Pause:
    """The ramp stops at ``at_s`` (its load held as it is there) until ``resume()`` is true or
    ``guard_s`` real seconds have passed: the CPU test waits on the fleet's own scale-out instead of
    hoping a compressed plateau lasts long enough on a loaded machine."""

    at_s: float
    resume: Callable[[], bool]
    guard_s: float


def join_offsets(n: int, spread_s: float, rng: random.Random) -> list[float]:
    """When the ``n`` sessions that join at one tick of the ramp send their first request, in s
    from the tick: one joins at once; a step of several (the burst) arrives as the capacity tool's
    sessions start, exponential gaps over ~``spread_s`` (0: all at once)."""
    return exponential_starts(n, spread_s, rng) if n > 1 else [0.0] * max(n, 0)


class SessionDriver:
    """Voice-agent sessions following ``sessions_at(t)``; a session asked to leave finishes the
    request it is in (no client cuts a stream) and leaves."""

    def __init__(self, target: HttpTarget, source, sessions_at, duration_s: float, seed: int,
                 wait_playback: bool, clock: Clock, pause: Pause | None = None,
                 join_spread_s: float = JOIN_SPREAD_S) -> None:
        self.target, self.source, self.sessions_at = target, source, sessions_at
        self.duration_s, self.seed, self.wait_playback, self.clock = duration_s, seed, wait_playback, clock
        self.pause, self.join_spread_s = pause, join_spread_s
        self._join_rng = random.Random(f"{seed}/join")
        self.paused_s = 0.0  # real seconds the ramp stood still at the pause
        self.resumed: bool | None = None  # None: no pause; False: its guard ran out
        self.requests: list[dict[str, Any]] = []
        self.open_per_s: list[tuple[float, int, int]] = []  # (real s since t0, sessions open, requests in flight)
        self.in_flight = 0
        self._leave: list[asyncio.Event] = []

    def ramp_time(self, now: float) -> float:
        """Where on the ramp ``now`` (real s since t0) is: the pause's time while it lasts."""
        p = self.pause
        if p is None or self.resumed is not None or now < p.at_s:
            return now - self.paused_s
        reached = p.resume()
        if reached or now - p.at_s >= p.guard_s:
            self.resumed = reached
            return now - self.paused_s
        self.paused_s = now - p.at_s
        return p.at_s

    async def session(self, i: int, leave: asyncio.Event, t0: float, start_at: float) -> None:
        rng = random.Random(f"{self.seed}/{i}")
        n = 0
        if await self.clock.wait_until(leave, start_at):
            return  # asked to leave before its first request
        while not leave.is_set():
            self.in_flight += 1
            try:
                trace = await serve_one(self.target, f"s{i}-{n}", self.source.draw(rng, i), self.clock)
            finally:
                self.in_flight -= 1
            self.requests.append(record_of(trace, t0, i))
            n += 1
            until = trace.playback_deadline_s() if trace.chunk_times_s and self.wait_playback else self.clock.now()
            if trace.error and trace.error.startswith("HTTP 429"):
                until = max(until, self.clock.now() + 1.0)  # a refused client waits a moment before it retries
            await self.clock.wait_until(leave, until)

    async def run(self, t0: float) -> None:
        tasks: list[asyncio.Task] = []
        tick = 0
        while (t := self.ramp_time(now := self.clock.now() - t0)) < self.duration_s:
            want = round(self.sessions_at(t))
            live = [k for k, e in enumerate(self._leave) if not e.is_set()]
            for offset in join_offsets(want - len(live), self.join_spread_s, self._join_rng):
                leave = asyncio.Event()
                self._leave.append(leave)
                start_at = self.clock.now() + offset
                tasks.append(asyncio.create_task(self.session(len(self._leave) - 1, leave, t0, start_at)))
            for k in live[want:] if len(live) > want else ():
                self._leave[k].set()  # the newest sessions leave first
            self.open_per_s.append((round(now, 3), want, self.in_flight))
            tick += 1
            await asyncio.sleep(max(0.0, t0 + tick * 0.5 - self.clock.now()))  # the ramp's own pace
        for e in self._leave:
            e.set()
        await asyncio.gather(*tasks)


def record_of(trace, t0: float, session: int) -> dict[str, Any]:
    """What the report keeps of one request (``t_s``: when it was sent, s after ``t0``). Its first
    audio's stages stay with it, so the report can say where its slowest requests' time went
    (a bin's p99 at a compressed time scale is about its slowest request)."""
    started = bool(trace.chunk_times_s)
    cut = started and (trace.error is not None or (trace.drawn_s and trace.audio_s < 0.5 * trace.drawn_s))
    return {"session": session, "t_s": round(trace.submitted_s - t0, 3),
            "ttfa_ms": round(trace.ttfa_s * 1e3, 1) if started else None,
            "stages_ms": {k: round(v, 1) for k, v in stages_with_proxy(trace).items()} if started else {},
            "audio_s": round(trace.audio_s, 3), "drawn_s": round(trace.drawn_s or 0.0, 3),
            "underruns": trace.underruns() if started else 0,
            "rejected_429": bool(trace.error and trace.error.startswith("HTTP 429")),
            "error": trace.error[:160] if trace.error else None, "cut": bool(cut)}


def read_policy(record: Path, wall0: float) -> list[dict[str, Any]]:
    if not record.exists():
        return []
    lines = [json.loads(x) for x in record.read_text().splitlines() if x.strip()]
    for line in lines:
        line["t_s"] = round(line.pop("wall_s") - wall0, 3)
    return lines


def drive(driver: SessionDriver, sampler: Sampler, t0: float, min_replicas: int, guard_s: float) -> tuple[bool, bool]:
    """Run the ramp with the sampler on, then wait for scale-in; returns ``(settled, cut_short)``.

    An interrupt (SIGINT: ``timeout -s INT``, as bench/device_capacity.sh stops a ramp that would
    outlast its call) ends the ramp where it is: the requests that finished and the samples taken
    are kept and written (a request still open is not counted, neither as served nor as cut), and
    the run is marked ``cut_short``, so a lease's time still gives a reading.
    """
    sampler.start()
    try:
        asyncio.run(driver.run(t0))
        return settle(sampler, min_replicas, guard_s), False
    except KeyboardInterrupt:
        logger.warning("interrupted at %.0f s of the ramp: writing what ran (cut_short)", time.perf_counter() - sampler.t0)
        return False, True
    finally:
        sampler.stop()


def settle(sampler: Sampler, min_replicas: int, guard_s: float) -> bool:
    """After the ramp: wait (sampling on) until the fleet is back at ``min_replicas`` with none
    starting or draining; False when the guard ran out first."""
    deadline = time.monotonic() + guard_s
    while time.monotonic() < deadline:
        last = sampler.samples[-1] if sampler.samples else {}
        if last.get("states") == {"RUNNING": min_replicas}:
            return True
        time.sleep(sampler.every_s)
    return False


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> tuple[str, str]:
    """(a description, the card the run folder is named by: the host's GPU, else ``cpu``)."""
    gpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError, IndexError):
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=False).stdout.strip().splitlines()[0]
    load = os.getloadavg()[0]  # a shared machine's other work shows here
    return (f"{os.cpu_count()} CPUs{f' ({gpu} host, its GPU unused)' if gpu else ''}, {platform.platform()}; "
            f"load average {load:.1f} at the end; timed replicas: no GPU work ran"), gpu or "cpu"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "multi-gpu.yaml")
    ap.add_argument("--gpus", type=int, default=8, help="logical GPUs Ray declares (the fleet's most replicas)")
    ap.add_argument("--cpus", type=float, default=None, help="logical CPUs Ray declares (default 4 x gpus + 8)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="the ramp and Serve's delays, times this")
    ap.add_argument("--start-scale", type=float, default=None,
                    help="the measured GPU cold start, times this, before a timed replica serves (default: time scale)")
    ap.add_argument("--peak", type=float, default=None, help="the ramp's peak in replicas' worth (default: --gpus)")
    ap.add_argument("--shape", default="", help="RampShape fields in reference s, e.g. up_s=300,idle_s=60")
    ap.add_argument("--mix", default=None,
                    help="answer lengths of the sessions (capacity_load.Mix, e.g. the synthetic workload's "
                         f"{MIX}); default: the lengths of the production workload the calibration measured")
    ap.add_argument("--join-spread-s", type=float, default=JOIN_SPREAD_S,
                    help="sessions joining in one step (the burst) send their first requests over ~this many s, "
                         "exponential gaps as the capacity tool's sessions start (0: all at once)")
    ap.add_argument("--back-to-back", action="store_true",
                    help="sessions ask again at once (no playback wait): one stream in flight per session")
    ap.add_argument("--sessions-per-replica", type=float, default=None,
                    help="a replica's capacity in sessions (default: the calibration's)")
    ap.add_argument("--slo-streams", type=float, default=None, help="the band's setpoint (default: the calibration's)")
    ap.add_argument("--frontends", type=int, default=None)
    ap.add_argument("--ingresses", type=int, default=None)
    ap.add_argument("--settle-s", type=float, default=None, help="most reference s to wait for scale-in after the ramp")
    ap.add_argument("--wait-for-replicas", type=int, default=None,
                    help="at the plateau's end the ramp stands still (its load held) until this many replicas run")
    ap.add_argument("--wait-guard-s", type=float, default=600.0, help="most real s that wait lasts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    ap.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--cold-starts", type=Path, default=RESULTS,
                    help="where the measured GPU cold start records are, the newest used (default: bench/results; "
                         "bench/device_capacity.sh passes the ones its own call just measured)")
    ap.add_argument("--latest", action="store_true", help="also write <results>/autoscale-latest.json")
    ap.add_argument("--no-sim", action="store_true", help="skip the fleet simulation's replay")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    scale = args.time_scale
    start_scale = scale if args.start_scale is None else args.start_scale
    cal = calibrate()
    if args.slo_streams is not None:
        cal = Calibration(**{**cal.__dict__, "slo_streams": args.slo_streams})
    per_replica = args.sessions_per_replica or cal.sessions_per_replica
    cold = cold_start_record(args.cold_starts, gpu=cal.device)
    start_s = (cold["cold_start_s"] if cold else 0.0) * start_scale
    shape = RampShape(**{k: float(v) for k, v in (kv.split("=") for kv in args.shape.split(",") if kv)})
    app = app_config(args.config, args.gpus, cal, start_s, args.frontends, args.ingresses)
    auto = app["args"]["synthesizer"]["autoscaling"]
    band = auto["load_band"]
    mid = (band["low_pct"] + band["high_pct"]) / 200
    worth = mid * per_replica  # sessions of one replica's worth
    points = [(t * scale, v * worth) for t, v in shape.points(args.peak or args.gpus)]
    xs, ys = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    record = Path(tempfile.mkdtemp(prefix="autoscale-")) / "policy.jsonl"
    url = start_cluster(app, args.gpus, args.cpus or 4 * args.gpus + 8, scale, record)
    voice = register_voices(url, 1, prefix="autoscale")[0]
    clock = Clock()
    sampler = Sampler(clock.now(), 10.0 * scale)
    t0, wall0 = sampler.t0, time.time() - (clock.now() - sampler.t0)
    pause = None
    if args.wait_for_replicas:
        def running() -> bool:
            last = sampler.samples[-1] if sampler.samples else {}
            return last.get("states", {}).get("RUNNING", 0) >= args.wait_for_replicas

        pause = Pause((shape.up_s + shape.plateau_s) * scale, running, args.wait_guard_s)
    # the calibration reading's workload (production) gives the lengths: the synthetic mix's shorter
    # answers put ~1.8x its streams in flight per session (H100 host 2026-12-07, autoscale-live)
    source = SyntheticSource(Mix.parse(args.mix)) if args.mix else LengthsOf(ProductionSource(seed=args.seed))
    driver = SessionDriver(HttpTarget(url, voice), source,
                           lambda t: float(np.interp(t, xs, ys)), shape.total_s * scale, args.seed,
                           not args.back_to_back, clock, pause, args.join_spread_s)
    guard = (args.settle_s if args.settle_s is not None else 3 * auto["downscale_delay_s"] + 60) * scale
    settled, cut = drive(driver, sampler, t0, int(auto["min_replicas"]), guard)
    import ray

    ray.shutdown()
    date = dt.date.today().isoformat()
    host, card = machine()
    run = {
        "date": date, "machine": host, "card": card, "commit": git_commit(),
        "command": "python -m bench.autoscale_live " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": f"{args.config.relative_to(ROOT) if args.config.is_relative_to(ROOT) else args.config} "
                  f"(synthesizer on the timed runtime, {args.gpus} logical GPUs)",
        "gpus": args.gpus, "time_scale": scale, "start_scale": start_scale, "replica_start_s": round(start_s, 2),
        "bin_s": 10.0 * scale, "shape_reference_s": asdict(shape), "peak_replicas_worth": args.peak or args.gpus,
        "sessions_per_replica": per_replica, "sessions_per_replica_worth": worth, "band_centre": mid,
        "workload": source.describe(), "wait_playback": not args.back_to_back, "seed": args.seed,
        "join_spread_s": args.join_spread_s,
        "autoscaling_reference": dict(auto),  # the config's (unscaled), as the fleet simulation takes them
        "max_ongoing_requests": app["args"]["synthesizer"]["max_ongoing_requests"],
        "serve_metrics_push_s": SERVE_PUSH_S * scale, "calibration": cal.as_dict(), "cold_start_gpu": cold,
        "settled": settled, "cut_short": cut, "points": points,
        "wait_for_replicas": args.wait_for_replicas, "paused_s": round(driver.paused_s, 2), "resumed": driver.resumed,
    }
    result = summarise(run, driver.open_per_s, driver.requests, sampler.samples, read_policy(record, wall0))
    folder = write_outputs(result, args.results, args.tag, latest=args.latest)
    if not args.no_sim:
        from bench.fleet_live import compare_live

        compare_live(folder / "autoscale.json", results=args.results, update_latest=args.latest)
    logger.info("run folder %s: %s", folder, json.dumps({k: result["summary"][k] for k in (
        "max_replicas", "cut_streams", "p99_ttfa_ms_outside_scaleup_max", "replica_tracking")}))
    return result


if __name__ == "__main__":
    main()
    raise SystemExit(0)
