"""Text-normalisation throughput on one CPU core (sentences/s), zh / en / mixed.

    python -m bench.normalize_bench [--seconds 5] [--core 0] [--out bench/results]

Pins the process to one core (``os.sched_setaffinity``) and one torch thread, warms wetext up
(its FSTs load lazily on the first call), then normalises + splits a fixed corpus repeatedly for
about ``--seconds`` per language set. Writes ``normalize-<host>-<date>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import platform
import socket
import statistics
import time
from pathlib import Path

logger = logging.getLogger("bench.normalize")

CORPUS = {
    "zh": [
        "今天是2024年3月5日，气温-3.5度，我们去公园玩了3个小时。",
        "这款手机的价格是1,299元，比去年便宜了15%。",
        "会议定在下午3:30开始，请大家提前10分钟到场。",
        "他跑完全程42.195公里，用时2小时59分。",
        "希望你以后能够做的比我还好呦。",
        "收到了你的来信，我非常高兴，一切都好。",
        "第3章讲的是1/3的人口居住在沿海地区。",
        "面积大约是120平方米，价格在500万左右。",
    ],
    "en": [
        "On March 5, 2024 the temperature was 3.5 degrees and we paid $20 for tickets.",
        "It costs $1,234.50 today, about 10% more than last year.",
        "The meeting starts at 10:30 in room 101 on the 3rd floor.",
        "He was born in 1990 and moved to London in the 2010s.",
        "There are 2 cats and 3 dogs in the house.",
        "Please call me back when you have a moment to talk about the plan.",
        "The 21st century has seen 1,000,000 new ideas.",
        "She ran 42.2 km in 3 hours and 5 minutes.",
    ],
    "mixed": [
        "我喜欢iPhone 15 Pro，价格是$999。",
        "他在21st Century Fox工作了3年。",
        "这个API每秒可以处理1,000个request。",
        "我们用Python 3.11写了一个demo，效果很好。",
        "上世纪90s的音乐，比如Michael Jackson，至今仍很流行。",
        "下载速度大约是100 MB/s，比Wi-Fi快。",
        "请在12:30之前提交report，谢谢。",
        "OpenAI在2023年发布了GPT-4。",
    ],
}


def pin_one_core(core: int | None) -> str:
    try:
        import torch

        torch.set_num_threads(1)
    except Exception:  # noqa: BLE001, S110 - torch is optional for this benchmark
        pass
    if hasattr(os, "sched_setaffinity"):
        avail = sorted(os.sched_getaffinity(0))
        chosen = core if core is not None and core in avail else avail[0]
        os.sched_setaffinity(0, {chosen})
        return f"core {chosen} (sched_setaffinity)"
    return "not pinned (no sched_setaffinity)"


def run(seconds: float, use_wetext: bool) -> dict:
    from tqdm import tqdm

    from cosyvoice_runtime.frontend.normalize import TextNormalizer

    norm = TextNormalizer(use_wetext=use_wetext)
    for sents in CORPUS.values():  # warm-up: lazy FST loading, regex compilation
        for s in sents:
            norm.normalize(s)
    results = {}
    for lang, sents in CORPUS.items():
        per_sentence = []
        n, t0 = 0, time.perf_counter()
        with tqdm(desc=f"{lang:5s} wetext={use_wetext}", unit="sent", leave=False) as bar:
            while time.perf_counter() - t0 < seconds:
                for s in sents:
                    a = time.perf_counter()
                    norm.normalize(s)
                    per_sentence.append(time.perf_counter() - a)
                n += len(sents)
                bar.update(len(sents))
        elapsed = time.perf_counter() - t0
        per_sentence.sort()
        results[lang] = {
            "sentences": n, "seconds": round(elapsed, 3), "sentences_per_s": round(n / elapsed, 1),
            "mean_ms": round(1e3 * statistics.fmean(per_sentence), 3),
            "p50_ms": round(1e3 * per_sentence[len(per_sentence) // 2], 3),
            "p99_ms": round(1e3 * per_sentence[int(len(per_sentence) * 0.99)], 3),
            "mean_chars": round(statistics.fmean(len(s) for s in sents), 1),
        }
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measuring time per language set")
    ap.add_argument("--core", type=int, default=None)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("cosyvoice_runtime").setLevel(logging.ERROR)
    pinning = pin_one_core(args.core)
    from importlib.metadata import version

    import wetext  # noqa: F401

    report = {
        "benchmark": "text normalisation + sentence splitting (TextNormalizer.normalize, split=True)",
        "host": socket.gethostname(), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "wetext": version("wetext"), "pinning": pinning, "seconds_per_set": args.seconds,
        "with_wetext": run(args.seconds, True), "rules_only": run(args.seconds, False),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"normalize-{report['host']}-{dt.date.today().isoformat()}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1, ensure_ascii=False))
    lines = [f"# Text normalisation throughput ({report['host']}, {report['date']})", "",
             (f"One core ({pinning}), 1 torch thread, wetext {report['wetext']}, Python {report['python']}, "
              f"{args.seconds:g} s per set. Each call = normalise + split one sentence (end to end, as a request)."),
             "",
             "| backend | set | sentences/s | mean ms | p50 ms | p99 ms | chars/sentence |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for backend in ("with_wetext", "rules_only"):
        for lang, r in report[backend].items():
            lines.append(f"| {backend} | {lang} | {r['sentences_per_s']} | {r['mean_ms']} | {r['p50_ms']} | "
                         f"{r['p99_ms']} | {r['mean_chars']} |")
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    logger.info("wrote %s.{md,json}", out / stem)
    print("\n".join(lines))  # CLI output


if __name__ == "__main__":
    main()
