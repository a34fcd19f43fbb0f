"""The live autoscaling ramp's figures, per 10 s bin, its plots and its run folder (``bench/autoscale_live.py``).

Definitions (docs/tuning.md, "The live ramp"):

* **ideal replicas** of a bin: the fewest replicas that keep each at or under the band centre of
  its measured capacity, ``ceil(sessions open / (band centre x sessions per replica))`` with the
  bin's mean sessions (the client's count, not what the replicas report), within
  ``[min_replicas, max_replicas]``: what a policy without lag would run;
* **replica tracking**: the share of the ramp's bins whose running count (Serve's RUNNING
  replicas at the bin's sample) is within +-1 of the ideal;
* **scale-up bins**: a bin whose sample shows a replica starting, or where the policy asked for
  more than were running, and the bin after it (its requests were sent while the fleet was short);
  ``p99_ttfa_ms_outside_scaleup_max`` is the largest per-bin first audio p99 of the other bins;
* **cut stream**: a request whose audio had started and that ended in an error, or with under half
  the audio it asked for (a stream a draining replica dropped would show so);
* **cut short**: the ramp was interrupted (SIGINT) before its end: the figures are those of the
  part that ran, and requests still open then are not counted;
* **slowest requests**: the 5 requests of latest first audio of the run (``slowest``) and of the
  bins outside scale-up (``slowest_outside_scaleup``), each with its bin, when it was sent, its
  session and the server's first-audio stages: a bin of a few tens of requests has a p99 close to
  its slowest one, so these say what ``p99_ttfa_ms_outside_scaleup_max`` is made of.
"""
from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.capacity_load import SLOWEST
from bench.capacity_report import request_table
from bench.metrics import percentile
from bench.results_index import run_folder_name, write_run_record

STARTING = ("STARTING", "UPDATING", "RECOVERING", "PENDING_MIGRATION")
DRAINING = ("STOPPING",)
LATEST = "autoscale-latest.json"


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)


def _sent_in(requests: list[dict], bin_s: float, n: int) -> list[list[dict]]:
    """The requests of each of the ``n`` bins, by the time they were sent (``bins`` and the
    slowest requests place a request in the same bin)."""
    return [[r for r in requests if k * bin_s <= r["t_s"] < (k + 1) * bin_s] for k in range(n)]


def bins(run: dict[str, Any], open_per_s: list, requests: list[dict], samples: list[dict],
         policy: list[dict]) -> list[dict[str, Any]]:
    """One row per bin from the ramp's start to the last sample."""
    b = run["bin_s"]
    auto = run["autoscaling_reference"]
    lo, hi = int(auto["min_replicas"]), int(auto["max_replicas"])
    end = max([s["t_s"] for s in samples] + [t for t, _, _ in open_per_s] + [0.0])
    n_bins = math.ceil(end / b)
    sent = _sent_in(requests, b, n_bins)
    rows = []
    for k in range(n_bins):
        a, z = k * b, (k + 1) * b
        load = [(n, f) for t, n, f in open_per_s if a <= t < z]
        sessions = float(np.mean([n for n, _ in load])) if load else 0.0
        sample = next((s for s in reversed(samples) if a <= s["t_s"] < z and "states" in s), None)
        lines = [p for p in policy if a <= p["t_s"] < z]
        reqs = sent[k]
        ttfa = [r["ttfa_ms"] for r in reqs if r["ttfa_ms"] is not None]
        row: dict[str, Any] = {
            "t_s": round(a, 3), "sessions": round(sessions, 2),
            "client_streams": round(float(np.mean([f for _, f in load])), 2) if load else 0.0,
            "ideal": max(lo, min(hi, math.ceil(sessions / run["sessions_per_replica_worth"] - 1e-6))),
            "requests": len(reqs), "ttfa_p50_ms": _r(percentile(ttfa, 50)), "ttfa_p99_ms": _r(percentile(ttfa, 99)),
            "underruns": sum(r["underruns"] for r in reqs), "rejected_429": sum(r["rejected_429"] for r in reqs),
            "errors": sum(1 for r in reqs if r["error"] and not r["rejected_429"]), "cut": sum(r["cut"] for r in reqs)}
        if sample is not None:
            st = sample["states"]
            row.update(running=st.get("RUNNING", 0), starting=sum(st.get(s, 0) for s in STARTING),
                       draining=sum(st.get(s, 0) for s in DRAINING), ongoing=sample.get("ongoing", {}))
        if lines:
            last = lines[-1]
            state = last["state"]
            row["policy"] = {"running": last["running"], "decision": last["decision"],
                             "asked_more": any(p["decision"] > p["running"] for p in lines),
                             "load_pct": _r(state.get("load_pct")), "demand_streams": _r(state.get("demand_streams"), 2),
                             "by_queue": state.get("by_queue"), "reason": state.get("reason"),
                             "streams_in_flight": last["streams_in_flight"]}
        rows.append(row)
    def short(r: dict[str, Any]) -> bool:  # the fleet was short of what the policy wanted
        return r.get("starting", 0) > 0 or (r.get("policy") or {}).get("asked_more", False)

    for i, row in enumerate(rows):
        row["scale_up"] = short(row) or (i > 0 and short(rows[i - 1]))
    return rows


def slowest_requests(rows: list[dict[str, Any]], requests: list[dict], bin_s: float,
                     n: int = SLOWEST) -> dict[str, list[dict[str, Any]]]:
    """The ``n`` requests of latest first audio of the bins ``rows`` (``slowest``) and of those
    outside scale-up (``slowest_outside_scaleup``), slowest first; a tie keeps the earlier bin.

    Returns:
        Both lists; each request as its bin's ``t_s`` and ``scale_up``, ``submitted_s`` (when it
        was sent, s from the ramp's start), ``ttfa_ms``, ``session`` and ``stages_ms``.
    """
    timed = [{"t_s": row["t_s"], "scale_up": row["scale_up"], "submitted_s": r["t_s"], "ttfa_ms": r["ttfa_ms"],
              "session": r["session"], "stages_ms": r["stages_ms"]}
             for row, sent in zip(rows, _sent_in(requests, bin_s, len(rows)), strict=True)
             for r in sent if r["ttfa_ms"] is not None]
    timed.sort(key=lambda e: -e["ttfa_ms"])
    return {"slowest": timed[:n], "slowest_outside_scaleup": [e for e in timed if not e["scale_up"]][:n]}


def summarise(run: dict[str, Any], open_per_s: list, requests: list[dict], samples: list[dict],
              policy: list[dict]) -> dict[str, Any]:
    rows = bins(run, open_per_s, requests, samples, policy)
    ramp_end = (sum(v for k, v in run["shape_reference_s"].items() if k.endswith("_s")) * run["time_scale"]
                + run.get("paused_s", 0.0))  # a ramp that stood still (--wait-for-replicas) ended that much later
    judged = [r for r in rows if "running" in r and r["t_s"] < ramp_end]
    calm = [r["ttfa_p99_ms"] for r in rows if not r["scale_up"] and r["ttfa_p99_ms"] is not None]
    ttfa = [r["ttfa_ms"] for r in requests if r["ttfa_ms"] is not None]
    cold = run.get("cold_start_gpu")
    summary = {
        "max_replicas": max((r.get("running", 0) for r in rows), default=0),
        "cut_streams": sum(r["cut"] for r in requests),
        "p99_ttfa_ms_outside_scaleup_max": max(calm) if calm else None,
        "replica_tracking": round(sum(abs(r["running"] - r["ideal"]) <= 1 for r in judged) / len(judged), 4)
        if judged else None,
        "cold_start_s_gpu": cold["cold_start_s"] if cold else None,
        "cold_start_source": cold["source"] if cold else None,
        "requests": len(requests), "rejected_429": sum(r["rejected_429"] for r in requests),
        "errors": sum(1 for r in requests if r["error"] and not r["rejected_429"]),
        "underruns": sum(r["underruns"] for r in requests),
        "ttfa_p50_ms": _r(percentile(ttfa, 50)), "ttfa_p99_ms": _r(percentile(ttfa, 99)),
        "peak_sessions": max((n for _, n, _ in open_per_s), default=0),
        "scaled_in_after_ramp": run["settled"], "cut_short": run.get("cut_short", False), "bins": len(rows), "bins_judged_for_tracking": len(judged),
        "bins_in_scale_up": sum(r["scale_up"] for r in rows),
    }
    arrivals = [[round(t / run["time_scale"], 2), n] for t, n, _ in open_per_s]
    return {"summary": summary, **slowest_requests(rows, requests, run["bin_s"]), "run": run, "series": rows,
            "sessions_reference": {"what": "sessions open against reference seconds (time / time_scale), "
                                           "every 0.5 s of the run: the ramp the fleet simulation replays",
                                   "points": arrivals},
            "definitions": __doc__.split("Definitions (docs/tuning.md, \"The live ramp\"):\n\n")[1].strip()}


def plot_replicas(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["series"] if "running" in r]
    run = result["run"]
    t = [r["t_s"] / run["time_scale"] for r in rows]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True, height_ratios=[3, 2])
    ax = axes[0]
    ax.step(t, [r["running"] for r in rows], where="post", color="black", lw=1.6, label="running")
    ax.step(t, [r["running"] + r["starting"] for r in rows], where="post", color="tab:orange", lw=1,
            label="running + starting")
    ax.step(t, [r["draining"] for r in rows], where="post", color="tab:red", lw=1, label="draining")
    ax.step(t, [r["ideal"] for r in rows], where="post", color="tab:green", ls="--", lw=1.2, label="ideal")
    dec = [(r["t_s"] / run["time_scale"], r["policy"]["decision"]) for r in rows if r.get("policy")]
    if dec:
        ax.plot(*zip(*dec, strict=True), ".", color="tab:blue", ms=4, label="policy decision")
    ax.set_ylabel("synthesizer replicas")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"live ramp, {run['gpus']} logical GPUs, timed replicas (time scale {run['time_scale']:g}, "
                 f"replica start {run['replica_start_s']:g} s)", fontsize=10)
    ax2 = axes[1]
    ax2.plot(t, [r["sessions"] / run["sessions_per_replica_worth"] for r in rows], color="black",
             label="sessions, in replicas' worth")
    sig = [(r["t_s"] / run["time_scale"], r["policy"]["load_pct"]) for r in rows
           if r.get("policy") and r["policy"]["load_pct"] is not None]
    if sig:
        twin = ax2.twinx()
        twin.plot(*zip(*sig, strict=True), color="tab:purple", lw=0.8, label="policy load %")
        band = run["autoscaling_reference"]["load_band"]
        twin.axhspan(band["low_pct"], band["high_pct"], color="tab:purple", alpha=0.1)
        twin.set_ylabel("policy load % (band shaded)")
        twin.legend(fontsize=8, loc="upper right")
    ax2.set_ylabel("load")
    ax2.set_xlabel("reference time (s): run time / time scale")
    ax2.legend(fontsize=8, loc="upper left")
    for a in axes:
        a.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_first_audio(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, run = result["series"], result["run"]
    t = np.array([r["t_s"] / run["time_scale"] for r in rows])
    width = run["bin_s"] / run["time_scale"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, style in (("ttfa_p50_ms", "-"), ("ttfa_p99_ms", "-")):
        ax.plot(t, [np.nan if r[name] is None else r[name] for r in rows], style, marker=".", label=name[5:8])
    ax.axhline(run["calibration"]["slo_ttfa_p99_ms"], color="red", ls="--", lw=0.8, label="SLO (p99)")
    for r, x in zip(rows, t, strict=True):
        if r["scale_up"]:
            ax.axvspan(x, x + width, color="tab:orange", alpha=0.12, lw=0)
    rejected = [(x, r["rejected_429"]) for r, x in zip(rows, t, strict=True) if r["rejected_429"]]
    if rejected:
        twin = ax.twinx()
        twin.bar(*zip(*rejected, strict=True), width=width, color="tab:red", alpha=0.4, align="edge")
        twin.set_ylabel("429s per bin")
    ax.set_ylabel("first audio ms (per 10 s bin)")
    ax.set_xlabel("reference time (s); scale-up bins shaded")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _workload(run: dict[str, Any]) -> str:
    w = run.get("workload")
    if w is None:  # a run from before the workload was recorded: the synthetic mix
        return f"the synthetic mix {run.get('mix', 'unknown')}"
    if "lengths_of" in w:
        return (f"the lengths of the `{w['lengths_of']['name']}` workload (bench/workload.py), each sent as one "
                "made-up word the timed replica speaks for that long, in one voice")
    return f"the `{w['name']}` workload, mix {w.get('mix')}"


def _timing(cal: dict[str, Any]) -> str:
    if "time_factor" in cal:  # the one-factor calibration of runs before 2026-12-07's second ramp
        return f"times x{cal['time_factor']:g} of the H200 profile"
    return (f"H200 profile with the decode step x{cal['llm_factor']:g} ({cal['step_ms_alone']:g} ms alone), "
            f"token2wav x{cal['t2w_factor']:g}, a step {1 + cal['times']['llm_slowdown']:.2f}x slower while "
            "token2wav holds the GPU")


def markdown(result: dict[str, Any]) -> str:
    s, run = result["summary"], result["run"]
    cal = run["calibration"]
    lines = [f"# Live autoscaling ramp, {run['date']}: {run['gpus']} logical GPUs, timed replicas", "",
             f"Machine: {run['machine']}. Command: `{run['command']}` at {run['commit']}.",
             "", ("**No model ran**: every synthesizer replica slept the calibrated GPU times of "
             f"`bench/timed_fleet.py` (H100 reading `{cal['source']}`: {cal['sessions_per_replica']:g} sessions, "
             f"{cal['slo_streams']:g} streams in flight at the SLO; {_timing(cal)}) and a start of {run['replica_start_s']:g} s (the measured GPU cold start x "
             f"{run['start_scale']:g}). The ramp and Serve's delays ran at time scale {run['time_scale']:g}."), "",
             f"Sessions' answers: {_workload(run)}.", ""]
    if s.get("cut_short"):
        lines += ["**Cut short**: the ramp was interrupted before its end; these are the figures of the part that ran.",
                  ""]
    lines += ["| figure | value |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in s.items()]
    lines += _slowest_tables(result)
    lines += ["", "![replicas](replicas.png)", "", "![first audio](first-audio.png)", "",
              "Definitions:", "", result["definitions"], ""]
    return "\n".join(lines)


SLOWEST_COLUMNS = (("bin s", "{:g}"), ("sent s", "{:.2f}"), ("session", "{}"), ("scale-up", "{}"),
                   ("first audio ms", "{:.0f}"))
SLOWEST_LISTS = {"slowest_outside_scaleup": "outside scale-up bins (what `p99_ttfa_ms_outside_scaleup_max` is made of)",
                 "slowest": "of the whole run"}


def _slowest_tables(result: dict[str, Any]) -> list[str]:
    """The slowest requests outside scale-up and of the whole run (none in a result from before them)."""
    lines = []
    for key, which in SLOWEST_LISTS.items():
        rows = [([e["t_s"], e["submitted_s"], e["session"], "yes" if e["scale_up"] else "no", e["ttfa_ms"]],
                 e["stages_ms"]) for e in result.get(key) or []]
        if rows:
            lines += ["", f"The slowest requests {which}:", "", *request_table(SLOWEST_COLUMNS, rows)]
    if not lines:
        return []
    return ["", ("Columns: `bin s` the start of the request's bin and `sent s` when it was sent (run seconds from the "
                 "ramp's start, the series' `t_s`); `session` the session that sent it; `scale-up` whether its bin is "
                 "one; `first audio ms` the client's; then first audio by stage as the server reported it "
                 "(Server-Timing, ms; `proxy`: the client's first audio less the ingress's `first-audio`, i.e. Serve's "
                 "HTTP proxy and the connection; `replica-up`: how long the replica that served it had been ready, "
                 "no stage; `-`: not reported)."), *lines]


def write_outputs(result: dict[str, Any], results: Path, tag: str, latest: bool) -> Path:
    run = result["run"]
    folder = results / run_folder_name(run["date"], run["card"], "autoscale" + (f"-{tag}" if tag else ""))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "autoscale.json").write_text(json.dumps(result, indent=1) + "\n")
    plot_replicas(result, folder / "replicas.png")
    plot_first_audio(result, folder / "first-audio.png")
    (folder / "autoscale.md").write_text(markdown(result))
    write_run_record(folder, {
        "date": run["date"], "device": f"{run['card']} host, timed replicas (no GPU work ran)",
        "what": f"live autoscaling ramp, {run['gpus']} logical GPUs, time scale {run['time_scale']:g}",
        "main": "autoscale.md", "commit": run["commit"], "command": run["command"], "config": run["config"],
        "note": "written by bench/autoscale_live.py on " + dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")})
    if latest:
        out = {**result["summary"], "output": str(folder.relative_to(results)), "date": run["date"],
               "machine": run["machine"], "time_scale": run["time_scale"], "start_scale": run["start_scale"],
               "gpus": run["gpus"], "plots": [f"{folder.name}/{name}" for name in ("replicas.png", "first-audio.png",
                                                                              "sim-vs-live.png")],
               "series": result["series"]}
        (results / LATEST).write_text(json.dumps(out, indent=1) + "\n")
    return folder
