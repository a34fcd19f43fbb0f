"""Soak: thousands of requests through the local CPU app, then leak and loss checks.

Starts a local Ray + Serve with ``configs/local.yaml`` (tiny random-weight model, CPU), or uses a
running server (``--url``), and then:

1. registers a few synthetic voices and warms up (``--warmup`` requests);
2. samples RSS and open file descriptors of every Ray worker process (descendants of this
   process whose title starts with ``ray::``: controller, proxy, every replica);
3. runs the load (closed loop, then open loop at ~70 % of the measured closed-loop rate) with
   :mod:`bench.load`, sampling the workers every ``--sample-every`` seconds;
4. waits until the engine is idle, samples again and checks the bounds below.

Bounds (stated, checked, recorded): per worker, RSS after the run within
``max(rss_abs_mib, rss_rel * RSS after warm-up)`` of its post-warm-up value and open fds within
``fd_slack`` of theirs; no worker died; every request ended in audio or a documented error code
(``lost == 0``). ``python -m bench.soak --requests 2000`` writes
``bench/results/<date>-soak/soak-<date>.{json,md}`` (a run folder, ``bench/results_index.py``);
``make soak`` runs exactly that.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.load import LoadConfig, LoadGenerator, register_voices, write_outputs
from deployments.constants import RAY_SYSTEM_CONFIG

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local.yaml"
# Cheap requests of mixed lengths: the tiny model's random LLM rarely stops early, so a text of n
# tokens (about one per character here) decodes up to 20 n speech tokens (0.8 n s of audio), and
# flow + HiFT, 80 % of the compute, grow with that and with the voice's prompt. 2-12 text tokens
# keep 2,000 requests within about 40 min on 2 shared cores (the 2026-12-02 mix, up to 25 tokens,
# managed 378 in 1,000 s).
SOAK_TEXTS = ("A.", "Hi.", "Yes.", "Okay.", "Hi there.", "Hello world.")
SOAK_PROMPT_S = (1.0, 1.5, 2.0)  # voice k gets prompt k % 3: mixed prompt lengths too
# Idle time before each memory sample (after warm-up and after the run alike): replicas drop
# per-request objects and the synthesizer returns freed heap after 1 s idle (deployments/housekeeping.py).
SETTLE_S = 2.0


@dataclass(frozen=True)
class Bounds:
    rss_abs_mib: float = 64.0  # allowed RSS growth per worker...
    rss_rel: float = 0.10  # ...or this fraction of its post-warm-up RSS, whichever is larger
    fd_slack: int = 16  # allowed growth of open file descriptors per worker


# ---------------------------------------------------------------------------------- processes
def ray_workers(root_pid: int | None = None) -> list[psutil.Process]:
    """Ray worker processes (``ray::...`` titles, idle pool workers excluded) under ``root_pid``."""
    root = psutil.Process(root_pid or os.getpid())
    found = []
    for proc in root.children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if title.startswith("ray::") and not title.startswith("ray::IDLE"):
            found.append(proc)
    return found


def sample_workers(procs: list[psutil.Process]) -> dict[str, dict[str, Any]]:
    """``{pid: {title, rss_mib, fds}}`` of the live ones."""
    out = {}
    for proc in procs:
        try:
            with proc.oneshot():
                out[str(proc.pid)] = {"title": " ".join(proc.cmdline())[:80],
                                      "rss_mib": proc.memory_info().rss / 2**20, "fds": proc.num_fds(),
                                      "malloc_arena_max": proc.environ().get("MALLOC_ARENA_MAX")}
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


class Sampler(threading.Thread):
    """Samples the workers every ``every_s`` seconds (a time series for the report)."""

    def __init__(self, procs: list[psutil.Process], every_s: float) -> None:
        super().__init__(daemon=True, name="soak-sampler")
        self.procs, self.every_s = procs, every_s
        self.series: list[dict[str, Any]] = []
        self._halt = threading.Event()
        self._t0 = time.perf_counter()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            snap = sample_workers(self.procs)
            self.series.append({"t_s": round(time.perf_counter() - self._t0, 1),
                                "rss_mib_total": round(sum(w["rss_mib"] for w in snap.values()), 1),
                                "fds_total": sum(w["fds"] for w in snap.values()),
                                "rss_mib": {short_title(w["title"]): round(w["rss_mib"], 1) for w in snap.values()}})

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


def machine() -> dict[str, Any]:
    import platform

    return {"cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version()}


def short_title(title: str) -> str:
    """``ray::ServeReplica:tts:Synthesizer ...`` -> ``Synthesizer``; ``ray::ProxyActor`` -> ``ProxyActor``."""
    # Ray retitles a worker with the method it runs ("...:Synthesizer.handle_request_with_rejection").
    return title.split()[0].split(":")[-1].split(".")[0] if title else "?"


def rss_over_run(series: list[dict[str, Any]], fractions=(0.25, 0.5, 0.75, 1.0)) -> dict[str, list[float]]:
    """Per worker, its RSS at the given fractions of the sampled run (the plateau check of the report)."""
    rows = [r for r in series if "rss_mib" in r]
    if not rows:
        return {}
    names = sorted({n for r in rows for n in r["rss_mib"]})
    picks = [rows[min(len(rows) - 1, max(0, round(f * len(rows)) - 1))] for f in fractions]
    return {n: [p["rss_mib"].get(n, float("nan")) for p in picks] for n in names}


def check_bounds(before: dict[str, dict], after: dict[str, dict], bounds: Bounds) -> dict[str, Any]:
    """Per-worker growth and the violations of ``bounds`` (a died worker is one)."""
    workers, violations = {}, []
    for pid, b in before.items():
        a = after.get(pid)
        if a is None:
            violations.append(f"worker {pid} ({b['title']}) died during the soak")
            continue
        allowed = max(bounds.rss_abs_mib, bounds.rss_rel * b["rss_mib"])
        d_rss, d_fds = a["rss_mib"] - b["rss_mib"], a["fds"] - b["fds"]
        workers[pid] = {"title": b["title"], "rss_mib_after_warmup": round(b["rss_mib"], 1),
                        "rss_mib_after_run": round(a["rss_mib"], 1), "rss_growth_mib": round(d_rss, 1),
                        "rss_allowed_mib": round(allowed, 1), "fds_after_warmup": b["fds"],
                        "fds_after_run": a["fds"], "fds_growth": d_fds,
                        "malloc_arena_max": b.get("malloc_arena_max")}
        if d_rss > allowed:
            violations.append(f"worker {pid} ({b['title']}) RSS grew {d_rss:.1f} MiB > {allowed:.1f}")
        if d_fds > bounds.fd_slack:
            violations.append(f"worker {pid} ({b['title']}) open fds grew {d_fds} > {bounds.fd_slack}")
    return {"workers": workers, "violations": violations}


def graphs_settled(replica: dict) -> bool:
    """Whether a synthesizer replica's ``/health?detail=1`` entry says no CUDA graph capture is left
    to its background thread (``graphs_before_ready: first``; a replica without graphs, or one that
    does not report it, is settled): a measurement of the steady state waits for it."""
    graphs = ((replica.get("runtime") or {}).get("cold_start") or {}).get("cuda_graphs") or {}
    return graphs.get("background") not in ("pending", "running")


def wait_idle(base_url: str, timeout_s: float = 60.0) -> bool:
    """Until every synthesizer replica reports no running/waiting sequence, no open stream and no
    CUDA graph capture in the background."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            body = httpx.get(f"{base_url}/health?detail=1", timeout=10).json()
            replicas = list(body.get("synthesizer_replicas", {}).values())
            engines = [r.get("engine") or {} for r in replicas]
            if engines and all(e.get("running", 1) == 0 and e.get("waiting", 1) == 0 and e.get("open_streams", 1) == 0
                               for e in engines) and all(graphs_settled(r) for r in replicas):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return False


# ---------------------------------------------------------------------------------- the soak
def run_soak(base_url: str, requests: int = 2000, warmup: int = 40, concurrency: int = 4, voices: int = 3,
             max_duration_s: float = 3600.0, open_fraction: float = 0.25, sample_every_s: float = 10.0,
             bounds: Bounds = Bounds(), root_pid: int | None = None, texts: tuple[str, ...] = SOAK_TEXTS,
             progress: bool = True, request_timeout_s: float = 120.0,
             prompt_seconds: tuple[float, ...] = SOAK_PROMPT_S) -> dict[str, Any]:
    """Run the soak against ``base_url``; workers are looked up under ``root_pid`` (default: us)."""
    voice_ids = tuple(register_voices(base_url, voices, prefix="soak", prompt_seconds=prompt_seconds))
    common = {"base_url": base_url, "texts": texts, "voices": voice_ids, "progress": progress,
                  "request_timeout_s": request_timeout_s}
    warm = LoadGenerator(LoadConfig(mode="closed", concurrency=concurrency, max_requests=warmup,
                                    max_duration_s=max_duration_s, seed=1, **common)).run()
    wait_idle(base_url)
    time.sleep(SETTLE_S)  # the same settling as before the after-run sample: both are idle samples
    procs = ray_workers(root_pid)
    before = sample_workers(procs)
    sampler = Sampler(procs, sample_every_s)
    sampler.start()
    started = time.perf_counter()
    n_open = int(requests * open_fraction)
    phases = []
    # The closed loop gets its share of the duration too, so a time-bounded soak still has an open phase.
    closed_s = max_duration_s * (1.0 - open_fraction) if n_open else max_duration_s
    closed = LoadGenerator(LoadConfig(mode="closed", concurrency=concurrency, max_requests=requests - n_open,
                                      max_duration_s=closed_s, seed=2, **common)).run()
    phases.append(("closed", closed))
    if n_open:
        rate = 0.7 * closed["summary"]["requests_per_s"]
        remaining = max(1.0, max_duration_s - (time.perf_counter() - started))
        phases.append(("open", LoadGenerator(LoadConfig(mode="open", rate_rps=rate, max_requests=n_open,
                                                        max_duration_s=remaining, seed=3, **common)).run()))
    wall = time.perf_counter() - started
    idle = wait_idle(base_url)
    time.sleep(SETTLE_S)
    sampler.stop()
    after = sample_workers(procs)
    leaks = check_bounds(before, after, bounds)
    total = sum(p["summary"]["requests"] for _, p in phases)
    lost = sum(p["summary"]["lost"] for _, p in phases)
    outcomes: dict[str, int] = {}
    for _, p in phases:
        for k, v in p["summary"]["outcomes"].items():
            outcomes[k] = outcomes.get(k, 0) + v
    return {
        "date": dt.date.today().isoformat(),
        "base_url": base_url,
        "requests_planned": requests,
        "requests_sent": total,
        "requests_ok": outcomes.get("ok", 0),
        "requests_lost": lost,
        "outcomes": outcomes,
        "wall_s": round(wall, 1),
        "warmup": warm["summary"],
        "phases": {name: {"config": {k: v for k, v in p["config"].items() if k != "texts"}, "summary": p["summary"]}
                   for name, p in phases},
        "idle_after_run": idle,
        "bounds": bounds.__dict__,
        "sample_every_s": sample_every_s,
        "memory": leaks["workers"],
        "violations": leaks["violations"],
        "machine": machine(),
        "texts": list(texts),
        "voice_prompt_s": [prompt_seconds[k % len(prompt_seconds)] for k in range(voices)],
        "series": sampler.series,
        "passed": lost == 0 and not leaks["violations"] and idle and total == requests,
        "phase_reports": dict(phases),  # full load reports; write_result stores them beside the soak files
    }


def soak_markdown(result: dict[str, Any]) -> str:
    b = result["bounds"]
    m = result.get("machine") or {}
    lines = [
        f"# Soak {result['date']}", "",
        (f"Pass criteria, fixed before the run: all {result['requests_planned']} requests sent, none lost "
         f"(every one ends in audio or a documented error code), the engine idle afterwards, and per Ray worker "
         f"RSS growth <= max({b['rss_abs_mib']} MiB, {b['rss_rel']:.0%} of its post-warm-up RSS) and open fds "
         f"growth <= {b['fd_slack']}, measured after warm-up and after the run."), "",
        (f"Machine: {m.get('cpus', '?')} CPUs, {m.get('memory_gib', '?')} GiB, {m.get('platform', '?')}, "
         f"Python {m.get('python', '?')}. "
         f"Texts {result.get('texts', '?')}; voices with {result.get('voice_prompt_s', '?')} s prompts."), "",
        (f"{result['requests_sent']} of {result['requests_planned']} requests in {result['wall_s']} s against "
        f"`{result['base_url']}`: **{result['requests_ok']} ok, {result['requests_lost']} lost**; "
        f"outcomes {result['outcomes']}. Engine idle after the run: {result['idle_after_run']}. "
        f"Passed: **{result['passed']}**."), "",
        "| phase | requests | ok | TTFA p50 / p90 / p99 (ms) | RTF p50 / p90 | underruns | req/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, p in result["phases"].items():
        s = p["summary"]
        lines.append(f"| {name} | {s['requests']} | {s['ok']} | {s['ttfa_p50_ms']:.0f} / {s['ttfa_p90_ms']:.0f} / "
                     f"{s['ttfa_p99_ms']:.0f} | {s['rtf_p50']:.3f} / {s['rtf_p90']:.3f} | {s['underruns']} | "
                     f"{s['requests_per_s']:.2f} |")
    lines += ["", (f"Bounds per Ray worker: RSS growth <= max({b['rss_abs_mib']} MiB, {b['rss_rel']:.0%} of the "
              f"post-warm-up RSS); open fds growth <= {b['fd_slack']}."), "",
              ("| worker | RSS after warm-up (MiB) | after run | growth (allowed) | fds after warm-up | after run "
               "| MALLOC_ARENA_MAX |"), "|---|---|---|---|---|---|---|"]
    for w in result["memory"].values():
        lines.append(f"| `{w['title'].strip()[:48]}` | {w['rss_mib_after_warmup']} | {w['rss_mib_after_run']} | "
                     f"{w['rss_growth_mib']} ({w['rss_allowed_mib']}) | {w['fds_after_warmup']} | {w['fds_after_run']} | "
                     f"{w.get('malloc_arena_max') or 'unset'} |")
    over = rss_over_run(result.get("series") or [])
    if over:
        lines += ["", ("RSS (MiB) at 25 / 50 / 75 / 100 % of the run (samples every "
                       f"{result.get('sample_every_s', '?')} s; a plateau is flat in the later columns):"), "",
                  "| worker | 25 % | 50 % | 75 % | 100 % |", "|---|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(f"{v:.1f}" for v in vals) + " |" for name, vals in over.items()]
    lines += ["", "Violations: " + ("; ".join(result["violations"]) or "none"), ""]
    return "\n".join(lines)


def write_result(result: dict[str, Any], stem: str | Path | None = None) -> tuple[Path, Path]:
    stem = Path(stem) if stem else RESULTS_DIR / f"{result['date']}-soak" / f"soak-{result['date']}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    js, md = stem.with_suffix(".json"), stem.with_suffix(".md")
    result = dict(result)
    for name, report in (result.pop("phase_reports", None) or {}).items():
        write_outputs(report, stem.parent / f"{stem.name}-{name}", title=f"{stem.name} {name} loop")
    js.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md.write_text(soak_markdown(result))
    return js, md


# ---------------------------------------------------------------------------------- local app
def config_env(app: dict[str, Any]) -> dict[str, str]:
    """The env vars a Serve config's application gives its replicas (``runtime_env.env_vars``)."""
    return {k: str(v) for k, v in ((app.get("runtime_env") or {}).get("env_vars") or {}).items()}


def start_local(config: Path = DEFAULT_CONFIG, voices_dir: str | None = None, num_cpus: float = 4) -> str:
    """In-process Ray + Serve running the config's app on a free loopback port; returns its URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    import yaml
    from ray import serve

    from serve_app.app import build_app
    from serve_app.args import AppArgs, application_of

    document = yaml.safe_load(Path(config).read_text())
    app = application_of(document)
    raw = dict(app.get("args") or {})
    raw["frontend"] = {**(raw.get("frontend") or {}), "voices_dir": voices_dir or tempfile.mkdtemp(prefix="soak-voices-")}
    args = AppArgs.model_validate(raw)
    env = {"RAY_AUTH_MODE": "disabled", **config_env(app)}
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, namespace="soak",
             runtime_env={"env_vars": env}, _system_config=RAY_SYSTEM_CONFIG)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    http = {**(document.get("http_options") or {}), "host": "127.0.0.1", "port": port}
    serve.start(http_options=http)
    serve.run(build_app(args), name=app.get("name", "tts"), route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    p = argparse.ArgumentParser(description="Soak the TTS service and check for leaks and lost requests.")
    p.add_argument("--url", default=None, help="a running server (default: start configs/local.yaml here)")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--voices", type=int, default=3)
    p.add_argument("--duration", type=float, default=3600.0, help="stop sending after this many seconds")
    p.add_argument("--sample-every", type=float, default=10.0)
    p.add_argument("--out", default=None, help="output stem (default bench/results/<date>-soak/soak-<date>)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    url = a.url or start_local(a.config)
    result = run_soak(url, requests=a.requests, warmup=a.warmup, concurrency=a.concurrency, voices=a.voices,
                      max_duration_s=a.duration, sample_every_s=a.sample_every, progress=not a.no_progress)
    js, md = write_result(result, a.out)
    logger.info("soak: %d/%d sent, %d ok, %d lost, violations %s -> %s, %s", result["requests_sent"],
                result["requests_planned"], result["requests_ok"], result["requests_lost"],
                result["violations"] or "none", js, md)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
