"""A synthesizer replica's start (deployments.replica_start): the graphs left for after ready are
captured in the background once it serves, and /health and the stats say how far it got.

The runtime is the fakes' with a :class:`~cosyvoice_runtime.graph_schedule.GraphSchedule` over a
fake graph owner whose captures wait on an event: the test sees the background capture running,
lets it finish, and waits for its done event (never for a while).
"""
from __future__ import annotations

import dataclasses
import threading

from cosyvoice_runtime.graph_schedule import GraphSchedule
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments import fakes
from tests.runtime.test_graph_schedule import GUARD_S, FakeOwner


def test_the_background_capture_starts_at_ready_and_health_reports_its_progress():
    gate = threading.Event()
    owner = FakeOwner([(1, 64), (2, 64), (4, 64)], gate=gate)
    made: list[GraphSchedule] = []

    def factory(cfg, source, plan=None):
        schedule = GraphSchedule([("flow.incremental", owner)])
        gate.set()
        schedule.capture_first()  # as the assembler does, before the runtime is handed over
        gate.clear()
        owner.entered.clear()
        made.append(schedule)
        runtime = fakes.fake_synthesis_runtime(cfg, source, plan)
        return dataclasses.replace(runtime, graph_schedule=schedule, details={"model_load_s": 1.5})

    s = Synthesizer(SynthesizerConfig(warmup=True), runtime_factory=factory)
    schedule = made[0]
    assert owner.entered.wait(GUARD_S)  # started at ready, blocked on its first graph
    cold = s.health().detail["cold_start"]
    assert list(cold["phases_s"]) == ["runtime", "warmup", "settle"] and cold["model_load_s"] == 1.5
    assert cold["process_age_at_ready_s"] >= cold["constructor_s"] >= 0
    graphs = cold["cuda_graphs"]
    assert (graphs["captured"], graphs["total"], graphs["background"]) == (1, len(owner.keys), "running")
    assert not s.idle_trim._idle()  # no device-wide cache release while it captures
    gate.set()
    assert schedule.done.wait(GUARD_S)
    graphs = s.stats()["cold_start"]["cuda_graphs"]
    assert (graphs["captured"], graphs["total"], graphs["background"]) == (len(owner.keys), len(owner.keys), "done")
    assert s.idle_trim._idle() and not owner.deferred


def test_a_replica_without_graphs_reports_its_phases_and_no_graphs():
    s = Synthesizer(SynthesizerConfig(warmup=False), runtime_factory=fakes.fake_synthesis_runtime)
    cold = s.health().detail["cold_start"]
    assert list(cold["phases_s"]) == ["runtime", "settle"] and cold["cuda_graphs"] is None
