"""CosyVoice3's causal vocoder streaming whole utterances: the official full recompute against the
incremental strategy (``cosyvoice_runtime.hift.incremental``), batched as a replica batches it.

Full-size CV3 vocoder with random weights (timing only; its output is compared between the two
strategies). ``batch`` streams advance in lockstep through the streaming hop schedule of the
spec (25 tokens, doubling up to 100; 2 mel frames per token), each step one ``vocode_batch``
call. Writes ``<out>.json`` and ``<out>.png`` (time per call against the audio made so far).

    python -m bench.cv3_vocoder --seconds 10 --batch 1,8 --out bench/results/<date>-cpu-cv3-vocoder/cv3-vocoder-cpu-<date>
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from cosyvoice_runtime.hift.generator import build_hift
from cosyvoice_runtime.hift.streaming import VocoderCall, VocoderStream, vocode_batch
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir

STRATEGIES = ("recompute", "incremental")


def chunk_frames(spec, seconds: float) -> list[int]:
    """Mel frames per streamed call for an utterance of ``seconds`` (the last call finalizes)."""
    ratio, total = spec.flow.token_mel_ratio, round(seconds * spec.token_frame_rate)
    sizes, hop, done = [], spec.stream.token_hop_len, 0
    while done < total:
        n = min(hop, total - done)
        sizes.append(n * ratio)
        done += n
        hop = min(spec.stream.token_max_hop_len, hop * spec.stream.stream_scale_factor)
    return sizes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stream_batch(hift, spec, strategy: str, mels: torch.Tensor, sizes: list[int]) -> tuple[list[float], torch.Tensor]:
    """Vocode ``mels`` (B, 80, T) as B lockstep streams; per-call ms and the (B, samples) audio."""
    states = [VocoderStream.create(spec, strategy=strategy) for _ in range(mels.shape[0])]
    ms, audio, start = [], [[] for _ in states], 0
    for k, n in enumerate(sizes):
        chunks = [mels[i:i + 1, :, start:start + n] for i in range(mels.shape[0])]
        sync(mels.device)
        t0 = time.perf_counter()
        outs = vocode_batch(hift, [VocoderCall(st, ch, k == len(sizes) - 1) for st, ch in zip(states, chunks)])
        sync(mels.device)
        ms.append(1e3 * (time.perf_counter() - t0))
        for a, o in zip(audio, outs):
            a.append(o)
        start += n
    return ms, torch.stack([torch.cat(a, dim=1)[0] for a in audio])


def measure(device: str, seconds: float, batches: list[int], size: str, reps: int) -> dict:
    dev = torch.device(device)
    spec = write_config_dir(tempfile.mkdtemp(prefix="cv3-vocoder-"), "cosyvoice3",
                            None if size == "full" else TINY_DIMS["cosyvoice3"])
    torch.manual_seed(0)
    hift = build_hift(spec.hift, spec.flow).to(dev)
    hift.remove_weight_norm()
    hift.eval().requires_grad_(False)
    sizes = chunk_frames(spec, seconds)
    rows = []
    for b in batches:
        mels = torch.randn(b, spec.hift.in_channels, sum(sizes), generator=torch.Generator().manual_seed(b)).to(dev)
        audio = {}
        for strategy in STRATEGIES:
            stream_batch(hift, spec, strategy, mels[:, :, :sum(sizes[:2])], sizes[:2])  # warm-up: two calls
            runs = [stream_batch(hift, spec, strategy, mels, sizes) for _ in range(reps)]
            per_call = [statistics.median(r[0][k] for r in runs) for k in range(len(sizes))]
            audio[strategy] = runs[0][1]
            rows.append({"strategy": strategy, "batch": b, "calls": len(sizes), "per_call_ms": per_call,
                         "total_ms": sum(per_call), "reps": reps})
        diff = float((audio["recompute"] - audio["incremental"]).abs().max())
        rows[-1]["max_abs_diff_vs_recompute"] = rows[-2]["max_abs_diff_vs_recompute"] = diff
    cpu = f"cpu ({platform.processor() or platform.machine()})"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu
    return {"device": name, "date": time.strftime("%Y-%m-%d"), "size": size, "seconds": seconds,
            "chunk_frames": sizes, "torch_threads": torch.get_num_threads(), "rows": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ends, acc = [], 0
    for n in result["chunk_frames"]:
        acc += n
        ends.append(acc / 50)  # 50 mel frames per second
    fig, ax = plt.subplots(figsize=(7, 4))
    for row in result["rows"]:
        ax.plot(ends, row["per_call_ms"], marker="o", linestyle="-" if row["strategy"] == "incremental" else "--",
                label=f"{row['strategy']}, batch {row['batch']}")
    ax.set_xlabel("audio made after the call (s)")
    ax.set_ylabel("vocoder call (ms, median)")
    ax.set_title(f"CosyVoice3 vocoder streaming, {result['device']}, {result['date']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seconds", type=float, default=10.0, help="utterance length")
    ap.add_argument("--batch", default="1,8", help="streams vocoded together")
    ap.add_argument("--size", default="full", choices=["full", "tiny"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True, help="path prefix of the .json and .png")
    args = ap.parse_args(argv)
    result = measure(args.device, args.seconds, [int(x) for x in args.batch.split(",")], args.size, args.reps)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    for row in result["rows"]:
        print(json.dumps({k: v for k, v in row.items() if k != "per_call_ms"}), flush=True)


if __name__ == "__main__":
    main()
