"""Fuzz campaign over prompt uploads (issue 16): every case a 4xx or a success, never a 500.

Cases (:func:`cases`) by kind: odd sample rates, channel counts, lengths (0 frames to declared
gigabytes), formats (WAV subtypes, FLAC, OGG Vorbis/Opus, MP3, containers we refuse), truncated
and corrupted files, and compression bombs (kilobytes that decode to an hour, headers that do not
know or understate their length). Each one is posted as a multipart ``POST /v1/voices`` to the
ingress's Starlette app in this process: the upload is decoded in the ingress's worker thread as
in a replica, then the real :class:`~deployments.frontend.TextFrontend` over the tiny model
(ONNX speech tokenizer and CAM++, resampling, the voice store) turns it into a voice. No
synthesizer is involved: uploads never reach it on this route, and ``POST /v1/tts`` decodes with the
same ``decode_upload`` and the same frontend prompt path.

Per case: status, latency, the process's resident memory after the case and its peak during the
case (a 2 ms psutil sampler). After the campaign a normal voice is registered and listed (the
service is still healthy). Writes ``<out>.json`` and ``<out>.md``.

Usage: ``python -m bench.fuzz_uploads [--quick] [--out bench/results/YYYY-MM-DD-fuzz-uploads/fuzz-uploads-YYYY-MM-DD]``.
:func:`cases` with ``quick=True`` is also the upload fuzz of ``tests/integration/test_fuzz.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import struct
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

OK, REFUSED, TOO_LARGE = 201, 400, 413
ANY = frozenset({OK, REFUSED, TOO_LARGE})  # corrupt input: refused, or decodable audio accepted
HOUR_S = 3600


@dataclass
class Case:
    """One upload: ``expect`` holds the statuses that are right for it."""

    kind: str
    name: str
    data: bytes
    expect: frozenset[int]
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ file builders
def tone(seconds: float, sr: int, channels: int = 1) -> np.ndarray:
    t = np.arange(round(seconds * sr)) / sr
    x = (0.3 * np.sin(2 * np.pi * 220.0 * t) + 0.1 * np.sin(2 * np.pi * 1500.0 * t)).astype(np.float32)
    return x if channels == 1 else np.repeat(x[:, None], channels, axis=1) * np.linspace(1.0, 0.5, channels,
                                                                                       dtype=np.float32)


def encode(samples: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    """Written in blocks: libvorbis crashes on one multi-minute write."""
    import soundfile as sf

    channels = 1 if samples.ndim == 1 else samples.shape[1]
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", sr, channels, format=fmt, subtype=subtype) as f:
        for i in range(0, samples.shape[0], 1 << 15):
            f.write(samples[i:i + (1 << 15)])
    return buf.getvalue()


def silence_file(seconds: int, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    """A long silence written a second at a time (the compression bomb)."""
    import soundfile as sf

    buf = io.BytesIO()
    second = np.zeros(sr, np.float32)
    with sf.SoundFile(buf, "w", sr, 1, format=fmt, subtype=subtype) as f:
        for _ in range(seconds):
            f.write(second)
    return buf.getvalue()


def wav_header(channels: int, rate: int, data_bytes: int, bits: int = 16) -> bytes:
    block = channels * bits // 8
    return (b"RIFF" + struct.pack("<I", (36 + data_bytes) & 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<IHHIIHH", 16, 1, channels, rate & 0xFFFFFFFF, (rate * block) & 0xFFFFFFFF, block, bits)
            + b"data" + struct.pack("<I", data_bytes & 0xFFFFFFFF))


def flac_total_samples(data: bytes, total: int) -> bytes:
    """Rewrite FLAC STREAMINFO's 36-bit total-samples field (0: unknown, as streaming encoders leave it)."""
    out = bytearray(data)
    field_ = int.from_bytes(out[21:26], "big")
    out[21:26] = ((field_ & ~((1 << 36) - 1)) | total).to_bytes(5, "big")
    return bytes(out)


def _formats():
    import soundfile as sf

    out = [("wav", "WAV", "PCM_16"), ("flac", "FLAC", "PCM_16"), ("vorbis", "OGG", "VORBIS"),
           ("opus", "OGG", "OPUS")]
    if "MP3" in sf.available_formats():
        out.append(("mp3", "MP3", "MPEG_LAYER_III"))
    return out


# ------------------------------------------------------------------------------ the cases
def cases(quick: bool = False, seed: int = 0) -> list[Case]:
    """Every case of the campaign; ``quick`` keeps a few of each kind and 10-minute bombs."""
    rng = np.random.default_rng(seed)
    out: list[Case] = []
    add = out.append
    # -- sample rates (2 s mono WAV; FLAC for the rates WAV's 32-bit byte rate cannot carry)
    rates = [1, 100, 7999, 8000, 11025, 16000, 22050, 44100, 44101, 48000, 96000, 96001, 192000, 192001, 384000]
    if quick:
        rates = [1, 8000, 16000, 44101, 96001, 192000, 384000]
    for r in rates:
        if r < 8000 or r > 192000:
            expect = frozenset({REFUSED})
        elif r < 16000:
            expect = frozenset({REFUSED})  # the prompt encoder needs >= 16 kHz
        else:
            expect = frozenset({OK})
        add(Case("rate", f"wav {r} Hz", encode(tone(2.0, r), r, "WAV", "PCM_16") if r >= 100 else
                 wav_header(1, r, 2 * 2 * r) + bytes(4 * r), expect))
    add(Case("rate", "wav 0 Hz header", wav_header(1, 0, 200) + bytes(200), frozenset({REFUSED})))
    add(Case("rate", "wav 4294967295 Hz header", wav_header(1, 0xFFFFFFFF, 200) + bytes(200), frozenset({REFUSED})))
    add(Case("rate", "flac 44101 Hz", encode(tone(2.0, 44101), 44101, "FLAC"), frozenset({OK})))
    # -- channels
    for ch in ([1, 2, 8, 9, 64, 1000, 1024, 2000] if not quick else [2, 8, 9, 1024]):
        if ch <= 8:
            add(Case("channels", f"wav {ch} ch", encode(tone(2.0, 16000, ch), 16000, "WAV", "PCM_16"),
                     frozenset({OK})))
        else:
            add(Case("channels", f"wav header {ch} ch", wav_header(ch, 16000, ch * 2 * 100) + bytes(ch * 2 * 100),
                     frozenset({REFUSED})))
    add(Case("channels", "wav 0 ch header", wav_header(0, 16000, 200) + bytes(200), frozenset({REFUSED})))
    # -- lengths
    lengths = [(0.0, REFUSED), (1 / 16000, REFUSED), (0.3, REFUSED), (0.6, OK), (29.9, OK), (30.5, TOO_LARGE),
               (90.0, TOO_LARGE)]
    if quick:
        lengths = [(0.0, REFUSED), (0.3, REFUSED), (29.9, OK), (30.5, TOO_LARGE)]
    for seconds, status in lengths:
        add(Case("length", f"wav {seconds:g} s", encode(tone(seconds, 16000), 16000, "WAV", "PCM_16"),
                 frozenset({status})))
    add(Case("length", "wav header only", wav_header(1, 16000, 0), frozenset({REFUSED})))
    short = encode(tone(2.0, 16000), 16000, "WAV", "PCM_16")
    add(Case("length", "wav declares 4 GiB, holds 2 s", short[:4] + struct.pack("<I", 0xFFFFFFFF) + short[8:40]
             + struct.pack("<I", 0xFFFFFFFF) + short[44:], frozenset({OK})))
    add(Case("length", "wav declares 2 GiB, holds 50 frames", wav_header(1, 16000, 1 << 31) + bytes(100),
             frozenset({REFUSED})))  # 3 ms: shorter than a prompt
    # -- formats (2 s stereo at 48 kHz, every container we accept, subtypes, refused containers)
    for label, fmt, sub in _formats():
        add(Case("format", f"{label} 48 kHz stereo", encode(tone(2.0, 48000, 2), 48000, fmt, sub), frozenset({OK})))
    subtypes = ["PCM_U8", "PCM_24", "PCM_32", "FLOAT", "DOUBLE", "ULAW", "ALAW", "IMA_ADPCM", "MS_ADPCM", "GSM610"]
    for sub in subtypes if not quick else ["FLOAT", "IMA_ADPCM"]:
        sr = 8000 if sub == "GSM610" else 16000
        add(Case("format", f"wav {sub}", encode(tone(2.0, sr), sr, "WAV", sub),
                 frozenset({REFUSED}) if sr < 16000 else frozenset({OK})))
    for fmt, sub in [("RF64", "PCM_16"), ("WAVEX", "PCM_16"), ("FLAC", "PCM_24")]:
        add(Case("format", f"{fmt} {sub}", encode(tone(2.0, 16000), 16000, fmt, sub), frozenset({OK})))
    for fmt, sub in [("AIFF", "PCM_16"), ("AU", "PCM_16"), ("CAF", "PCM_16"), ("W64", "PCM_16"), ("PAF", "PCM_16"),
                     ("MAT5", "DOUBLE"), ("NIST", "PCM_16"), ("VOC", "PCM_16")]:
        if quick and fmt not in ("AIFF", "MAT5"):
            continue
        add(Case("format", f"{fmt} (refused container)", encode(tone(2.0, 16000), 16000, fmt, sub),
                 frozenset({REFUSED})))
    nan = tone(2.0, 16000)
    nan[1000] = np.nan
    add(Case("format", "wav float with NaN", encode(nan, 16000, "WAV", "FLOAT"), frozenset({REFUSED})))
    add(Case("format", "silence", encode(np.zeros(32000, np.float32), 16000, "WAV", "PCM_16"), frozenset({REFUSED})))
    # -- truncated and corrupted
    for label, fmt, sub in _formats():
        good = encode(tone(2.0, 48000, 2), 48000, fmt, sub)
        cuts = [0, 1, 4, 12, 44, 100, len(good) // 3, len(good) // 2, len(good) - 1]
        for n in cuts if not quick else [4, 44, len(good) // 2]:
            add(Case("truncated", f"{label} first {n} of {len(good)} bytes", good[:n],
                     frozenset({REFUSED}) if n < 44 else ANY))
        for i in range(12 if not quick else 3):
            b = bytearray(good)
            for pos in rng.integers(0, min(len(b), 4096) if i % 2 else len(b), 16):
                b[pos] = int(rng.integers(0, 256))
            add(Case("corrupt", f"{label} 16 random bytes #{i}", bytes(b), ANY))
    for i in range(8 if not quick else 2):
        add(Case("corrupt", f"random {1 << (4 + 2 * i)} bytes", rng.integers(0, 256, 1 << (4 + 2 * i),
                                                                                dtype=np.uint8).tobytes(),
                 frozenset({REFUSED})))
    add(Case("corrupt", "RIFF then 0xff", b"RIFF" + b"\xff" * 60, frozenset({REFUSED})))
    add(Case("corrupt", "fLaC magic only", b"fLaC", frozenset({REFUSED})))
    add(Case("corrupt", "OggS magic only", b"OggS" + bytes(60), frozenset({REFUSED})))
    # -- compression bombs: small files that decode to a long time
    bomb_s = 600 if quick else HOUR_S
    for label, fmt, sub in _formats():
        if quick and label not in ("flac", "opus"):
            continue
        if label == "wav":
            continue
        sr = 8000 if label == "mp3" else 16000
        data = silence_file(bomb_s, sr, fmt, sub)
        add(Case("bomb", f"{label} {bomb_s} s of silence", data, frozenset({TOO_LARGE}),
                 extra={"decodes_to_s": bomb_s}))
    flac_long = silence_file(bomb_s, 16000, "FLAC") if quick else silence_file(600, 16000, "FLAC")
    long_tone = encode(tone(120.0, 16000), 16000, "FLAC")
    add(Case("bomb", "flac length unknown, 120 s of tone", flac_total_samples(long_tone, 0), frozenset({TOO_LARGE}),
             extra={"decodes_to_s": 120}))
    add(Case("bomb", "flac length unknown, silence", flac_total_samples(flac_long, 0), frozenset({TOO_LARGE})))
    add(Case("bomb", "flac header says 2 s, holds 120 s", flac_total_samples(long_tone, 32000), frozenset({OK})))
    return out


# ------------------------------------------------------------------------------ the service in process
class _Method:
    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args):
        return self._fn(*args)


class LocalHandle:
    """``handle.method.remote(*args)`` awaits the method of an object in this process."""

    def __init__(self, target):
        self._target = target

    def __getattr__(self, name):
        return _Method(getattr(self._target, name))


def build_app(voices_dir: str):
    """The ingress's ASGI app over a real tiny-model TextFrontend (uploads only; no synthesizer)."""
    from deployments.frontend import FrontendConfig, TextFrontend
    from deployments.model_source import ModelSource
    from serve_app.ingress import IngressConfig, TTSIngress

    fcfg = FrontendConfig(voices_dir=voices_dir)
    frontend = TextFrontend(fcfg, ModelSource(None, "cosyvoice2"))
    ingress = TTSIngress(IngressConfig(max_prompt_audio_s=fcfg.max_prompt_audio_s), LocalHandle(frontend), None)
    return ingress.__serve_build_asgi_app__()


class PeakRss:
    """Samples this process's RSS every ``interval_s`` while active; ``peak`` since the last reset."""

    def __init__(self, interval_s: float = 0.002):
        import psutil

        self._proc, self._interval = psutil.Process(), interval_s
        self.peak = self.now()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        return self._proc.memory_info().rss

    def _run(self):
        while not self._stop.wait(self._interval):
            self.peak = max(self.peak, self.now())

    def reset(self) -> None:
        self.peak = self.now()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


async def run_campaign(all_cases: list[Case], voices_dir: str) -> dict:
    import httpx

    app = build_app(voices_dir)
    rss = PeakRss()
    baseline = rss.now()
    rows = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://fuzz", timeout=600) as client:
        for i, case in enumerate(all_cases):
            rss.reset()
            started = time.perf_counter()
            r = await client.post("/v1/voices", data={"voice_id": f"fz{i % 4}", "prompt_text": "fuzz prompt",
                                                      "overwrite": "true"},
                                  files={"audio": ("upload.bin", case.data, "application/octet-stream")})
            latency = time.perf_counter() - started
            body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
            message = (body.get("error") or {}).get("message", "") if isinstance(body, dict) else ""
            rows.append({"kind": case.kind, "name": case.name, "bytes": len(case.data), "status": r.status_code,
                         "expected": sorted(case.expect), "as_expected": r.status_code in case.expect,
                         "latency_s": round(latency, 4), "rss_after_mib": round(rss.now() / 2**20, 1),
                         "rss_peak_mib": round(rss.peak / 2**20, 1), "message": message[:160], **case.extra})
        # Healthy after: a normal voice registers and the list answers.
        good = encode(tone(3.0, 24000), 24000, "WAV", "PCM_16")
        after = await client.post("/v1/voices", data={"voice_id": "after", "prompt_text": "still fine"},
                                  files={"audio": ("a.wav", good, "audio/wav")})
        listed = await client.get("/v1/voices")
    rss.close()
    healthy = after.status_code == 201 and listed.status_code == 200 and any(
        v["voice_id"] == "after" for v in listed.json()["voices"])
    return {"rows": rows, "baseline_rss_mib": round(baseline / 2**20, 1), "healthy_after": healthy}


def summarize(result: dict) -> dict:
    rows = result["rows"]
    by_kind: dict[str, dict] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        ks = [r for r in rows if r["kind"] == kind]
        by_kind[kind] = {"cases": len(ks), "statuses": dict(Counter(str(r["status"]) for r in ks)),
                         "unexpected": sum(not r["as_expected"] for r in ks),
                         "max_latency_s": max(r["latency_s"] for r in ks),
                         "max_rss_peak_mib": max(r["rss_peak_mib"] for r in ks)}
    slowest = max(rows, key=lambda r: r["latency_s"])
    return {"cases": len(rows), "count_5xx": sum(r["status"] >= 500 for r in rows),
            "unexpected": sum(not r["as_expected"] for r in rows), "by_kind": by_kind,
            "max_latency_s": slowest["latency_s"], "slowest_case": slowest["name"],
            "max_rss_peak_mib": max(r["rss_peak_mib"] for r in rows),
            "max_rss_growth_mib": round(max(r["rss_peak_mib"] for r in rows) - result["baseline_rss_mib"], 1),
            "baseline_rss_mib": result["baseline_rss_mib"], "healthy_after": result["healthy_after"]}


def write_report(out: Path, result: dict, summary: dict, meta: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": result["rows"]},
                                                   indent=1, ensure_ascii=False))
    lines = [f"# Upload fuzz campaign, {meta['date']}", "",
             f"Machine: {meta['machine']}. Command: `{meta['command']}`. {meta['what']}", "",
             (f"**{summary['cases']} cases, {summary['count_5xx']} answered 5xx, {summary['unexpected']} with "
              f"another status than expected; service healthy after: {summary['healthy_after']}.**"), "",
             (f"Max latency {summary['max_latency_s']:.3f} s ({summary['slowest_case']}); process RSS "
              f"{summary['baseline_rss_mib']:.0f} MiB before the campaign, peak {summary['max_rss_peak_mib']:.0f} MiB "
              f"(+{summary['max_rss_growth_mib']:.0f} MiB)."), "",
             "| kind | cases | statuses | unexpected | max latency (s) | max peak RSS (MiB) |", "|---|---|---|---|---|---|"]
    for kind, k in summary["by_kind"].items():
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(k["statuses"].items()))
        lines.append(f"| {kind} | {k['cases']} | {statuses} | {k['unexpected']} | {k['max_latency_s']:.3f} | "
                     f"{k['max_rss_peak_mib']:.0f} |")
    lines += ["", "## Every case", "", "| kind | case | bytes | status | latency (s) | peak RSS (MiB) | message |",
              "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        msg = r["message"].replace("|", "/")
        flag = "" if r["as_expected"] else " (unexpected)"
        lines.append(f"| {r['kind']} | {r['name']} | {r['bytes']} | {r['status']}{flag} | {r['latency_s']:.3f} | "
                     f"{r['rss_peak_mib']:.0f} | {msg} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few cases of each kind, 10-minute bombs")
    day = time.strftime("%Y-%m-%d")
    ap.add_argument("--out", default=f"bench/results/{day}-fuzz-uploads/fuzz-uploads-{day}")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    built = time.perf_counter()
    all_cases = cases(quick=a.quick, seed=a.seed)
    build_s = time.perf_counter() - built
    with tempfile.TemporaryDirectory() as voices:
        result = asyncio.run(run_campaign(all_cases, voices))
    summary = summarize(result)
    import psutil

    meta = {"date": time.strftime("%Y-%m-%d"), "command": "python -m bench.fuzz_uploads" + (" --quick" * a.quick),
            "machine": f"{platform.machine()} VM, {psutil.cpu_count()} CPU cores "
                       f"({psutil.virtual_memory().total / 2**30:.0f} GiB), shared with other work, no GPU",
            "what": "POST /v1/voices on the ingress app in process, real TextFrontend over the tiny CosyVoice2 model; "
                    f"cases built in {build_s:.0f} s (not timed per case).", "seed": a.seed}
    write_report(Path(a.out), result, summary, meta)
    print(json.dumps(summary, indent=1))
    return 0 if summary["count_5xx"] == 0 and summary["healthy_after"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
