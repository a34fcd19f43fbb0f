"""Streaming metrics from chunk arrival times: time to first audio, RTF, underruns.

Pure functions over :class:`RequestTrace` records so that the same arithmetic serves the GPU
benchmark, the HTTP load generator and the unit tests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deployments.deadlines import Playback


@dataclass
class RequestTrace:
    """When a request was sent and when each of its audio chunks arrived (seconds, one clock)."""

    submitted_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_samples: list[int] = field(default_factory=list)
    sample_rate: int = 24000
    error: str | None = None
    stages_ms: dict[str, float] = field(default_factory=dict)  # first audio by stage, as the server reported it
    drawn_s: float | None = None  # the audio length the request meant (capacity workloads: served vs drawn)
    cold_voice: bool = False  # its voice was registered just before it (no replica had seen it)
    prompt_s: float | None = None  # its voice's prompt length (a workload that draws voices)

    def add_chunk(self, t_s: float, n_samples: int) -> None:
        self.chunk_times_s.append(t_s)
        self.chunk_samples.append(int(n_samples))

    @property
    def audio_s(self) -> float:
        return sum(self.chunk_samples) / self.sample_rate

    @property
    def ttfa_s(self) -> float:
        return self.chunk_times_s[0] - self.submitted_s

    @property
    def latency_s(self) -> float:
        return self.chunk_times_s[-1] - self.submitted_s

    @property
    def rtf(self) -> float:
        """Wall time to produce the whole utterance over its duration (< 1 is faster than real time)."""
        return self.latency_s / self.audio_s

    def underruns(self) -> int:
        """Chunks that arrived after everything before them had finished playing.

        Playback starts when the first chunk arrives; after an underrun it resumes when the late
        chunk arrives (the player re-buffers), so one stall is counted once.
        """
        return self._playback()[0]

    def playback_deadline_s(self) -> float:
        """When the audio received so far finishes playing (the next chunk's deadline); the
        submission time before the first chunk (first audio is always due)."""
        return self._playback()[1]

    def _playback(self) -> tuple[int, float]:
        """(underruns, end of playback) of the chunks so far, under the model of :meth:`underruns`."""
        play = Playback(self.submitted_s)
        for t, n in zip(self.chunk_times_s, self.chunk_samples):
            play.add(t, n / self.sample_rate)
        return play.underruns, play.deadline_s()


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def summarize(traces: list[RequestTrace], wall_s: float) -> dict:
    """Aggregate figures of one run (all requests at one concurrency)."""
    ok = [t for t in traces if t.error is None and t.chunk_times_s]
    ttfa_ms = [t.ttfa_s * 1000 for t in ok]
    audio = sum(t.audio_s for t in ok)
    return {
        "requests": len(traces),
        "errors": len(traces) - len(ok),
        "ttfa_p50_ms": percentile(ttfa_ms, 50),
        "ttfa_p90_ms": percentile(ttfa_ms, 90),
        "ttfa_p95_ms": percentile(ttfa_ms, 95),
        "ttfa_p99_ms": percentile(ttfa_ms, 99),
        "rtf_p50": percentile([t.rtf for t in ok], 50),
        "audio_s": audio,
        "wall_s": wall_s,
        "throughput_x_realtime": audio / wall_s if wall_s > 0 else float("nan"),
        "underruns": sum(t.underruns() for t in ok),
        "requests_with_underrun": sum(1 for t in ok if t.underruns()),
    }
