"""Report of ``bench/capacity.py``: a markdown page with the capacity per mode, every probe's
figures, and plots of first audio, underruns and GPU utilisation against the offered load. Its
title names the workload (``bench/workload.py``); a report written before workloads had names
ran the synthetic one."""
from __future__ import annotations

import json
import math
from pathlib import Path

from bench.report import latest_for

COLUMNS = (("load", "load", "{}"), ("requests", "requests", "{}"), ("ttfa_p50_ms", "first audio p50 ms", "{:.0f}"),
           ("ttfa_p95_ms", "p95 ms", "{:.0f}"), ("ttfa_p99_ms", "p99 ms", "{:.0f}"),
           ("cold_voice_requests", "cold voices", "{}"), ("ttfa_cold_p95_ms", "cold p95 ms", "{:.0f}"),
           ("drawn_s_p50", "drawn s p50", "{:.1f}"), ("served_s_p50", "served s p50", "{:.1f}"),
           ("underruns", "underruns", "{}"),
           ("throughput_x_realtime", "x real time", "{:.1f}"), ("gpu_util_pct", "GPU util %", "{:.0f}"),
           ("decode_step_ms_p50", "decode step p50 ms", "{:.1f}"), ("t2w_batch_ms_p50", "t2w batch p50 ms", "{:.1f}"),
           ("t2w_busy_fraction", "t2w busy", "{:.2f}"), ("flow_passes", "flow passes", "{:.0f}"),
           ("flow_rows_per_pass", "rows per pass", "{:.1f}"), ("flow_rows_ready_per_pass", "rows ready per pass", "{:.1f}"),
           ("flow_frames_per_audio_s", "flow frames per audio s", "{:.0f}"),
           ("prompt_prefix_hit_pct", "prompt prefix hit %", "{:.1f}"), ("prompt_cache_gib", "prompt cache GiB", "{:.1f}"),
           ("graph_captures", "graphs captured", "{:.0f}"), ("graph_misses", "graph misses", "{:.0f}"), ("gc_pause_ms", "GC pause ms", "{:.0f}"),
           ("gc_slow", "GC pauses > 10 ms", "{:.0f}"), ("ingress_gc_pause_ms", "ingress GC pause ms", "{:.0f}"),
           ("gil_wait_mean_ms", "GIL wait mean ms", "{:.2f}"), ("gil_slow", "GIL waits > 10 ms", "{:.0f}"),
           ("meets_slo", "meets SLO", "{}"), ("meets_slo_p95", "meets p95", "{}"), ("aborted", "stopped", "{}"))


def workload_name(w: dict) -> str:
    return w.get("name", "synthetic")  # written before workloads were named: the original one


def describe_workload(w: dict) -> str:
    """What the requests were: text, lengths, voices, and the served length against the drawn one."""
    if workload_name(w) == "synthetic":
        text = (f"Workload **synthetic**: utterance mix {w['mix']} of audio, each request one made-up word whose "
                f"length the random-weight model turns into audio; one registered voice for every session "
                f"(prompt {w['prompt_s']:.2f} s).")
    elif "lengths_of" in w:
        text = (f"Workload **{w['name']}**: the drawn lengths of the `{w['lengths_of']['name']}` workload as "
                f"{w['text']['source']}; one voice for every session, no cold voice.")
    else:
        t, v = w["text"], w["voices"]
        langs = ", ".join(f"{pct:g} % {lang}" for lang, pct in t["languages_pct"].items())
        per = ", ".join(f"{pct:g} % {k}" for k, pct in t["sentences_per_request_pct"].items())
        text = (f"Workload **production**: {t['source']} ({', '.join(f'{n} {lang}' for lang, n in t['corpus_sentences'].items())} "
                f"sentences; normalisation rewrites "
                f"{', '.join(f'{pct:g} % of {lang}' for lang, pct in t['changed_by_normalisation_pct'].items())}); "
                f"{langs}; sentences per request {per}; drawn length: {t['drawn_length']}. Voices: "
                f"{v['count']} registered before the load, prompts {v['prompt_s'][0]:g}-{v['prompt_s'][1]:g} s, "
                f"{v['assignment']}; {100 * w['cold_voice_share']:g} % of requests use a voice registered just "
                "before them (cold: no replica saw it; its registration is not in first audio).")
    lengths = w.get("served_length")
    if lengths:
        d, sv, r = lengths["drawn_s"], lengths["served_s"], lengths["served_over_drawn"]
        text += (f" Served against drawn length over {lengths['requests']} requests: p50 {sv['p50']:g} s served vs "
                 f"{d['p50']:g} s drawn, p95 {sv['p95']:g} vs {d['p95']:g} s; served / drawn p5 {r['p5']:g}, "
                 f"p50 {r['p50']:g}, p95 {r['p95']:g}.")
        if not 0.67 <= r["p50"] <= 1.5:  # random weights rarely end an utterance: they speak to the length limit
            text += (" **The served length is not the text's**: first audio and capacity here are of longer "
                     "(or shorter) answers than the text means.")
    return text


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        text = fmt.format(value)
    except (ValueError, TypeError):
        text = str(value)
    return text.splitlines()[0][:100].replace("|", "/")  # a table cell: one short line


def markdown(doc: dict, plots: list[str]) -> str:
    w = doc["workload"]
    unit = {"sessions": "sessions", "loads": "sessions", "rate": "requests/s", "one-session": "session"}
    intro = (f"SLO: every request succeeds, p99 time to first audio <= {w['slo_ttfa_p99_ms']:.0f} ms, "
             f"{w['slo_underruns']} underruns (a client that plays from the first chunk with no extra buffer)"
             + (f"; the Poisson rate is searched again for p95 <= {w['slo_ttfa_p95_ms']:.0f} ms (`meets p95`)"
                if w.get("slo_ttfa_p95_ms") is not None else "") + ". "
             + describe_workload(w) + f" Seed {w['seed']}; each probe judges the requests submitted in {w['window_s']:.0f} s of steady load "
             f"(sessions start over ~{w['ramp_s']:.0f} s, exponential gaps) and stops at the first failed or "
             f"underrun request."
             + (f" The one-session probe (first audio at one stream) sends its requests back to back for "
                f"{w['c1_window_s']:.0f} s, without waiting out their playback." if "c1_window_s" in w else "")
             + f" Model: {w.get('model', 'not recorded')}."
             + (f" HTTP path: {w['http_proxy']}." if w.get("http_proxy") else "")
             + "".join(f" **Note**: {note}." for note in w.get("notes", []))
             + (f" **No model ran**: the synthesizer slept the GPU times of `bench/timed_runtime.py` (profile "
                f"{w['timing_model']}); what this measures is the serving layer on this machine, not GPU capacity."
                if w.get("timing_model") else
                " Random weights: the audio is noise; the work per token is the architecture's."
                if w.get("random_weights", True) else "")
             + (" `t2w batch` / `t2w busy`: the simulated token2wav lane's batches as its thread timed them (the "
                "share of the window spent in them); with the stepped scheduler only the finishing vocoder batches."
                if w["level"] == "replica" else "")  # reports of the removed replica simulation, re-rendered
             + " `graph misses`: token2wav calls that ran eagerly on the GPU because no captured CUDA graph holds "
               "their shape (calls longer than `flow_graph_max_s`, a vocoder length not captured yet)."
             + " `rows ready per pass`: the rows the stepped token2wav had in hand when it picked each pass; "
               "above `rows per pass`, it split them (by urgency, kind or length) rather than having few.")
    lines = [(f"# Streaming capacity at the SLO: {w['level']} level, {w['family']}, {doc['device']}, {doc['date']}, "
             f"{workload_name(w)} workload"), "",
             intro, "", "| mode | search | capacity |", "|---|---|---|"]
    for s in doc["searches"]:
        if s["kind"] != "one-session":
            cap = "failed" if s.get("error") else _unfinished(s) if s["capacity"] is None \
                else f"{s['capacity']} {unit[s['kind']]}"
            if s.get("at_ceiling"):  # every probe up to the ceiling met the SLO: a lower bound
                cap = f">= {cap} (the search's ceiling)"
            if s.get("capacity_p95") is not None:
                cap += f"; p95 criterion: {s['capacity_p95']} {unit[s['kind']]}"
            lines.append(f"| {s['mode']} | {s['kind']} | {cap} |")
    for s in doc["searches"]:
        lines += ["", f"## {s['mode']}: {s['kind']} (load in {unit[s['kind']]})", ""]
        if s.get("error"):
            lines += [f"**Search failed, no capacity claimed:** {s['error']}", ""]
        lines += ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for p in sorted(s["probes"], key=lambda p: p["load"]):
            lines.append("| " + " | ".join(_cell(p.get(k), f) for k, _, f in COLUMNS) + " |")
        lines += _stage_table(s["probes"])
        lines += _slowest_table(s["probes"])
        lines += _thread_table(s["probes"])
    lines += [""] + [f"![{name}]({name})" for name in plots]
    return "\n".join(lines) + "\n"


def _unfinished(search: dict) -> str:
    """A search cut before it converged (a device call's time limit) claims no capacity, but its
    probes bracket it: the most load met below the least load missed (CosyVoice3, H100
    2026-12-06: 27 met, 30 missed, cut before 28). Fixed loads (``--loads``) are not a search."""
    if search["kind"] == "loads":
        return "-"
    met = [p["load"] for p in search["probes"] if p.get("meets_slo")]
    missed = [p["load"] for p in search["probes"] if not p.get("meets_slo")]
    if not met or not missed or max(met) >= min(missed):
        return "-"
    return f"unfinished: {max(met):g} met, {min(missed):g} missed"


def _stage_table(probes: list[dict]) -> list[str]:
    """First audio by stage (the service's Server-Timing header, serve level), p50 / p99 ms per probe."""
    names = list(dict.fromkeys(name for p in probes for name in p.get("stages_ms") or {}))
    if not names:
        return []
    lines = ["", ("First audio by stage as the service reported it (Server-Timing; proxy: the client's time to first "
             "audio less the ingress's, Serve's HTTP proxy and the connection; p50 / p99 ms):"), "",
             "| load | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for p in sorted(probes, key=lambda p: p["load"]):
        cells = [" / ".join(f"{v:.0f}" for v in p["stages_ms"][n]) if n in p.get("stages_ms", {}) else "-"
                 for n in names]
        lines.append(f"| {p['load']} | " + " | ".join(cells) + " |")
    return lines


def _slowest_table(probes: list[dict]) -> list[str]:
    """Each probe's slowest requests (``slowest``), with their stages: what a p99 is made of."""
    rows = [([p["load"], r["ttfa_ms"], "yes" if r["cold_voice"] else "no", r.get("prompt_s"), r.get("drawn_s")],
             r["stages_ms"]) for p in sorted(probes, key=lambda p: p["load"]) for r in p.get("slowest") or []]
    if not rows:
        return []
    columns = (("load", "{}"), ("first audio ms", "{:.0f}"), ("cold", "{}"), ("prompt s", "{:.1f}"), ("drawn s", "{:.1f}"))
    return ["", ("The slowest requests of each probe (first audio; cold: a voice no replica had seen; stages in ms; "
                 "`replica-up`: how long the replica had been ready, no stage):"), "",
            *request_table(columns, rows)]


def request_table(columns: tuple[tuple[str, str], ...], rows: list[tuple[list, dict[str, float]]]) -> list[str]:
    """A markdown table of single requests (the slowest of a probe or of a live ramp).

    Args:
        columns: (header, format) of the leading columns.
        rows: each request's values of ``columns`` and its first-audio stages in ms; every stage
            any request has gets a column, in the order they first appear (``-`` where one lacks it).
    """
    names = list(dict.fromkeys(n for _, stages in rows for n in stages))
    lines = ["| " + " | ".join([h for h, _ in columns] + names) + " |", "|" + "---|" * (len(columns) + len(names))]
    for values, stages in rows:
        cells = [_cell(v, fmt) for v, (_, fmt) in zip(values, columns, strict=True)]
        lines.append("| " + " | ".join(cells + [_cell(stages.get(n), "{:.0f}") for n in names]) + " |")
    return lines


def _thread_table(probes: list[dict], top: int = 6) -> list[str]:
    """CPU cores busy by thread of the replica (or of this process below the serve level), per
    probe: the busiest ``top`` thread groups of the heaviest probe, then the rest summed."""
    busy = [p for p in probes if p.get("threads_busy")]
    if not busy:
        return []
    heaviest = max(busy, key=lambda p: p["load"])["threads_busy"]
    names = sorted(heaviest, key=lambda k: -heaviest[k])[:top]
    lines = ["", ("CPU cores busy by thread over the probe (`native`: threads Python did not start: Ray's, CUDA's, "
                  "OpenMP's):"), "", "| load | " + " | ".join(names) + " | others |", "|" + "---|" * (len(names) + 2)]
    for p in sorted(busy, key=lambda p: p["load"]):
        cells = [f"{p['threads_busy'].get(n, 0.0):.2f}" for n in names]
        rest = sum(v for k, v in p["threads_busy"].items() if k not in names)
        lines.append(f"| {p['load']} | " + " | ".join(cells) + f" | {rest:.2f} |")
    return lines


def plot(out: Path, stem: str, doc: dict) -> list[str]:
    """First audio p50/p99 and underruns against load (one figure), GPU utilisation (another)."""
    import matplotlib  # only when a report is drawn: the CPU tests of the search need none

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # sessions searched or at fixed loads (--loads) share the sessions axis
    axis = {"sessions": "sessions", "loads": "sessions", "rate": "rate"}
    searches = [s for s in doc["searches"] if s["kind"] in axis and s["probes"]]
    if not searches:
        return []
    names = []
    fig, axes = plt.subplots(1, len({axis[s["kind"]] for s in searches}), figsize=(11, 4.2), squeeze=False)
    for ax, kind in zip(axes[0], sorted({axis[s["kind"]] for s in searches}, reverse=True)):
        twin = ax.twinx()
        for s in (s for s in searches if axis[s["kind"]] == kind):
            ps = sorted(s["probes"], key=lambda p: p["load"])
            xs = [p["load"] for p in ps]
            ax.plot(xs, [p["ttfa_p50_ms"] for p in ps], marker="o", label=f"{s['mode']} p50")
            if all(p.get("ttfa_p95_ms") is not None for p in ps):
                ax.plot(xs, [p["ttfa_p95_ms"] for p in ps], marker="+", linestyle="-.", label=f"{s['mode']} p95")
            ax.plot(xs, [p["ttfa_p99_ms"] for p in ps], marker="x", linestyle="--", label=f"{s['mode']} p99")
            twin.bar(xs, [p["underruns"] for p in ps], alpha=0.25, width=[max(0.3, x * 0.08) for x in xs])
        ax.axhline(doc["workload"]["slo_ttfa_p99_ms"], color="red", linestyle=":", label="SLO p99")
        if kind == "rate" and doc["workload"].get("slo_ttfa_p95_ms") is not None:
            ax.axhline(doc["workload"]["slo_ttfa_p95_ms"], color="orange", linestyle=":", label="target p95")
        ax.set_xlabel("sessions" if kind == "sessions" else "Poisson arrivals (requests/s)")
        ax.set_ylabel("time to first audio (ms)")
        twin.set_ylabel("underruns (bars)")
        twin.set_ylim(bottom=0)
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    names.append(_save(plt, fig, out / f"{stem}-latency.png"))
    util = [s for s in searches if axis[s["kind"]] == "sessions" and any(p.get("gpu_util_pct") for p in s["probes"])]
    # the one-session probe extends the sweep down to one stream
    single = {s["mode"]: s["probes"] for s in doc["searches"] if s["kind"] == "one-session"}
    if util:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        ax.axhspan(70, 80, color="green", alpha=0.08, label="the load policy's target band (70-80 %)")
        for s in util:
            ps = sorted((p for p in s["probes"] + single.get(s["mode"], []) if p.get("gpu_util_pct") is not None),
                        key=lambda p: p["load"])
            ax.plot([p["load"] for p in ps], [p["gpu_util_pct"] for p in ps], marker="o", label=f"{s['mode']} nvidia-smi")
            if not any(p.get("flow_passes") for p in ps):  # stepped: the lane's batches time the vocoder only
                ax.plot([p["load"] for p in ps], [100 * (p.get("t2w_busy_fraction") or 0) for p in ps], marker="x",
                        linestyle="--", label=f"{s['mode']} token2wav lane busy")
            # the autoscaler's signal: in flight / in flight at the SLO capacity (slo_streams)
            full = next((p.get("streams_in_flight_mean") for p in ps if p["load"] == s.get("capacity")), None)
            if full and all(p.get("streams_in_flight_mean") is not None for p in ps):
                ax.plot([p["load"] for p in ps], [100 * p["streams_in_flight_mean"] / full for p in ps],
                        marker="s", linestyle=":", label=f"{s['mode']} load signal (in flight / in flight at capacity)")
        ax.set_xlabel("sessions")
        ax.set_ylabel("percent")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        names.append(_save(plt, fig, out / f"{stem}-gpu.png"))
    return names


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def write_report(out: Path, stem: str, doc: dict) -> Path:
    path = out / f"{stem}.md"
    path.write_text(markdown(doc, plot(out, stem, doc)))
    return path


def update_latest(run) -> dict:
    """Add a :class:`bench.capacity.Run`'s capacity figures (the best mode's) to the family's
    ``latest.json`` (a ``--timed`` run's are not GPU figures: returned, not written): sessions at
    the SLO, the Poisson rate at it and at p95 first audio (``slo_rate_rps_p95``), each under the
    level's key with its own device, date and workload name (``<key>_workload``), the throughput and
    streams in flight at the sessions' capacity, and the run's ``workload`` object (text, voices,
    cold-voice share, served against drawn length). The unsuffixed keys (``slo_streams``,
    ``slo_rate_rps``, ``ttfb_p50_ms_c1``, ...) are the synth level's: one replica's own
    deployments in one process; the Serve level's are ``_serve``. The ``_sim`` keys are the
    removed replica simulation's (``--level replica``), kept as the record of what it measured.
    The levels (and the throughput benchmark, whose ``device`` and ``date`` the file's top level
    keeps) may come from different machines and days."""
    path, prefix = latest_for(run.out, run.args.family)
    latest = json.loads(path.read_text()) if path.exists() and not run.args.timed else {}
    level = run.args.level
    suffix = {"serve": "_serve", "synth": ""}[level]
    update: dict = {}
    stale: list[str] = []
    for kind, name, field in (("sessions", "slo_streams", "capacity"), ("rate", "slo_rate_rps", "capacity"),
                              ("rate", "slo_rate_rps_p95", "capacity_p95")):
        found = [s for s in run.searches if s["kind"] == kind and s.get(field) is not None]
        if not found:
            continue
        best = max(found, key=lambda s: s[field])
        key = name + suffix
        update.update({key: best[field], f"{key}_mode": best["mode"], f"{key}_device": run.device,
                       f"{key}_date": run.date, f"{key}_workload": run.work.source.name,
                       f"capacity_report_{level}": f"{prefix}{run.stem}.md", f"{key}_lower_bound": bool(best.get("at_ceiling"))})
        # A hand-written note explains the value it sat beside; a new value makes it stale (the
        # late H100 lease's 62 kept the 52's note and throughput, 2026-12-05).
        stale.append(f"{key}_note")
        if kind == "sessions":
            at_cap = next((p for p in best["probes"] if p["load"] == best["capacity"]), {})
            update["throughput_x_realtime_at_slo" + suffix] = at_cap.get("throughput_x_realtime")
            update["slo_streams_in_flight" + suffix] = at_cap.get("streams_in_flight_mean")
            stale.append("slo_streams_in_flight" + suffix + "_note")
    if not update:
        return latest
    modes = [update.get(f"slo_streams{suffix}_mode"), update.get(f"slo_rate_rps{suffix}_mode")]
    one = [p for s in run.searches if s["kind"] != "rate" and s["mode"] in modes for p in s["probes"] if p["load"] == 1]
    update["ttfb_p50_ms_c1" + suffix] = one[0]["ttfa_p50_ms"] if one else None
    stale.append("ttfb_p50_ms_c1" + suffix + "_note")
    for key in stale:
        latest.pop(key, None)
    update["workload"] = run.workload()
    latest.update(update)
    if not run.args.timed:
        path.write_text(json.dumps(latest, indent=1, default=str))
    return latest
