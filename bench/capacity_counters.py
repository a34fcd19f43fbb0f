"""What ``bench/capacity.py`` reads beside its requests: the targets' counters (CUDA graphs, the
garbage collector's pauses, threads' CPU time, the GIL probe), differenced around each probe, and
the GPU's utilisation (``nvidia-smi`` once a second, averaged per probe window)."""
from __future__ import annotations

import statistics
import subprocess
import threading
import time

from cosyvoice_runtime.graph_capture import captured_total, missed_total
from deployments.python_gc import watched
from deployments.thread_load import gil_wait, thread_cpu_seconds


def scraped_durations(samples, slow_bound: float) -> dict:
    """Scraped histogram samples (of every replica the scrape shows) back in the shape of
    :meth:`deployments.observability.Durations.snapshot`: ``count``, ``seconds`` and ``slow`` (the
    durations past ``slow_bound``, which must be one of the histogram's bounds)."""
    count = seconds = within = 0.0
    for sample in samples:
        if sample.name.endswith("_count"):
            count += sample.value
        elif sample.name.endswith("_sum"):
            seconds += sample.value
        elif sample.name.endswith("_bucket") and float(sample.labels["le"]) == slow_bound:
            within += sample.value
    return {"count": count, "seconds": seconds, "slow": count - within}


def process_counters() -> dict[str, float]:
    """The counters of this process (the replica simulation's, or the in-process level's deployments)."""
    return {"graph_captures": float(captured_total()), "graph_misses": float(missed_total()),
            **gc_counters(watched().snapshot()),
            **thread_counters(thread_cpu_seconds(), gil_wait().snapshot())}


def gc_counters(snapshot: dict, prefix: str = "gc") -> dict[str, float]:
    """Counters of the garbage collector's pauses (a :meth:`GcPauses.snapshot`): full collections,
    pause time of every generation (ms), pauses longer than ``SLOW_PAUSE_S``."""
    gens = snapshot["by_generation"]
    return {f"{prefix}_full": float(gens.get("2", {}).get("count", 0)),
            f"{prefix}_pause_ms": 1e3 * sum(g["seconds"] for g in gens.values()),
            f"{prefix}_slow": float(snapshot["slow"])}


def thread_counters(cpu_s: dict[str, float], gil: dict) -> dict[str, float]:
    """Counters of a replica's threads: CPU seconds by thread group (``cpu_s:<group>``), the GIL
    probe's readings, their total lateness (ms) and how many were past ``SLOW_WAIT_S``, and this
    process's clock (``wall_s``) that :func:`probe_counters` divides the CPU seconds by."""
    return {"wall_s": time.perf_counter(), **{f"cpu_s:{k}": v for k, v in cpu_s.items()},
            "gil_readings": float(gil["count"]), "gil_wait_ms": 1e3 * gil["seconds"], "gil_slow": float(gil["slow"])}


def probe_counters(before: dict[str, float], after: dict[str, float]) -> dict:
    """What a probe reports of the counters read around it: their increments, with the threads'
    CPU seconds as cores busy (``threads_busy``) and the GIL probe's mean wait."""
    deltas = counter_deltas({k: v for k, v in before.items() if not k.startswith("cpu_s:")}, after)
    if "prompt_cache_gib" in after:  # the resolved budget (cv2_prompt_cache_bytes), a level, not an increment
        deltas["prompt_cache_gib"] = round(after["prompt_cache_gib"], 2)
    hits, misses = deltas.pop("flow_prompt_prefix_hits", 0.0), deltas.pop("flow_prompt_prefix_misses", 0.0)
    if hits + misses:  # per-voice prompt prefixes the flow reused, of those it looked up
        deltas["prompt_prefix_hit_pct"] = round(100 * hits / (hits + misses), 1)
    wall = deltas.pop("wall_s", 0.0)
    # a thread pool starts its threads at first use: one started during the probe had 0 s before it
    cpu = {k.removeprefix("cpu_s:"): v - before.get(k, 0.0) for k, v in after.items() if k.startswith("cpu_s:")}
    if wall > 0 and cpu:
        deltas["threads_busy"] = {k: round(v / wall, 3) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}
    rows, ready = deltas.pop("flow_rows_in_passes", None), deltas.pop("flow_rows_ready", None)
    if rows is not None and deltas.get("flow_passes"):  # the serve and in-process levels' stepped token2wav
        deltas["flow_rows_per_pass"] = round(rows / deltas["flow_passes"], 2)
        if ready is not None:
            deltas["flow_rows_ready_per_pass"] = round(ready / deltas["flow_passes"], 2)
    readings = deltas.pop("gil_readings", 0.0)
    if readings:
        deltas["gil_wait_mean_ms"] = deltas["gil_wait_ms"] / readings
    return deltas


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What each counter grew by over a probe (``graph_captures``: CUDA graphs captured under its
    traffic, each a shape not captured at start-up)."""
    return {k: after[k] - before[k] for k in before if k in after}


class GpuSampler:
    """Mean GPU utilisation (``nvidia-smi``, percent) over a time span; None without a GPU tool."""

    def __init__(self, period_ms: int = 1000) -> None:
        self.samples: list[tuple[float, float]] = []
        self._proc: subprocess.Popen | None = None
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", f"-lms={period_ms}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self._proc.stdout:
            try:
                self.samples.append((time.perf_counter(), float(line.split(",")[0])))
            except ValueError:
                continue

    def mean(self, t0: float, t1: float) -> float | None:
        vals = [v for t, v in self.samples if t0 <= t < t1]
        return round(statistics.mean(vals), 1) if vals else None

    def close(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
