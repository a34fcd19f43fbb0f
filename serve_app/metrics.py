"""Prometheus metrics of the ingress, rendered by ``GET /metrics``.

The ingress measures what a client sees (request counts/errors, time to first audio, RTF =
wall time / audio duration) in its own registry; at scrape time it adds the synthesizer
replica snapshot it gets through the handle (engine queue length and running batch, streams in
flight, token2wav and decode batch-size histograms, device utilisation, SM activity and memory).

Every series of one scrape carries ``ingress_replica`` (the Serve replica that answered), and the
synthesizer snapshot also ``replica`` (the synthesizer replica it came from). Behind a
load-balanced route consecutive scrapes may reach different ingress replicas; with the label
each replica's counters are separate series that only ever grow, never one series jumping
between replicas' values (sum them in queries). For a complete cluster-wide view scrape Ray's
metrics endpoint on every node (``--metrics-export-port``, 8080 in cluster.yaml and the KubeRay
manifest), where every replica exports the ``tts_*`` series through ``ray.serve.metrics`` with
Serve's own ``deployment`` / ``replica`` tags (docs/serving.md, Metrics).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deployments import constants
from deployments.python_gc import GcPauses

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _ReplicaSnapshotCollector:
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] | None = None

    def collect(self):
        snap = self.snapshot
        if not snap:
            return
        replica = [snap.get("replica_id", "unknown")]
        engine = snap.get("engine", {})
        for name, key, doc in (("tts_engine_running", "running", "Sequences holding a decode slot"),
                               ("tts_engine_queue_length", "waiting", "Sequences waiting for a decode slot"),
                               ("tts_engine_open_streams", "open_streams", "Requests streaming from the engine"),
                               ("tts_engine_max_running", "max_running", "Decode slots")):
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            g.add_metric(replica, float(engine.get(key, 0)))
            yield g
        for name, key, doc in (("tts_generated_tokens", "generated_tokens_total",
                                "Speech tokens generated (rate = tokens/s)"),
                               ("tts_stream_underruns", "underruns_total",
                                "Chunks made after the request's audio so far had run out (stutters, at the replica)"),
                               ("tts_token2wav_deadline_held", "deadline_held_total",
                                "Chunk jobs held back for more urgent ones (deadline-first admission)"),
                               ("tts_failed_requests", "failed_requests_total",
                                "Requests failed alone on the replica (non-finite logits or audio, an isolated error)"),
                               ("tts_token2wav_splits", "token2wav_splits_total",
                                "Flow + HiFT batches that raised and were retried in halves"),
                               ("tts_flow_cache_fallbacks", "flow_cache_fallbacks_total",
                                "Streams moved from the incremental flow to the recompute by token2wav.flow_cache_bytes"),
                               ("tts_flow_prompt_prefix_hits", "flow_prompt_prefix_hits_total",
                                "Streams whose voice had its prompt prefix kept when they started"),
                               ("tts_flow_prompt_prefix_misses", "flow_prompt_prefix_misses_total",
                                "Streams whose voice had no prompt prefix kept (it was solved and kept)"),
                               ("tts_flow_prompt_prefix_primed", "flow_prompt_prefix_primed_total",
                                "Prompt prefixes solved alone while the LLM made a new voice's first chunk"),
                               ("tts_flow_passes", "flow_passes_total",
                                "Flow passes the stepped token2wav ran (token2wav.scheduler steps)"),
                               ("tts_flow_rows_in_passes", "flow_rows_in_passes_total",
                                "Rows those passes carried (rows per pass = this / tts_flow_passes)"),
                               ("tts_flow_rows_ready", "flow_rows_ready_total",
                                "Rows in hand when those passes were picked (above rows carried: the scheduler split them)"),
                               ("tts_llm_give_way", "llm_give_way_total",
                                "Waits of the LLM step thread for a token2wav job already due (token2wav.give_way_ms)"),
                               ("tts_cuda_graph_captures", "cuda_graph_captures_total",
                                "CUDA graphs captured by the replica (growth after start-up: shapes first met under traffic)"),
                               ("tts_cuda_graph_misses", "cuda_graph_misses_total",
                                "Token2wav calls that ran eagerly on the GPU (shapes beyond the captured graphs)")):
            c = CounterMetricFamily(name, doc, labels=["replica"])
            c.add_metric(replica, float(snap.get(key, 0)))
            yield c
        for name, key, doc in (("tts_streams_in_flight", "streams_in_flight",
                                "Streams the replica is serving (the load policy's signal over slo_streams)"),
                               ("tts_device_utilization_pct", "utilization_pct",
                                "NVML GPU utilisation, rolling mean (dashboards only; compute busy share without NVML)"),
                               ("tts_sm_activity_pct", "sm_activity_pct", "SM activity, rolling mean (where the GPU reports it)"),
                               ("tts_gpu_memory_allocated_bytes", "gpu_memory_allocated_bytes", "GPU memory allocated"),
                               ("tts_gpu_memory_total_bytes", "gpu_memory_total_bytes", "GPU memory total"),
                               ("tts_flow_cache_bytes", "flow_cache_bytes",
                                "Bytes the open streams' incremental flow caches hold"),
                               ("tts_flow_prompt_cache_budget_bytes", "flow_prompt_cache_budget_bytes",
                                "Bytes the voice prompt prefixes may hold (cv2_prompt_cache_bytes resolved)")):
            if snap.get(key) is not None:
                g = GaugeMetricFamily(name, doc, labels=["replica"])
                g.add_metric(replica, float(snap[key]))
                yield g
        for name, key, doc in (("tts_token2wav_batch_size", "token2wav_batch_sizes", "Chunk jobs per flow+HiFT batch"),
                               ("tts_decode_batch_size", "step_batch_sizes", "Sequences per LLM decode step")):
            yield _histogram(name, doc, replica, snap.get(key) or {})
        if snap.get("thread_cpu_seconds"):
            c = CounterMetricFamily("tts_thread_cpu_seconds", "CPU seconds of the synthesizer replica's threads by "
                                    "thread (native: threads Python did not start)", labels=["replica", "thread"])
            for thread, seconds in sorted(snap["thread_cpu_seconds"].items()):
                c.add_metric([*replica, thread], float(seconds))
            yield c
        if snap.get("gil_wait"):
            h = HistogramMetricFamily("tts_gil_wait_seconds", "How late a probe thread of the synthesizer replica "
                                      "wakes from a short sleep: the wait to take the GIL back", labels=["replica"])
            _add_durations(h, replica, snap["gil_wait"])
            yield h
        if snap.get("gc"):
            yield gc_pause_histogram("tts_gc_pause_seconds", "Python garbage collector pauses of the synthesizer "
                                     "replica by generation (every thread stops)", ["replica"], replica, snap["gc"])


class _GcPauseCollector:
    """This process's collector pauses (the ingress replica's own)."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def collect(self):
        yield gc_pause_histogram("tts_ingress_gc_pause_seconds", "Python garbage collector pauses of the "
                                 "ingress replica by generation (its event loop stops)", [], [], self.pauses.snapshot())


def gc_pause_histogram(name: str, doc: str, label_names: list[str], labels: list[str],
                       gc_snapshot: dict) -> HistogramMetricFamily:
    """A :meth:`deployments.python_gc.GcPauses.snapshot` as one histogram with a ``generation`` label."""
    h = HistogramMetricFamily(name, doc, labels=[*label_names, "generation"])
    for gen, rec in gc_snapshot["by_generation"].items():
        _add_durations(h, [*labels, gen], rec)
    return h


def _add_durations(h: HistogramMetricFamily, labels: list[str], rec: dict) -> None:
    """One series of ``h`` from a :meth:`deployments.observability.Durations.snapshot`."""
    buckets = [(str(float(b)), n) for b, n in zip(rec["bounds"], rec["buckets"])]
    h.add_metric(labels, [*buckets, ("+Inf", rec["count"])], sum_value=rec["seconds"])


def _histogram(name: str, doc: str, labels: list[str], counts: dict) -> HistogramMetricFamily:
    counts = {int(k): int(v) for k, v in counts.items()}
    buckets, running = [], 0
    for bound in constants.BATCH_SIZE_BUCKETS:
        running = sum(v for k, v in counts.items() if k <= bound)
        buckets.append((str(float(bound)), running))
    total = sum(counts.values())
    buckets.append(("+Inf", total))
    h = HistogramMetricFamily(name, doc, labels=["replica"])
    h.add_metric(labels, buckets, sum_value=float(sum(k * v for k, v in counts.items())))
    return h


def ingress_replica_id() -> str:
    """This ingress replica's Serve id ("local" outside a replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a replica (unit tests, in-process apps)
        return "local"


class _Labelled:
    """A registry view adding constant labels to every sample (``generate_latest`` needs ``collect``)."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner, self.labels = inner, labels

    def collect(self):
        for family in self.inner.collect():  # fresh objects per call: safe to relabel
            family.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield family


class IngressMetrics:
    """The ingress's registry. ``replica_id``: the ``ingress_replica`` label (None: asked of Serve)."""

    def __init__(self, replica_id: str | None = None, gc_pauses: GcPauses | None = None) -> None:
        self._replica_id = replica_id
        self.registry = CollectorRegistry()
        if gc_pauses is not None:
            self.registry.register(_GcPauseCollector(gc_pauses))
        self.requests = Counter("tts_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.errors = Counter("tts_http_errors", "HTTP error responses by route and error type", ["route", "type"],
                              registry=self.registry)
        self.ttfa = Histogram("tts_time_to_first_audio_seconds", "Request arrival to first audio bytes",
                              buckets=constants.TTFA_BUCKETS_S, registry=self.registry)
        self.stages = Histogram("tts_first_audio_stage_seconds",
                                "Streamed requests' time to first audio by stage (serve_app.stage_timing)", ["stage"],
                                buckets=constants.STAGE_BUCKETS_S, registry=self.registry)
        self.rtf = Histogram("tts_rtf", "Wall time / audio duration per request", buckets=constants.RTF_BUCKETS,
                             registry=self.registry)
        self.served = Histogram("tts_served_audio_seconds",
                                "Audio seconds served per synthesis call (a request; a WebSocket segment or turn)",
                                buckets=constants.SERVED_AUDIO_BUCKETS_S, registry=self.registry)
        self.failovers = Counter("tts_stream_failovers", "Streams whose synthesizer replica died: continued on "
                                 "another replica, or lost (serve_app/failover.py)", ["outcome"],
                                 registry=self.registry)
        self.in_flight = Gauge("tts_requests_in_flight", "Synthesis requests being served", registry=self.registry)
        self._replica = _ReplicaSnapshotCollector()
        self.registry.register(self._replica)

    def render(self, replica_snapshot: dict[str, Any] | None) -> bytes:
        self._replica.snapshot = replica_snapshot
        if self._replica_id is None:
            self._replica_id = ingress_replica_id()
        return generate_latest(_Labelled(self.registry, {"ingress_replica": self._replica_id}))
