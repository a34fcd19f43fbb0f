"""The whole service under load: Ray Serve app from a config, closed-loop HTTP streams per concurrency.

Where ``bench/gpu_bench.py`` measures one replica inside one process, this starts the real
application (ingress, frontend, synthesizer replicas) on local Ray from a serve config and drives
``POST /v1/audio/speech`` (streaming PCM) with :mod:`bench.load` at each concurrency, so the
figures include HTTP, the frontend, Serve's routing and the replica's batching:

    FAST_COSY_MODEL_DIR=/tmp/cv2-full python -m bench.serve_load --config configs/single-gpu.yaml \\
        --concurrency 1,16,64 --out bench/results/<date>-h200-serve/serve-h200-<date>

writes ``<out>.md`` (table, replica details from /health), ``<out>.json`` and two PNGs. With a
random-weight model the LLM rarely emits its end token, so each request decodes to its length
limit (20 speech tokens per text token): every request does about the same work. No response has
a total time limit (the configs set no ``http_options.request_timeout_s``; docs/serving.md, Long answers).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
from pathlib import Path

import httpx

from bench.load import LoadConfig, LoadGenerator, register_voices
from bench.report import plots
from bench.soak import start_local, wait_idle

logger = logging.getLogger(__name__)

# 12 ids of the random-weight model's tokenizer: at most 20 x 12 = 240 speech tokens (9.6 s of audio)
# per request, close to the 250 tokens of bench/gpu_bench.py. A real model decides the length itself.
TEXT = "Hello, world!"


def _health(url: str) -> dict:
    try:
        return httpx.get(f"{url}/health?detail=1", timeout=30).json()
    except (httpx.HTTPError, ValueError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _replica_details(health: dict) -> dict:
    replicas = health.get("synthesizer_replicas") or {}
    first = next(iter(replicas.values()), {})
    return {k: v for k, v in first.items() if k != "engine"}


def run_levels(url: str, concurrencies: list[int], min_requests: int, text: str, voice: str, label: str,
               deadline_s: float, progress: bool = True, on_row=None) -> list[dict]:
    """One closed-loop load run per concurrency (``max(2c, min_requests)`` requests each);
    ``on_row(rows)`` after each level, so a run cut short still leaves its report."""
    rows = []
    for c in concurrencies:
        cfg = LoadConfig(base_url=url, mode="closed", concurrency=c, max_requests=max(2 * c, min_requests),
                         max_duration_s=deadline_s, texts=(text,), voices=(voice,), progress=progress,
                         request_timeout_s=deadline_s)
        summary = LoadGenerator(cfg).run()["summary"]
        row = {"mode": label, "concurrency": c, **summary}
        logger.info("c=%d: %s", c, json.dumps({k: row.get(k) for k in ("requests", "ttfa_p50_ms", "ttfa_p99_ms",
                                                                        "throughput_x_realtime", "underruns",
                                                                        "lost", "outcomes")}))
        rows.append(row)
        if on_row is not None:
            on_row(rows)
        if not row.get("ok"):
            raise RuntimeError(f"no request of the c={c} level produced audio: {row.get('outcomes')}")
        wait_idle(url, timeout_s=120)
    return rows


def markdown(result: dict) -> str:
    d = result["replica"]
    lines = [f"# Service under load: {result['config']}, {result['device']}, {result['date']}", "",
             (f"The whole application on local Ray ({result['machine']}), closed-loop streaming requests over "
              f"HTTP (`bench/serve_load.py`), text: \"{result['text']}\", one voice registered from a 3.5 s "
              f"prompt."), "",
             f"Synthesizer replica (/health): `{json.dumps(d)}`.", "",
             "| conc. | requests | ok | lost | TTFA p50 ms | TTFA p99 ms | RTF p50 | x real time | underruns |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r.get('ok', r['requests'] - r['errors'])} | "
                     f"{r.get('lost', 0)} | {r['ttfa_p50_ms']:.0f} | {r['ttfa_p99_ms']:.0f} | {r['rtf_p50']:.3f} | "
                     f"{r['throughput_x_realtime']:.1f} | {r['underruns']} |")
    lines += ["", *[f"![{p}]({p})" for p in result["plots"]], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=Path("configs/single-gpu.yaml"))
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--min-requests", type=int, default=8, help="requests per level at least (else 2x concurrency)")
    ap.add_argument("--warmup", type=int, default=2, help="requests before the first level")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--deadline-s", type=float, default=300.0, help="bound of one level (and of one request)")
    ap.add_argument("--num-cpus", type=float, default=float(os.cpu_count() or 2))
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--out", type=Path, required=True, help="output stem: <out>.md/.json/-latency.png/-throughput.png")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    url = start_local(args.config, num_cpus=args.num_cpus)
    health = _health(url)
    # 3.5 s = 87 prompt speech tokens, the zero-shot prompt of bench/gpu_bench.py; registered over HTTP.
    voice = register_voices(url, 1, prefix="bench", prompt_seconds=(3.5,))[0]
    run_levels(url, [1], args.warmup, args.text, voice, "warmup", args.deadline_s, progress=False)
    replica = _replica_details(_health(url))
    label = f"serve-{replica.get('mode', '?')}-{(replica.get('runtime') or {}).get('dtype', '?')}"
    device = "cpu"
    if (replica.get("device") or "").startswith("cuda"):
        import torch

        device = torch.cuda.get_device_name()
    out = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": str(args.config), "date": dt.date.today().isoformat(), "device": device,
              "machine": f"{os.cpu_count()} CPUs, {platform.platform()}", "text": args.text, "replica": replica,
              "health_at_start": health, "rows": [], "plots": []}

    def write(rows: list[dict]) -> None:
        result["rows"] = rows
        result["replica"] = _replica_details(_health(url)) or replica
        try:
            result["plots"] = plots(out.parent, out.name, rows, baseline=None, key="mode")
        except ValueError:  # nothing to plot yet (a level without audio: NaN latencies)
            result["plots"] = []
        out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        out.with_suffix(".md").write_text(markdown(result))

    rows = run_levels(url, [int(c) for c in args.concurrency.split(",")], args.min_requests, args.text, voice, label,
                      args.deadline_s, progress=not args.no_progress, on_row=write)
    print(out.with_suffix(".md"))
    lost = sum(r.get("lost", 0) for r in rows)
    return 1 if lost else 0


if __name__ == "__main__":
    raise SystemExit(main())
