"""Prometheus metrics of the ingress, rendered by ``GET /metrics``.

The ingress measures what a client sees (request counts/errors, time to first audio, RTF =
wall time / audio duration) in its own registry; at scrape time it adds the synthesizer
replica snapshot it gets through the handle (engine queue length and running batch, token2wav
and decode batch-size histograms, device utilisation and memory). With several synthesizer
replicas one scrape shows the replica that answered (labelled ``replica``); the cluster-wide
view is Ray's metrics endpoint, where every replica exports the ``tts_*`` series through
``ray.serve.metrics`` (docs/serving.md).
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from deployments import constants

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
                                "Chunk jobs held back for more urgent ones (deadline-first admission)")):
            c = CounterMetricFamily(name, doc, labels=["replica"])
            c.add_metric(replica, float(snap.get(key, 0)))
            yield c
        for name, key, doc in (("tts_device_utilization_pct", "utilization_pct", "Measured device utilisation"),
                               ("tts_gpu_memory_allocated_bytes", "gpu_memory_allocated_bytes", "GPU memory allocated"),
                               ("tts_gpu_memory_total_bytes", "gpu_memory_total_bytes", "GPU memory total")):
            if snap.get(key) is not None:
                g = GaugeMetricFamily(name, doc, labels=["replica"])
                g.add_metric(replica, float(snap[key]))
                yield g
        for name, key, doc in (("tts_token2wav_batch_size", "token2wav_batch_sizes", "Chunk jobs per flow+HiFT batch"),
                               ("tts_decode_batch_size", "step_batch_sizes", "Sequences per LLM decode step")):
            yield _histogram(name, doc, replica, snap.get(key) or {})


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


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tts_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.errors = Counter("tts_http_errors", "HTTP error responses by route and error type", ["route", "type"],
                              registry=self.registry)
        self.ttfa = Histogram("tts_time_to_first_audio_seconds", "Request arrival to first audio bytes",
                              buckets=constants.TTFA_BUCKETS_S, registry=self.registry)
        self.rtf = Histogram("tts_rtf", "Wall time / audio duration per request", buckets=constants.RTF_BUCKETS,
                             registry=self.registry)
        self.in_flight = Gauge("tts_requests_in_flight", "Synthesis requests being served", registry=self.registry)
        self._replica = _ReplicaSnapshotCollector()
        self.registry.register(self._replica)

    def render(self, replica_snapshot: dict[str, Any] | None) -> bytes:
        self._replica.snapshot = replica_snapshot
        return generate_latest(self.registry)
