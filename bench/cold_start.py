"""How long a new synthesizer replica takes from process start to its first request served.

The config's frontend and synthesizer are built in this process (as ``bench/capacity.py
--level synth`` does: no Ray, no HTTP, so Ray's worker start and the proxy are not counted). The
frontend is built first, with one voice registered, and left out of the timeline (in Serve it is
a deployment of its own, already serving when the autoscaler adds a synthesizer replica: the
timeline's origin moves on by its build, ``frontend_built_s``); built beside the synthesizer in
one process, as before 2026-12-07, it took the GIL and transformers' import from the replica's
own start. Then the synthesizer is built and one streamed request sent through both; the first
audio chunk ends the measurement. Then it
waits for the CUDA graphs left to the background (``graphs_before_ready: first``,
cosyvoice_runtime/graph_schedule.py) and records when they were all there. The start-up's own log
lines (model loaded, graphs captured, warm-up, ready) are timestamped against the process start,
so the report shows where the time went::

    FAST_COSY_MODEL_DIR=/tmp/cv2-full python -m bench.cold_start --config configs/single-gpu.yaml --out DIR

Writes ``cold-start-<device>-<date>[-tag].json``: ``cold_start_s`` (process start -> first audio
byte of the first request), ``replica_cold_start_s`` (the same less the bench's own imports, which
a replica does not make), ``ready_s`` (process start -> synthesizer ready), ``all_graphs_s``
(process start -> the last background graph captured; null when it did not finish in
``--graphs-timeout-s``), the phases, the replica's own report (``/health``'s ``cold_start``) and
the log lines they were read from.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import tempfile
import time
from datetime import date
from pathlib import Path

import psutil
import torch

# a replica's own imports first: what they take is the "imports" phase
from deployments.frontend import TextFrontend
from deployments.protocol import SynthesisRequest
from deployments.synthesizer import Synthesizer

REPLICA_IMPORTED = time.time()
# the bench's own tooling, after the replica's imports (the bench_imports phase)
import soundfile as sf

from bench.capacity import apply_replica_env
from bench.load import synthetic_prompt_wav
from serve_app.args import AppArgs

# Log lines of the start-up that mark the end of a phase, by the logger's message template.
PHASES = {
    "loaded %s from %s in %.1f s": "model_loaded",
    "captured %d of %d CUDA graphs before ready in %.1f s (%d left for the background)": "graphs_before_ready",
    "warmup: %d tokens in %.2f s": "warmed_up",
}
BESIDE = {"frontend ready (%s) in %.1f s": "frontend_ready"}  # built before the replica: not a phase of its start
READY = "synthesizer ready on %s in %.1f s (model %s; %d objects frozen out of GC walks)"


class StartLog(logging.Handler):
    """Collects the start-up's phase lines with their time since the process started."""

    def __init__(self, process_start: float) -> None:
        super().__init__(logging.INFO)
        self.process_start = process_start
        self.left_out_s = 0.0  # work before the replica's own start that is not its (the frontend's build)
        self.lines: list[dict] = []
        self.beside: list[dict] = []  # lines of work that is not the replica's (the frontend's start)

    def leave_out(self, seconds: float) -> None:
        """Move the origin on by ``seconds`` of work that is not the replica's: later lines, and
        :meth:`since_start`, no longer count it."""
        self.process_start += seconds
        self.left_out_s += seconds

    def since_start(self) -> float:
        return time.time() - self.process_start

    def emit(self, record: logging.LogRecord) -> None:
        name = PHASES.get(record.msg) or ("synthesizer_ready" if record.msg == READY else None)
        line = {"phase": name or BESIDE.get(record.msg), "at_s": round(record.created - self.process_start, 2),
                "line": record.getMessage()}
        if name is not None:
            self.lines.append(line)
        elif line["phase"] is not None:
            self.beside.append(line)


def phases(lines: list[dict], first_audio_at_s: float) -> dict[str, float]:
    """Each phase's duration: from the end of the one before it (the first from process start) to
    its own line; a phase that logged nothing (no CUDA graphs on the CPU) is absent."""
    ends = [(line["phase"], line["at_s"]) for line in lines] + [("first_request", first_audio_at_s)]
    out, before = {}, 0.0
    for name, at in ends:
        out[name] = round(at - before, 2)
        before = at
    return out


async def first_audio(frontend, synth, voice: str, text: str) -> float:
    """Seconds from sending one streamed request to its first audio chunk."""
    started = time.perf_counter()
    prepared = await frontend.prepare(SynthesisRequest(request_id="cold-start-0", text=text, voice_id=voice,
                                                       stream=True))
    async for chunk in synth.synthesize(prepared):
        if len(chunk.samples):
            return time.perf_counter() - started
    raise RuntimeError("the first request ended without audio")


def measure(config: Path, process_start: float, graphs_timeout_s: float = 300.0) -> dict:
    """Build the config's deployments in this process, serve one request, return the timeline."""
    log = StartLog(process_start)
    log.lines.append({"phase": "imports", "at_s": round(REPLICA_IMPORTED - process_start, 2),
                      "line": "(python, torch and the deployments' imports)"})
    log.lines.append({"phase": "bench_imports", "at_s": round(time.time() - process_start, 2),
                      "line": "(the bench's own tooling: serve_app.args, bench.capacity)"})
    root = logging.getLogger()
    level = root.level
    root.addHandler(log)
    root.setLevel(min(level, logging.INFO))  # the phase lines are INFO
    try:
        return _measure(config, log, graphs_timeout_s)
    finally:
        root.removeHandler(log)
        root.setLevel(level)


def _measure(config: Path, log: StartLog, graphs_timeout_s: float) -> dict:
    apply_replica_env(config)
    app = AppArgs.from_file(config)
    source = app.model_source()
    frontend_cfg = app.frontend.model_copy(update={"voices_dir": tempfile.mkdtemp(prefix="cold-start-voices-")})

    async def run() -> tuple[float, Synthesizer]:
        built = time.time()  # the frontend and its voice: already there when a replica is added
        frontend = TextFrontend(frontend_cfg, source)
        audio, rate = sf.read(io.BytesIO(synthetic_prompt_wav(3.5)), dtype="float32")
        await frontend.register_voice("cold0", "Prompt number 0.", audio, rate, True)
        log.leave_out(time.time() - built)
        synth = Synthesizer(app.synthesizer, source)
        synth.outside_serve()  # no Serve replica around it (the batch scheduler's @serve.batch needs one)
        ttfa = await first_audio(frontend, synth, "cold0", "Hello, this is the first request.")
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]  # the replica's loops
        for task in rest:
            task.cancel()
        await asyncio.gather(*rest, return_exceptions=True)
        return ttfa, synth

    ttfa, synth = asyncio.run(run())
    done = log.since_start()
    all_graphs = _all_graphs_at(synth, log, graphs_timeout_s)
    bench_imports = phases(log.lines, done)["bench_imports"]
    ready = next((line["at_s"] for line in log.lines if line["phase"] == "synthesizer_ready"), None)
    report = synth.stats()["cold_start"]
    # the replica's threads end here, not at interpreter exit (whose pool shutdown the step thread
    # would meet mid-call and log as a crash)
    synth.shutdown()
    return {"kind": "cold_start", "config": str(config), "device": synth.runtime.device,
            "mode": synth.mode, "cold_start_s": round(done, 2), "replica_cold_start_s": round(done - bench_imports, 2),
            "ready_s": ready, "all_graphs_s": all_graphs, "first_request_ttfa_s": round(ttfa, 3),
            "frontend_built_s": round(log.left_out_s, 2),
            "phases_s": phases(log.lines, done), "beside": log.beside, "log": log.lines,
            "replica": report, "runtime": synth.runtime.details}


def _all_graphs_at(synth: Synthesizer, log: StartLog, timeout_s: float) -> float | None:
    """Seconds on the timeline until the background capture finished (now, if there was none);
    None if it failed or did not finish within ``timeout_s``."""
    schedule = synth.runtime.graph_schedule
    if schedule is not None and not schedule.done.wait(timeout_s):
        return None
    if schedule is not None and schedule.state != "done":
        return None
    return round(log.since_start(), 2)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=Path("configs/single-gpu.yaml"))
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--graphs-timeout-s", type=float, default=300.0,
                    help="how long to wait after the first request for the background graph capture")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    result = measure(args.config, psutil.Process().create_time(), args.graphs_timeout_s)
    gpu = _gpu_name() or result["device"]
    result.update(gpu=gpu, date=date.today().isoformat())
    args.out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")
    path = args.out / (f"cold-start-{slug}-{result['date']}" + (f"-{args.tag}" if args.tag else "") + ".json")
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"cold start {result['cold_start_s']:.1f} s, replica {result['replica_cold_start_s']:.1f} s, ready at "
          f"{result['ready_s']} s, all graphs at {result['all_graphs_s']} s "
          f"(first request {result['first_request_ttfa_s'] * 1e3:.0f} ms): "
          + ", ".join(f"{k} {v:.1f} s" for k, v in result["phases_s"].items()) + f" -> {path}")
    by_owner = ((result.get("replica") or {}).get("cuda_graphs") or {}).get("before_ready_by_owner") or {}
    if by_owner:  # which owner's graphs the graph phase is made of
        print("graphs before ready: " + ", ".join(f"{name} {o['graphs']} in {o['s']:.1f} s" for name, o in by_owner.items()))
    return result


def _gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
