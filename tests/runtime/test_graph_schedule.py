"""cosyvoice_runtime.graph_schedule: which graphs a replica captures before it is ready and which in
the background after, and that a shape without its graph is routed to the eager path meanwhile.

The scheduling runs with fake owners (no torch, no GPU), synchronised with events. The routing
runs the real owners on the CPU (the LLM decode step, the flow's pass, the CV2 vocoder): a
deferred shape takes the eager path and is never captured on the serving thread; once captured
it takes its bucket. That an eager call gives what a replayed graph gives is a GPU check
(tests/deployments/test_runtime_load.py, gpu-marked).
"""
from __future__ import annotations

import threading

import pytest
import torch

from cosyvoice_runtime.graph_schedule import GraphSchedule, KeyGroup, is_first

GUARD_S = 60.0  # a guard against a hang, never a synchronisation


class FakeOwner:
    """Records the keys it captured; ``gate`` (optional) blocks each capture until set."""

    def __init__(self, keys, background_safe: bool = True, gate: threading.Event | None = None,
                 fail_on: tuple | None = None) -> None:
        self.keys = list(keys)
        self.background_safe = background_safe
        self.deferred = False
        self.captured: list[tuple] = []
        self.threads: list[str] = []
        self.gate = gate
        self.fail_on = fail_on
        self.entered = threading.Event()

    def graph_keys(self) -> list[tuple]:
        return self.keys

    def capture_key(self, key: tuple) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(GUARD_S)
        if key == self.fail_on:
            raise RuntimeError("capture failed")
        self.captured.append(key)
        self.threads.append(threading.current_thread().name)


def _grid(batches, lengths):
    return [(b, t) for b in batches for t in lengths]


def test_batch_one_is_captured_before_ready_and_the_rest_in_the_background_smallest_batches_first():
    llm = FakeOwner(_grid([1, 2, 4], [128, 256]))
    flow = FakeOwner(_grid([1, 2, 4], [64, 128]))
    stepper = FakeOwner(_grid([1, 2], [64]))  # the recomputed flow: nothing of it before ready
    schedule = GraphSchedule([("llm.decode", llm), ("flow.incremental", flow), ("flow.stepper", stepper)])
    assert [(t.owner, t.key) for t in schedule.first] == [
        ("llm.decode", (1, 128)), ("llm.decode", (1, 256)), ("flow.incremental", (1, 64)), ("flow.incremental", (1, 128))]
    # every owner with a graph left is deferred before anything is captured (the warm-up runs eagerly too)
    assert llm.deferred and flow.deferred and stepper.deferred
    assert schedule.capture_first() == 4
    assert llm.captured == [(1, 128), (1, 256)] and flow.captured == [(1, 64), (1, 128)] and stepper.captured == []
    assert schedule.snapshot()["captured"] == 4 and schedule.snapshot()["background"] == "pending"
    schedule.start_background()
    assert schedule.done.wait(GUARD_S)
    order = [(t.owner, t.key[0]) for t in schedule.rest]
    assert [b for _, b in order] == sorted(b for _, b in order)  # batch 1 (the stepper's), then 2, then 4
    assert order[0] == ("flow.stepper", 1)
    assert set(llm.threads[2:]) == {"graph-capture"} and set(llm.threads[:2]) == {threading.current_thread().name}
    snap = schedule.snapshot()
    every = len(llm.keys) + len(flow.keys) + len(stepper.keys)
    assert (snap["captured"], snap["total"], snap["captured_before_ready"], snap["background"]) == (every, every, 4,
                                                                                                   "done")
    assert sorted(llm.captured + flow.captured + stepper.captured) == sorted(llm.keys + flow.keys + stepper.keys)
    assert not (llm.deferred or flow.deferred or stepper.deferred)  # all there: first-use capture as before


def test_all_before_ready_and_owners_that_cannot_capture_beside_serving():
    compiled = FakeOwner(_grid([1, 2], [64]), background_safe=False)  # a torch.compile'd step
    plain = FakeOwner(_grid([1, 2], [64]))
    schedule = GraphSchedule([("llm.decode", compiled), ("flow.encoder", plain)])
    assert [t.key for t in schedule.rest] == [(2, 64)] and not compiled.deferred and plain.deferred
    everything = GraphSchedule([("llm.decode", FakeOwner(_grid([1, 2], [64]))), ("flow.encoder", FakeOwner([(4, 1)]))],
                               before_ready="all")
    assert everything.rest == [] and everything.done.is_set() and everything.snapshot()["background"] == "done"
    everything.start_background()  # nothing left: no thread
    assert everything.snapshot()["background"] == "done"
    with pytest.raises(ValueError, match="graphs_before_ready"):
        GraphSchedule([], before_ready="some")


def test_the_background_reports_running_while_a_graph_is_captured_and_can_be_stopped():
    gate = threading.Event()
    owner = FakeOwner(_grid([1, 2, 4], [64]), gate=gate)
    schedule = GraphSchedule([("flow.encoder", owner)])
    gate.set()
    schedule.capture_first()
    gate.clear()
    owner.entered.clear()
    schedule.start_background()
    assert owner.entered.wait(GUARD_S)  # the first background capture is in progress
    assert schedule.busy and schedule.snapshot()["background"] == "running"
    schedule.stop()
    gate.set()
    assert schedule.done.wait(GUARD_S)
    assert schedule.snapshot()["background"] == "stopped" and owner.captured == [(1, 64), (2, 64)]
    assert owner.deferred  # (4, 64) never came: it stays eager


def test_a_failed_background_capture_leaves_the_rest_eager_and_says_why():
    owner = FakeOwner(_grid([1, 2, 4], [64]), fail_on=(2, 64))
    schedule = GraphSchedule([("vocoder", owner)])
    schedule.capture_first()
    schedule.start_background()
    assert schedule.done.wait(GUARD_S)
    snap = schedule.snapshot()
    assert snap["background"] == "failed" and "capture failed" in snap["error"] and owner.deferred
    assert owner.captured == [(1, 64)] and not schedule.busy


def test_a_key_group_is_its_owners_keys_under_another_rule():
    vocoder = FakeOwner([(1, 58), (2, 58)])
    last = KeyGroup(vocoder, [(1, 90)])
    schedule = GraphSchedule([("vocoder", vocoder), ("vocoder.last_chunks", last)])
    assert [t.key for t in schedule.first] == [(1, 58)]
    assert [t.key for t in schedule.rest] == [(1, 90), (2, 58)] and vocoder.deferred
    assert is_first("vocoder", (1, 90)) and not is_first("vocoder.last_chunks", (1, 90))
    schedule.capture_first()
    schedule.start_background()
    assert schedule.done.wait(GUARD_S)
    assert vocoder.captured == [(1, 58), (1, 90), (2, 58)] and not vocoder.deferred


# -- the real owners' routing on the CPU -------------------------------------------------------
def test_a_deferred_flow_pass_runs_eagerly_without_capturing_and_uses_its_bucket_once_captured(monkeypatch):
    from cosyvoice_runtime.flow.stepper import FlowStepper
    from tests.runtime.test_flow_batch import FAMILIES, _flow

    solver = _flow(FAMILIES[0]).decoder  # the parity model's CFM solver
    padded = FlowStepper(solver, max_batch=2, max_frames=128, use_graphs=False)
    deferred = FlowStepper(solver, max_batch=2, max_frames=128, use_graphs=False)
    deferred.deferred = True
    got: list[tuple] = []
    real_get = deferred._get
    monkeypatch.setattr(deferred, "_get", lambda key: got.append(key) or real_get(key))
    torch.manual_seed(0)
    mu, cond, spks = torch.randn(80, 70), torch.zeros(80, 70), torch.randn(80)
    a = padded.new_row(mu, cond, spks, streaming=True)
    b = deferred.new_row(mu, cond, spks, streaming=True)
    padded.advance([a])
    deferred.advance([b])
    assert got == [] and deferred.num_graphs == 0 and deferred.eager_calls == 1  # eager, nothing captured
    torch.testing.assert_close(b.x, a.x)  # the exact-size eager pass is the padded bucket's
    deferred.capture_key((1, 128))
    deferred.advance([b])
    padded.advance([a])
    assert got == [(1, 128), (1, 128)] and deferred.num_graphs == 1  # the captured bucket serves it now
    torch.testing.assert_close(b.x, a.x)


def test_a_deferred_llm_step_runs_eagerly_beside_run_ahead_and_a_scratch_warm_up_writes_nothing_it_reads(monkeypatch):
    """The LLM runners with graphs "on" but every shape deferred (what a replica does until the
    background captured them): the engine's tokens are the static engine's, no graph is captured on
    the engine thread, each step counts as an eager call. A capture's warm-up (the background
    thread's, beside the engine) runs on scratch buffers: the ids a run-ahead step reads stay."""
    from cosyvoice_runtime.llm.engine import LLMEngine
    from cosyvoice_runtime.llm.sampling import SamplingParams
    from tests.runtime.test_llm_engine import prompts, run_engine, tiny_model

    model = tiny_model("cosyvoice2")
    xs = prompts([5, 9, 7], seed=3)
    reqs = {0: [(f"r{i}", x, 12, 12, SamplingParams(seed=i)) for i, x in enumerate(xs[:2])], 2: [("r2", xs[2], 9, 9,
                                                                                                    SamplingParams(seed=7))]}
    plain = LLMEngine(model, max_batch_size=4, max_seq_len=64, static_decode=True, run_ahead=True)
    deferred = LLMEngine(model, max_batch_size=4, max_seq_len=64, static_decode=True, run_ahead=True)
    for runner in (deferred.runner, deferred.prefill_runner):
        runner.use_graphs, runner.deferred = True, True
        monkeypatch.setattr(runner, "_graph", lambda *key: pytest.fail(f"captured {key} on the engine thread"))
    want, _, _ = run_engine(plain, reqs)
    got, _, _ = run_engine(deferred, reqs)
    assert got == want and all(len(t) for t in got.values())
    assert deferred.runner.eager_calls > 0 and deferred.prefill_runner.eager_calls > 0

    runner = plain.runner
    ids, logits = runner._ids.clone(), runner._logits.clone()
    scratch = (runner._pad_row.expand(2, -1).contiguous(), torch.zeros_like(runner._logits[:2]),
               torch.zeros_like(runner._ids[:2]))
    with torch.inference_mode():
        runner._body(2, runner.key_buckets[0], scratch)
    assert torch.equal(runner._ids, ids) and torch.equal(runner._logits, logits)
    assert scratch[1].abs().sum() > 0  # the warm-up ran, into the scratch


def test_the_snapshot_says_what_each_owner_took_before_ready():
    """Graphs and seconds per owner before ready (a fake clock: each capture of the flow's takes 2 s,
    the LLM's 0.5 s), so a cold start's graph phase says which owner to move to the background."""
    now = [0.0]
    cost = {"llm.decode": 0.5, "flow.incremental": 2.0}

    class Timed(FakeOwner):
        def __init__(self, name, keys):
            super().__init__(keys)
            self.name = name

        def capture_key(self, key):
            super().capture_key(key)
            now[0] += cost[self.name]

    llm, flow = Timed("llm.decode", _grid([1, 2], [128, 256])), Timed("flow.incremental", _grid([1], [64, 128, 256]))
    schedule = GraphSchedule([("llm.decode", llm), ("flow.incremental", flow)], clock=lambda: now[0])
    schedule.capture_first()
    snap = schedule.snapshot()
    assert snap["before_ready_s"] == 7.0
    assert snap["before_ready_by_owner"] == {"llm.decode": {"graphs": 2, "s": 1.0}, "flow.incremental": {"graphs": 3, "s": 6.0}}


def test_the_flow_graphs_of_long_calls_come_after_ready(tmp_path):
    """Flow graphs up to ``flow_graph_max_s`` (here 1024 frames), those of calls up to 512 frames
    before ready (batch 1, as ever) and longer calls' after, under ``<owner>.long``: the real owners'
    keys, split by each owner's own bucket of 512 frames (the incremental pass's cached frames in
    steps of 256, the encoder's tokens in steps of 32, the stepper's frames in steps of 64)."""
    from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs, flow_graph_owners
    from cosyvoice_runtime.graph_schedule import LONG
    from cosyvoice_runtime.model import load_model
    from cosyvoice_runtime.tiny_model import write_tiny_model

    flow = load_model(write_tiny_model(tmp_path / "model", family="cosyvoice2")).flow
    enable_flow_graphs(flow, max_batch=2, max_frames=1024, use_graphs=False, stepper=True, incremental=True)
    whole = dict(flow_graph_owners(flow))
    split = flow_graph_owners(flow, first_frames=500)
    names = [name for name, _ in split]
    assert names == ["flow.incremental", "flow.incremental" + LONG, "flow.encoder", "flow.encoder" + LONG,
                     "flow.stepper", "flow.stepper" + LONG]
    groups = dict(split)
    for name, owner in whole.items():  # every key once, in one group or the other
        keys = groups[name].graph_keys() + groups[name + LONG].graph_keys()
        assert sorted(keys) == sorted(owner.graph_keys())
    assert {k[2] for k in groups["flow.incremental"].graph_keys()} == {0, 256, 512}
    assert {k[2] for k in groups["flow.incremental" + LONG].graph_keys()} == {768, 1024}
    assert max(k[1] for k in groups["flow.encoder"].graph_keys()) == 256  # 500 frames: 250 tokens, in 32s
    assert min(k[1] for k in groups["flow.encoder" + LONG].graph_keys()) == 288
    schedule = GraphSchedule(split)
    first = {(t.owner, t.key) for t in schedule.first}
    assert first and all(not owner.endswith(LONG) and owner != "flow.stepper" and key[0] == 1 for owner, key in first)
    assert ("flow.incremental", (1, 64, 512)) in first and ("flow.incremental" + LONG, (1, 64, 768)) not in first
    assert flow.incremental.deferred and flow.graphed_encoder.deferred  # their long keys wait: eager meanwhile
    # after ready: every short key (smallest batches first) before any long call's
    kinds = [t.owner.endswith(LONG) for t in schedule.rest]
    assert kinds == sorted(kinds) and kinds[-1] and not kinds[0]
    assert [t.key[0] for t in schedule.rest if not t.owner.endswith(LONG)] == sorted(
        t.key[0] for t in schedule.rest if not t.owner.endswith(LONG))
    assert flow_graph_owners(flow, first_frames=4096) == list(whole.items())  # nothing longer: unsplit
