"""Figures of a fleet simulation: per-policy summary, per-minute series, plots, and the replica
counts per 10 s bin that the live ramp is compared with (:func:`compare_replicas`)."""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.fleet_inputs import ReplicaModel
from bench.fleet_model import Run
from bench.fleet_workload import Trace

LATE_SHARE_OF_MINUTE = 0.01  # a minute violates the SLO when over 1 % of its requests start late


def _per_minute(values: np.ndarray, fn=np.sum, minute_s: int = 60) -> np.ndarray:
    n = math.ceil(len(values) / minute_s)
    return np.array([fn(values[m * minute_s:(m + 1) * minute_s]) for m in range(n)])


def violation_minutes(run: Run, minute_s: int = 60) -> np.ndarray:
    """Per minute: True when over 1 % of its session-seconds (a session's requests are spread over
    its time) ran on a replica past the SLO or waited for one (the minute's p99 first audio is
    then over the SLO). Refused requests are counted apart, not as late."""
    late = _per_minute(run.late, minute_s=minute_s)
    total = _per_minute(run.served + run.rejected, minute_s=minute_s)
    return (total > 0) & (late > LATE_SHARE_OF_MINUTE * np.maximum(total, 1))


def summarise(run: Run, oracle: np.ndarray, replica: ReplicaModel, gpu_hour_usd: float) -> dict[str, Any]:
    gpu_hours = float(run.nodes.sum()) / 3600
    oracle_hours = float(oracle.sum()) / 60
    audio_hours = float(run.audio_s.sum()) / 3600
    bad = violation_minutes(run)
    minutes = int(((_per_minute(run.served + run.rejected)) > 0).sum())
    sessions = float((run.served + run.rejected).sum())
    mean_sessions = float(run.served.sum()) / max(1, int(run.running.sum()))
    return {
        "gpu_hours": round(gpu_hours, 2),
        "replica_hours": round(float(run.replicas.sum()) / 3600, 2),
        "serving_replica_hours": round(float(run.running.sum()) / 3600, 2),
        "gpu_hours_vs_oracle": round(gpu_hours / oracle_hours, 4) if oracle_hours else None,
        "slo_violation_minutes": int(bad.sum()),
        "slo_violation_minutes_pct": round(100 * float(bad.sum()) / max(1, minutes), 3),
        "late_share_pct": round(100 * float(run.late.sum()) / max(1.0, sessions), 4),
        "rejected_share_pct": round(100 * float(run.rejected.sum()) / max(1.0, sessions), 4),
        "audio_hours": round(audio_hours, 1),
        "cost_usd": round(gpu_hours * gpu_hour_usd, 2),
        "cost_per_audio_hour_usd": round(gpu_hours * gpu_hour_usd / audio_hours, 4) if audio_hours else None,
        "peak_replicas": int(run.running.max()),
        "peak_nodes": int(run.nodes.max()),
        "mean_sessions_per_replica": round(mean_sessions, 2),
        # the headroom the policy kept: compare with the trace's rise within the fleet's reaction
        "capacity_over_mean_load": round(replica.max_sessions / mean_sessions, 3) if mean_sessions else None,
        "target_changes": int(np.count_nonzero(np.diff(run.target))),
        "policy_calls": run.policy_calls,
        "sessions_per_replica_at_slo": round(replica.max_sessions, 2),
    }


def oracle_summary(oracle: np.ndarray, trace: Trace, replica: ReplicaModel, gpu_hour_usd: float) -> dict[str, Any]:
    hours = float(oracle.sum()) / 60
    audio = float(trace.active.sum()) * replica.audio_per_session(replica.max_sessions) / 3600
    return {"gpu_hours": round(hours, 2), "peak_replicas": int(oracle.max()),
            "cost_per_audio_hour_usd": round(hours * gpu_hour_usd / audio, 4) if audio else None,
            "definition": "per minute, ceil(peak sessions / sessions per replica at the SLO), at least "
                          "min_replicas, started the instant it is needed"}


def series(run: Run, minute_s: int = 60) -> dict[str, list]:
    """Per-minute series for the plots and the dated JSON."""
    return {
        "running_mean": [round(float(v), 2) for v in _per_minute(run.running, np.mean, minute_s)],
        "nodes_mean": [round(float(v), 2) for v in _per_minute(run.nodes, np.mean, minute_s)],
        "violation": [bool(v) for v in violation_minutes(run, minute_s)],
        "rejected": [int(v) for v in _per_minute(run.rejected, minute_s=minute_s)],
        "p99_ms_max": [round(float(v), 1) for v in _per_minute(np.where(np.isfinite(run.p99_ms), run.p99_ms, 1e4),
                                                                 np.max, minute_s)],
    }


# --- Replica counts per bin: the simulated ramp against the live one ---------------------------

def replica_bins(running: Sequence[float], bin_s: int = 10) -> list[float]:
    """Mean running replicas per ``bin_s`` bin of a per-second series (the simulator's)."""
    values = np.asarray(running, dtype=float)
    return [round(float(v), 3) for v in _per_minute(values, np.mean, bin_s)]


def bin_samples(samples: Sequence[tuple[float, float]], end_s: float, bin_s: int = 10) -> list[float]:
    """Replica counts sampled at irregular times (the live ramp's ``/health`` polls, ``(t s,
    replicas)``) as the mean per ``bin_s`` bin; a bin without a sample keeps the last count."""
    bins = math.ceil(end_s / bin_s)
    sums, counts = np.zeros(bins), np.zeros(bins)
    for t, n in samples:
        i = int(t // bin_s)
        if 0 <= i < bins:
            sums[i] += n
            counts[i] += 1
    out, last = [], math.nan
    for s, c in zip(sums, counts, strict=True):
        last = s / c if c else last
        out.append(last)
    return out


def compare_replicas(sim: Sequence[float], live: Sequence[float]) -> dict[str, Any]:
    """Simulated against live replica counts, bin by bin (same ramp, same bin width).

    ``sim_vs_live_replica_error`` is the mean absolute difference in replicas per bin (issue 40's
    figure, target <= 1); ``relative_error`` is that over the mean live count. Bins without a live
    sample (NaN) are left out.
    """
    pairs = [(s, v) for s, v in zip(sim, live, strict=False) if not (math.isnan(s) or math.isnan(v))]
    if not pairs:
        raise ValueError("no bin holds both a simulated and a live count")
    diff = [abs(s - v) for s, v in pairs]
    mean_live = sum(v for _, v in pairs) / len(pairs)
    return {"bins": len(pairs), "mae_replicas": round(sum(diff) / len(diff), 3), "max_abs_error": round(max(diff), 3),
            "mean_live_replicas": round(mean_live, 3),
            "sim_vs_live_replica_error": round(sum(diff) / len(diff), 3),
            "relative_error": round(sum(diff) / len(diff) / mean_live, 4) if mean_live else None,
            "length_mismatch_bins": abs(len(sim) - len(live))}


# --- Plots ---------------------------------------------------------------------------------------

def plot_day(trace: Trace, runs: dict[str, Run], labels: dict[str, str], oracle: np.ndarray,
             replica: ReplicaModel, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hours = np.arange(len(oracle)) / 60
    fig, axes = plt.subplots(3, 1, figsize=(12, 10), sharex=True, height_ratios=[1, 2, 1])
    axes[0].plot(hours, _per_minute(trace.active, np.max), color="black", lw=0.8)
    axes[0].set_ylabel("sessions open\n(minute peak)")
    axes[1].step(hours, oracle, where="post", color="black", lw=1.2, ls="--", label="oracle (no start time)")
    top = max(2 * oracle.max(), 10)
    for name, run in runs.items():
        label = labels[name] + (f" (peak {run.running.max()}, off the scale)" if run.running.max() > top else "")
        axes[1].plot(hours, _per_minute(run.running, np.mean), lw=0.9, label=label)
    axes[1].set_ylabel("replicas serving")
    axes[1].set_ylim(0, top)
    axes[1].legend(fontsize=8, loc="upper left")
    for i, (name, run) in enumerate(runs.items()):
        bad = violation_minutes(run)
        axes[2].scatter(hours[bad], np.full(bad.sum(), i), s=4, marker="|")
    axes[2].set_yticks(range(len(runs)), [n for n in runs], fontsize=8)
    axes[2].set_ylabel("minutes over\nthe SLO")
    axes[2].set_xlabel("hour of the day")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_window(trace: Trace, runs: dict[str, Run], labels: dict[str, str], start_s: int, end_s: int,
                replica: ReplicaModel, path: Path, title: str) -> None:
    """Second by second over a window (a burst): sessions as replicas' worth at the SLO, and the
    replicas serving per policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.arange(start_s, end_s) / 3600
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.plot(t, trace.active[start_s:end_s] / replica.max_sessions, color="black", lw=0.8,
            label=f"sessions / {replica.max_sessions:.1f} (replicas needed at the SLO)")
    for name, run in runs.items():
        if run.running[start_s:end_s].max() <= 3 * (trace.active[start_s:end_s].max() / replica.max_sessions):
            ax.plot(t, run.running[start_s:end_s], lw=0.9, label=labels[name])
    ax.set_xlabel("hour of the day")
    ax.set_ylabel("replicas")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curve(replica: ReplicaModel, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = np.linspace(0, max(replica.p99_ms.xs) * 1.1, 200)
    ax.plot(xs, [replica.p99_ms(x) for x in xs], lw=1, label="interpolated")
    ax.scatter(replica.p99_ms.xs, replica.p99_ms.ys, color="black", zorder=3, label="measured")
    ax.axhline(replica.slo_p99_ms, color="red", ls="--", lw=0.8, label=f"SLO {replica.slo_p99_ms:g} ms")
    ax.axvline(replica.max_sessions, color="grey", ls=":", lw=0.8, label=f"{replica.max_sessions:.1f} sessions")
    ax.set_xlabel("voice-agent sessions on one replica")
    ax.set_ylabel("first audio p99 (ms)")
    ax.set_title(textwrap.fill(replica.source, 90), fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
