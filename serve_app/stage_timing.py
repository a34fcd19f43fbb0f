"""Where a streamed request's time to first audio went, as a ``Server-Timing`` header.

The ingress fetches the first chunk before it sends headers (so that early errors keep their
status code), which means the whole path to the first audio is known when the headers leave:

* ``frontend``: the frontend's ``prepare`` call (text normalisation, tokens, the voice prompt),
  handle hops included;
* ``llm-first-token``: from the synthesizer receiving the request to its first speech token
  (queueing for a KV slot, the prefill);
* ``llm-first-chunk``: then to the tokens the first chunk needs (decode steps);
* ``token2wav``: then to the first chunk's audio (flow + vocoder, waiting for a batch or a pass);
  with the stepped token2wav also in three parts (:data:`TOKEN2WAV_PARTS`): ``t2w-queue`` until the
  driver thread took the job in, ``t2w-solve`` its encoder, passes and vocoder until the audio was
  back on the host (stamped on the event loop), ``t2w-return`` until the request's coroutine ran
  with it (a busy loop or a held GIL shows here);
* ``handoff``: the synthesizer call as the ingress saw it, less the synthesizer's own time to
  first audio: Ray's hops into and out of the replica and the event loops' delays;
* ``first-audio``: the ingress's whole time to first audio (request arrival to first chunk).

Not a stage: ``replica-up``, how long the synthesizer replica that served the request had been
ready when the request reached it (a slow first audio on a replica that just started is a
scale-up's, not a load's).

Browsers show it in their developer tools; the capacity tool (``bench/capacity.py --level
serve``) aggregates it per stage. The synthesizer's stage times are its own clock's
(milliseconds after it received the request, ``AudioChunk.timing``), so only differences
within one process are taken.
"""
from __future__ import annotations

from deployments.protocol import FIRST_AUDIO_STAGES, REPLICA_UP, TOKEN2WAV_MARKS, AudioChunk

STAGES = ("frontend", "llm-first-token", "llm-first-chunk", "token2wav", "handoff", "first-audio")
TOKEN2WAV_PARTS = ("t2w-queue", "t2w-solve", "t2w-return")  # token2wav's parts, stepped scheduler only
NOT_STAGES = ("replica-up",)  # entries that are no part of the first audio (the module docstring)


def first_audio_stages(started: float, prepared: float, first_at: float, first: AudioChunk | None) -> dict[str, float]:
    """Stage durations in ms (a subset of :data:`STAGES` and :data:`TOKEN2WAV_PARTS`; the
    synthesizer's only when it sent them).

    Args:
        started / prepared / first_at: the ingress's clock (s) at arrival, after ``prepare`` and
            when the first chunk arrived.
        first: the first chunk (None: the stream was empty).
    """
    out = {"frontend": (prepared - started) * 1e3}
    timing = first.timing if first is not None else None
    if timing and "first_audio" in timing:
        at = [0.0] + [timing.get(k) for k in FIRST_AUDIO_STAGES]
        for name, lo, hi in zip(("llm-first-token", "llm-first-chunk", "token2wav"), at, at[1:]):
            if lo is not None and hi is not None:
                out[name] = hi - lo
        parts = [timing.get("first_chunk_tokens"), *(timing.get(k) for k in TOKEN2WAV_MARKS), timing["first_audio"]]
        if None not in parts:
            out.update({name: hi - lo for name, lo, hi in zip(TOKEN2WAV_PARTS, parts, parts[1:])})
        out["handoff"] = max(0.0, (first_at - prepared) * 1e3 - timing["first_audio"])
    if timing and REPLICA_UP in timing:
        out["replica-up"] = timing[REPLICA_UP]
    if first is not None:
        out["first-audio"] = (first_at - started) * 1e3
    return {k: round(v, 2) for k, v in out.items()}


def server_timing(stages: dict[str, float]) -> str:
    """``Server-Timing`` header value: ``name;dur=ms`` entries in :data:`STAGES` order, then
    :data:`TOKEN2WAV_PARTS` and :data:`NOT_STAGES`."""
    return ", ".join(f"{name};dur={stages[name]:.2f}" for name in STAGES + TOKEN2WAV_PARTS + NOT_STAGES
                     if name in stages)


def parse_server_timing(value: str) -> dict[str, float]:
    """The ``dur`` of every entry of a ``Server-Timing`` header (entries without one are skipped)."""
    out = {}
    for entry in value.split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        for p in params:
            key, _, dur = p.partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(dur)
                except ValueError:
                    pass
    return out
