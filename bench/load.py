"""HTTP load generator for the TTS service: open loop (Poisson arrivals) or closed loop (N streams).

Drives ``POST /v1/audio/speech`` with ``stream: true`` and raw PCM, timing every network chunk
(so TTFA, RTF and underruns come from :mod:`bench.metrics`), over a bounded number of requests
and a bounded duration, with mixed text lengths and voices. Every request ends in exactly one
*outcome*: ``ok`` (complete audio), a documented error code (status + the JSON ``error.code``),
or a *lost* outcome (500, a malformed error body, a transport error, a timeout, empty audio).
A healthy service under any load loses nothing: overload is a 429, not a lost request.

    python -m bench.load --url http://127.0.0.1:8000 --mode open --rate 4 --requests 200 \\
        --duration 120 --register-voices 2 --out bench/results/load-local

writes ``<out>.json`` (config, summary, per-request outcomes), ``<out>.png`` and ``<out>.md``.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.metrics import RequestTrace, percentile, summarize

logger = logging.getLogger(__name__)

# Mixed lengths: one word to a few sentences (the splitter makes several pieces of the long ones).
DEFAULT_TEXTS = (
    "Hi.",
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Streaming speech should start quickly, even when many people ask at the same time.",
    "This is a longer request. It has three sentences. Each of them is synthesised in turn.",
)
# Status codes the API documents (docs/serving.md, serve_app/errors.py); each comes with the JSON
# error shape. Anything else is a lost request.
DOCUMENTED_ERRORS = frozenset({400, 404, 409, 413, 415, 429, 503})
TRANSPORT = "transport"  # outcome prefix of client-side failures (connection reset, truncated body)


@dataclass
class LoadConfig:
    """One run. ``max_requests`` and ``max_duration_s`` both bound it (whichever comes first)."""

    base_url: str
    mode: str = "closed"  # "open": Poisson arrivals at rate_rps; "closed": `concurrency` streams back to back
    rate_rps: float = 2.0
    concurrency: int = 4
    max_requests: int = 100
    max_duration_s: float = 60.0
    texts: tuple[str, ...] = DEFAULT_TEXTS
    voices: tuple[str, ...] = ("default",)
    model: str = "tts-1"
    sample_rate: int = 24000
    request_timeout_s: float = 120.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.mode not in ("open", "closed"):
            raise ValueError(f"mode must be 'open' or 'closed', got {self.mode!r}")
        if self.max_requests < 1 or self.max_duration_s <= 0:
            raise ValueError("max_requests and max_duration_s must be positive")
        if not self.texts or not self.voices:
            raise ValueError("texts and voices must not be empty")


@dataclass
class Outcome:
    """How one request ended (``trace`` keeps the chunk timings of a 2xx stream)."""

    index: int
    text_chars: int
    voice: str
    outcome: str = "pending"  # "ok" | "<status>:<error code>" | "transport:<exception>" | "timeout"
    status: int | None = None
    retry_after: str | None = None
    trace: RequestTrace = field(default_factory=lambda: RequestTrace(0.0))

    @property
    def lost(self) -> bool:
        return not is_documented(self.outcome)


def is_documented(outcome: str) -> bool:
    """True for complete audio or a documented error code with the JSON error shape."""
    if outcome == "ok":
        return True
    status, _, code = outcome.partition(":")
    return status.isdigit() and int(status) in DOCUMENTED_ERRORS and code not in ("", "no-json")


def poisson_arrivals(rate_rps: float, max_requests: int, max_duration_s: float, rng: random.Random) -> list[float]:
    """Send offsets (s) of an open-loop run: exponential gaps, cut at the count and the duration."""
    if rate_rps <= 0:
        raise ValueError("rate_rps must be positive")
    times, t = [], 0.0
    while len(times) < max_requests:
        t += rng.expovariate(rate_rps)
        if t > max_duration_s:
            break
        times.append(t)
    return times


def error_outcome(status: int, body: bytes) -> str:
    """``"<status>:<code>"`` from an error response; ``no-json`` when the body is not the error shape."""
    try:
        data = json.loads(body)
        err = data["error"]
        code = err.get("code") or err.get("type") or "none"
        if not isinstance(data.get("request_id"), str):
            code = "no-json"
    except (ValueError, KeyError, TypeError, AttributeError):
        code = "no-json"
    return f"{status}:{code}"


class LoadGenerator:
    """Runs one :class:`LoadConfig` against a live server (or any ``httpx`` transport, for tests)."""

    def __init__(self, cfg: LoadConfig, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.cfg = cfg
        self.transport = transport
        self.rng = random.Random(cfg.seed)
        self.outcomes: list[Outcome] = []
        self._t0 = 0.0
        self._bar = None

    # ---------------------------------------------------------------- public
    def run(self) -> dict[str, Any]:
        return asyncio.run(self.run_async())

    async def run_async(self) -> dict[str, Any]:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        self._bar = _progress(cfg)
        self._t0 = time.perf_counter()
        try:
            async with httpx.AsyncClient(base_url=cfg.base_url, timeout=timeout, limits=limits,
                                         transport=self.transport) as client:
                if cfg.mode == "open":
                    await self._open_loop(client)
                else:
                    await self._closed_loop(client)
        finally:
            if self._bar is not None:
                self._bar.close()
        return self.report(time.perf_counter() - self._t0)

    def report(self, wall_s: float) -> dict[str, Any]:
        """Summary (bench.metrics.summarize + outcomes by code + lost) and per-request rows."""
        traces = [o.trace for o in self.outcomes]
        summary = summarize(traces, wall_s)
        ok = [o.trace for o in self.outcomes if o.outcome == "ok"]
        rtfs = [t.rtf for t in ok if t.audio_s > 0]
        summary.update({
            "rtf_p90": percentile(rtfs, 90),
            "rtf_p99": percentile(rtfs, 99),
            "latency_p50_ms": percentile([t.latency_s * 1000 for t in ok], 50),
            "latency_p99_ms": percentile([t.latency_s * 1000 for t in ok], 99),
            "ok": len(ok),
            "outcomes": dict(sorted(Counter(o.outcome for o in self.outcomes).items())),
            "lost": sum(o.lost for o in self.outcomes),
            "rejected_429": sum(o.status == 429 for o in self.outcomes),
            "retry_after_missing": sum(o.status == 429 and not o.retry_after for o in self.outcomes),
            "requests_per_s": len(self.outcomes) / wall_s if wall_s > 0 else float("nan"),
        })
        rows = [{"i": o.index, "chars": o.text_chars, "voice": o.voice, "outcome": o.outcome,
                 "sent_s": round(o.trace.submitted_s, 4),
                 "ttfa_ms": round(o.trace.ttfa_s * 1000, 2) if o.trace.chunk_times_s else None,
                 "audio_s": round(o.trace.audio_s, 3), "chunks": len(o.trace.chunk_times_s),
                 "underruns": o.trace.underruns()} for o in self.outcomes]
        cfg = asdict(self.cfg)
        cfg["texts"] = [len(t) for t in self.cfg.texts]  # lengths only: the report stays small
        return {"config": cfg, "summary": summary, "requests": rows}

    # ---------------------------------------------------------------- loops
    async def _open_loop(self, client: httpx.AsyncClient) -> None:
        cfg = self.cfg
        tasks = []
        for offset in poisson_arrivals(cfg.rate_rps, cfg.max_requests, cfg.max_duration_s, self.rng):
            delay = self._t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self._one(client, len(tasks))))
        await asyncio.gather(*tasks)

    async def _closed_loop(self, client: httpx.AsyncClient) -> None:
        cfg = self.cfg
        counter = iter(range(cfg.max_requests))
        deadline = self._t0 + cfg.max_duration_s

        async def stream() -> None:
            for index in counter:
                if time.perf_counter() >= deadline:
                    return
                await self._one(client, index)

        await asyncio.gather(*(stream() for _ in range(cfg.concurrency)))

    # ---------------------------------------------------------------- one request
    async def _one(self, client: httpx.AsyncClient, index: int) -> Outcome:
        cfg = self.cfg
        text = self.rng.choice(cfg.texts)
        voice = self.rng.choice(cfg.voices)
        out = Outcome(index=index, text_chars=len(text), voice=voice)
        self.outcomes.append(out)
        trace = out.trace
        trace.sample_rate = cfg.sample_rate
        trace.submitted_s = time.perf_counter() - self._t0
        body = {"model": cfg.model, "input": text, "voice": voice, "response_format": "pcm", "stream": True}
        try:
            async with client.stream("POST", "/v1/audio/speech", json=body) as r:
                out.status = r.status_code
                if r.status_code != 200:
                    out.retry_after = r.headers.get("retry-after")
                    out.outcome = error_outcome(r.status_code, await r.aread())
                else:
                    odd = 0  # a network chunk may split an s16 sample
                    async for part in r.aiter_raw():
                        nbytes = len(part) + odd
                        odd = nbytes % 2
                        trace.add_chunk(time.perf_counter() - self._t0, nbytes // 2)
                    out.outcome = "ok" if trace.chunk_times_s and trace.audio_s > 0 else "200:empty"
        except httpx.TimeoutException:
            out.outcome = "timeout"
        except httpx.HTTPError as exc:
            out.outcome = f"{TRANSPORT}:{type(exc).__name__}"
        if out.outcome != "ok":
            trace.error = out.outcome
        if self._bar is not None:
            self._bar.update(1)
            if out.outcome != "ok":
                self._bar.set_postfix(not_ok=sum(o.outcome != "ok" for o in self.outcomes), refresh=False)
        return out


def _progress(cfg: LoadConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm

    total = cfg.max_requests
    if cfg.mode == "open":
        total = min(total, math.ceil(cfg.rate_rps * cfg.max_duration_s))
    return tqdm(total=total, desc=f"{cfg.mode}-loop", unit="req", smoothing=0.1)


# ---------------------------------------------------------------------------------- voices
def synthetic_prompt_wav(seconds: float = 3.0, sample_rate: int = 16000, pitch_hz: float = 180.0) -> bytes:
    """A harmonic tone as a prompt upload (the tiny model does not care what it hears)."""
    import soundfile as sf

    t = np.arange(int(seconds * sample_rate)) / sample_rate
    tone = sum(0.2 / k * np.sin(2 * np.pi * pitch_hz * k * t) for k in (1, 2, 3))
    buf = io.BytesIO()
    sf.write(buf, tone.astype(np.float32), sample_rate, format="WAV")
    return buf.getvalue()


def register_voices(base_url: str, count: int, prefix: str = "load", timeout_s: float = 120.0,
                    prompt_seconds: tuple[float, ...] = (3.0,)) -> list[str]:
    """Register ``count`` synthetic voices (overwriting), return their ids.

    Voice ``k`` gets a ``prompt_seconds[k % len(prompt_seconds)]`` s prompt (the prompt's length is
    part of every flow call, so it sets much of a short request's cost).
    """
    ids = []
    for k in range(count):
        voice_id = f"{prefix}{k}"
        wav = synthetic_prompt_wav(prompt_seconds[k % len(prompt_seconds)], pitch_hz=150.0 + 40 * k)
        r = httpx.post(f"{base_url}/v1/voices", timeout=timeout_s,
                       data={"voice_id": voice_id, "prompt_text": f"Prompt number {k}.", "overwrite": "true"},
                       files={"audio": (f"{voice_id}.wav", wav, "audio/wav")})
        if r.status_code != 201:
            raise RuntimeError(f"registering voice {voice_id} failed: {r.status_code} {r.text[:200]}")
        ids.append(voice_id)
    return ids


# ---------------------------------------------------------------------------------- outputs
def write_outputs(report: dict[str, Any], out_stem: str | Path, title: str = "load") -> dict[str, Path]:
    """``<stem>.json``, ``<stem>.png`` (TTFA over time + histogram) and ``<stem>.md``."""
    stem = Path(out_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": stem.with_suffix(".json"), "png": stem.with_suffix(".png"), "md": stem.with_suffix(".md")}
    paths["json"].write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    plot(report, paths["png"], title)
    paths["md"].write_text(markdown(report, title))
    return paths


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return str(value)


def plot(report: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["requests"]
    ok = [r for r in rows if r["outcome"] == "ok"]
    bad = [r for r in rows if r["outcome"] != "ok"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.scatter([r["sent_s"] for r in ok], [r["ttfa_ms"] for r in ok], s=6, label="ok")
    if bad:
        ax1.scatter([r["sent_s"] for r in bad], [0] * len(bad), s=10, c="red", marker="x", label="not ok")
    ax1.set(xlabel="sent at (s)", ylabel="time to first audio (ms)", title=f"{title}: TTFA over the run")
    ax1.legend(loc="upper left")
    ttfa = [r["ttfa_ms"] for r in ok]
    if ttfa:
        ax2.hist(ttfa, bins=40)
        s = report["summary"]
        for q in ("p50", "p90", "p99"):
            ax2.axvline(s[f"ttfa_{q}_ms"], ls="--", c="k", lw=0.8)
            ax2.text(s[f"ttfa_{q}_ms"], ax2.get_ylim()[1] * 0.9, q, rotation=90, va="top")
    ax2.set(xlabel="time to first audio (ms)", ylabel="requests", title="TTFA distribution")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def markdown(report: dict[str, Any], title: str) -> str:
    s, c = report["summary"], report["config"]
    load = f"Poisson {c['rate_rps']} req/s" if c["mode"] == "open" else f"{c['concurrency']} closed-loop streams"
    lines = [
        f"# {title}", "",
        (f"{load}, at most {c['max_requests']} requests / {c['max_duration_s']} s, {len(c['voices'])} voices, "
        f"text lengths {sorted(set(c['texts']))} chars, against `{c['base_url']}`."), "",
        "| requests | ok | lost | 429 | TTFA p50 / p90 / p99 (ms) | RTF p50 / p90 | underruns | req/s | x realtime |",
        "|---|---|---|---|---|---|---|---|---|",
        (f"| {s['requests']} | {s['ok']} | {s['lost']} | {s['rejected_429']} | {s['ttfa_p50_ms']:.0f} / "
        f"{s['ttfa_p90_ms']:.0f} / {s['ttfa_p99_ms']:.0f} | {s['rtf_p50']:.3f} / {s['rtf_p90']:.3f} | "
        f"{s['underruns']} ({s['requests_with_underrun']} requests) | {s['requests_per_s']:.2f} | "
        f"{s['throughput_x_realtime']:.2f} |"), "",
        "Outcomes: " + ", ".join(f"`{k}` {v}" for k, v in s["outcomes"].items()), "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--mode", choices=("open", "closed"), default="closed")
    p.add_argument("--rate", type=float, default=2.0, help="open loop: mean arrivals per second")
    p.add_argument("--concurrency", type=int, default=4, help="closed loop: concurrent streams")
    p.add_argument("--requests", type=int, default=100, help="at most this many requests")
    p.add_argument("--duration", type=float, default=60.0, help="stop sending after this many seconds")
    p.add_argument("--voices", nargs="*", default=["default"], help="registered voice ids to mix")
    p.add_argument("--register-voices", type=int, default=0, help="also register N synthetic voices first")
    p.add_argument("--model", default="tts-1")
    p.add_argument("--sample-rate", type=int, default=24000)
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="output stem (writes .json, .png, .md)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    a = parse_args(argv)
    voices = list(a.voices) + register_voices(a.url, a.register_voices)
    cfg = LoadConfig(base_url=a.url, mode=a.mode, rate_rps=a.rate, concurrency=a.concurrency,
                     max_requests=a.requests, max_duration_s=a.duration, voices=tuple(voices), model=a.model,
                     sample_rate=a.sample_rate, request_timeout_s=a.timeout, seed=a.seed,
                     progress=not a.no_progress)
    report = LoadGenerator(cfg).run()
    s = report["summary"]
    logger.info("%d requests: %d ok, %d lost, outcomes %s; TTFA p50/p90/p99 %.0f/%.0f/%.0f ms; RTF p50 %.3f",
                s["requests"], s["ok"], s["lost"], s["outcomes"], s["ttfa_p50_ms"], s["ttfa_p90_ms"],
                s["ttfa_p99_ms"], s["rtf_p50"])
    if a.out:
        for kind, path in write_outputs(report, a.out, title=Path(a.out).name).items():
            logger.info("wrote %s %s", kind, path)
    return 1 if s["lost"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
