"""A stream's continuation on another replica, on the synthesizer's side (docs/serving.md, Failover).

When the replica serving a stream dies, the ingress (``serve_app/failover.py``) asks another
replica for the same request with a :class:`~deployments.protocol.Resume`: the piece it had
reached, the LLM's ids of that piece so far and the samples of it the client already has. The
replica skips the pieces before, prefills the piece's sequence with those ids (or, when the
sequence had ended, decodes nothing), re-runs token2wav over the piece from its start, and drops
the samples the client has. That seam is exact because everything is a function of the request
and its seed: the sampler's draws depend on the seed and the step only
(``cosyvoice_runtime.llm.batch_sampling``), the chunk schedule on the token count only
(``cosyvoice_runtime.stream_schedule``), the flow's noise is fixed and the vocoder's source noise
comes from a generator seeded by the request (the ingress seeds every request it may continue).

:class:`PieceCursor` is one piece's bookkeeping: the ids to report with each chunk (every stream
reports them, so any stream can be continued) and the samples still to skip.
"""
from __future__ import annotations

import numpy as np

from cosyvoice_runtime.lm_messages import TokenEvent
from deployments.protocol import Resume


class PieceCursor:
    """The LLM's ids of one piece and the audio of it a continuation's client already has.

    ``resume``: the continuation's :class:`Resume` if it stopped in this piece, else None.
    """

    def __init__(self, resume: Resume | None = None) -> None:
        self.prefix = list(resume.tokens) if resume is not None else []
        self.prefix_done = resume.llm_done if resume is not None else False
        self._skip = resume.samples if resume is not None else 0
        self._raw: list[int] = []  # every id of the piece the engine handed over (the prefix first)
        self._reported = len(self.prefix)  # the ingress has these already
        self.llm_done = False

    def lm_fields(self) -> dict:
        """``LMRequest`` fields that continue the piece's sequence (none for a fresh piece)."""
        if not self.prefix and not self.prefix_done:
            return {}
        return {"prefix": np.asarray(self.prefix, dtype=np.int32), "prefix_done": self.prefix_done}

    def saw(self, event: TokenEvent) -> None:
        self._raw.extend(event.tokens if event.raw is None else event.raw)
        self.llm_done = self.llm_done or event.finished

    def take(self) -> list[int]:
        """The ids not yet reported to the ingress (sent with the next chunk)."""
        new = self._raw[self._reported:]
        self._reported = max(self._reported, len(self._raw))
        return new

    def trim(self, audio: np.ndarray, keep_empty: bool = False) -> np.ndarray | None:
        """``audio`` without the samples the client already has; None when nothing is left, unless
        ``keep_empty`` (the request's last chunk, which is sent even empty)."""
        if self._skip > 0:
            cut = min(self._skip, len(audio))
            self._skip -= cut
            audio = audio[cut:]
        return audio if len(audio) or keep_empty else None


def start_of(resume: Resume | None) -> tuple[int, int]:
    """(first piece to synthesise, index of the first chunk) of a request."""
    return (resume.piece, resume.chunks) if resume is not None else (0, 0)
