"""bench/leak_probe.py on the tiny model (CPU): the real synthesizer outside Serve, its
per-request bookkeeping read through the replica's public accessors, every entry back to zero
once the requests have ended."""
from __future__ import annotations

import json

import torch

from bench.leak_probe import main


def test_the_probe_samples_the_replicas_bookkeeping_and_it_returns_to_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the probe's one thread: not this session's
    out = tmp_path / "leak.json"
    assert main(["--requests", "4", "--concurrency", "2", "--every", "2", "--out", str(out)]) == 0
    samples = json.loads(out.read_text())["samples"]
    assert [s["requests"] for s in samples] == [0, 2, 4]
    last = samples[-1]
    for key in ("loop_mailboxes", "loop_pending_adds", "loop_live", "filters", "engine_requests", "scheduler_entries"):
        assert last[key] == 0, (key, last)
    assert last["rss_mib"] > 0 and last["compute_s"]  # compute seconds per kind of call
