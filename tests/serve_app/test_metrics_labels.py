"""/metrics behind a load-balanced route: every series names the ingress replica that answered."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deployments.python_gc import GcPauses
from deployments.thread_load import GilWait
from serve_app.metrics import IngressMetrics


def _samples(text: bytes, name: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_counters_of_two_ingress_replicas_are_separate_series_that_never_go_back():
    a, b = IngressMetrics("ingress-a"), IngressMetrics("ingress-b")
    for _ in range(5):
        a.requests.labels("/v1/tts", "200").inc()
    b.requests.labels("/v1/tts", "200").inc()
    seen: dict[tuple, float] = {}
    for replica in (a, b, a, b):  # the load balancer alternates between replicas
        replica.requests.labels("/v1/tts", "200").inc()
        for labels, value in _samples(replica.render(None), "tts_http_requests_total").items():
            assert value >= seen.get(labels, 0.0), labels  # a counter series only grows
            seen[labels] = value
    assert {dict(k)["ingress_replica"]: v for k, v in seen.items()} == {"ingress-a": 7.0, "ingress-b": 3.0}


def test_every_series_carries_the_replica_labels():
    m = IngressMetrics("ingress-a")
    m.ttfa.observe(0.2)
    snapshot = {"replica_id": "synth-1", "engine": {"running": 2, "waiting": 1}, "streams_in_flight": 3,
                "utilization_pct": 96.0, "sm_activity_pct": None, "generated_tokens_total": 10}
    text = m.render(snapshot)
    families = list(text_string_to_metric_families(text.decode()))
    assert families and all(s.labels["ingress_replica"] == "ingress-a" for f in families for s in f.samples)
    assert _samples(text, "tts_streams_in_flight") == {(("ingress_replica", "ingress-a"), ("replica", "synth-1")): 3.0}
    assert _samples(text, "tts_sm_activity_pct") == {}  # absent where the GPU does not report it


def test_outside_a_replica_the_label_is_local():
    text = IngressMetrics().render(None)
    assert b'ingress_replica="local"' in text


def test_the_incremental_flow_figures_are_exported():
    snapshot = {"replica_id": "synth-1", "flow_cache_bytes": 3 * 2**30, "flow_cache_fallbacks_total": 2,
                "flow_prompt_prefix_hits_total": 40, "flow_prompt_prefix_misses_total": 3,
                "flow_prompt_cache_budget_bytes": 12 * 2**30}
    text = IngressMetrics("ingress-a").render(snapshot)
    labels = (("ingress_replica", "ingress-a"), ("replica", "synth-1"))
    assert _samples(text, "tts_flow_cache_bytes") == {labels: 3 * 2**30}
    assert _samples(text, "tts_flow_cache_fallbacks_total") == {labels: 2.0}
    assert _samples(text, "tts_flow_prompt_prefix_hits_total") == {labels: 40.0}
    assert _samples(text, "tts_flow_prompt_prefix_misses_total") == {labels: 3.0}
    assert _samples(text, "tts_flow_prompt_cache_budget_bytes") == {labels: 12 * 2**30}


def test_the_replicas_graph_and_flow_pass_counters_are_exported():
    """CUDA graphs captured and missed; the stepped token2wav's passes, the rows they carried and
    the rows in hand when they were picked."""
    counters = {"cuda_graph_captures_total": 412, "cuda_graph_misses_total": 9, "flow_passes_total": 30,
                "flow_rows_in_passes_total": 240, "flow_rows_ready_total": 300}
    text = IngressMetrics("ingress-a").render({"replica_id": "synth-1", **counters})
    labels = (("ingress_replica", "ingress-a"), ("replica", "synth-1"))
    for key, value in counters.items():
        assert _samples(text, f"tts_{key}") == {labels: float(value)}


def test_gc_pauses_of_the_synthesizer_and_the_ingress_are_exported():
    pauses = GcPauses(clock=iter([0.0, 0.04]).__next__)  # one 40 ms full collection at the ingress
    pauses.callback("start", {"generation": 2})
    pauses.callback("stop", {"generation": 2})
    synth_gc = GcPauses(clock=lambda: 0.0).snapshot()
    synth_gc["by_generation"]["1"].update(count=3, seconds=0.006, buckets=[2] + [3] * 7)
    text = IngressMetrics("ingress-a", gc_pauses=pauses).render({"replica_id": "synth-1", "gc": synth_gc})
    synth = (("generation", "1"), ("ingress_replica", "ingress-a"), ("replica", "synth-1"))
    assert _samples(text, "tts_gc_pause_seconds_count")[synth] == 3.0
    assert _samples(text, "tts_gc_pause_seconds_bucket")[(("generation", "1"), ("ingress_replica", "ingress-a"),
                                                          ("le", "0.001"), ("replica", "synth-1"))] == 2.0
    ingress = _samples(text, "tts_ingress_gc_pause_seconds_bucket")
    full = {dict(k)["le"]: v for k, v in ingress.items() if dict(k)["generation"] == "2"}
    assert full["0.025"] == 0.0 and full["0.05"] == 1.0 and full["+Inf"] == 1.0


def test_thread_cpu_and_gil_waits_of_the_synthesizer_are_exported():
    probe = GilWait(period_s=0.02, clock=iter([0.0, 0.035]).__next__, sleep=lambda s: None)
    probe.tick()  # woke 15 ms late
    snapshot = {"replica_id": "synth-1", "thread_cpu_seconds": {"engine-step": 12.5, "native": 3.0},
                "gil_wait": probe.snapshot()}
    text = IngressMetrics("ingress-a").render(snapshot)
    cpu = {dict(k)["thread"]: v for k, v in _samples(text, "tts_thread_cpu_seconds_total").items()}
    assert cpu == {"engine-step": 12.5, "native": 3.0}
    waits = {dict(k)["le"]: v for k, v in _samples(text, "tts_gil_wait_seconds_bucket").items()}
    assert waits["0.01"] == 0.0 and waits["0.025"] == 1.0
    assert list(_samples(text, "tts_gil_wait_seconds_sum").values()) == [pytest.approx(0.015)]
