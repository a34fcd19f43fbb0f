"""Token2wav's chunk jobs run as whole batches (``token2wav.scheduler: batch``), with failure isolation.

The synthesizer's ``@serve.batch`` entry point hands each batch of chunk jobs (many streams'
flow + HiFT work) to :meth:`BatchJobs.run` on the replica's token2wav lane. A batch that raises is
split in halves and each half retried (a batch too big for the device's memory fits in smaller
ones), down to single jobs; a job that still raises alone fails its request only. A retry is
exact: a token2wav batch that raises puts every stream state back (``Token2Wav.run_batch``, all or
nothing). A fatal fault (:func:`~deployments.engine_loop.is_fatal`) fails every open request and
marks the replica unhealthy. Audio with non-finite samples fails its request instead of reaching
the client (:meth:`BatchJobs.finite`, also applied to the stepped scheduler's audio).
"""
from __future__ import annotations

import logging

import numpy as np

from deployments.compute import ComputeExecutor
from deployments.engine_loop import EngineLoop, is_fatal
from deployments.protocol import EngineDeadError, RequestFailedError
from deployments.runtime_protocol import Token2WavRuntime

logger = logging.getLogger(__name__)


class BatchJobs:
    """Runs chunk jobs of many streams as one token2wav batch; counts what failed.

    Args:
        t2w: the replica's token2wav runtime.
        compute: the replica's compute executor.
        lane: the compute lane token2wav runs on.
        loop: the replica's engine loop (whether the device is dead; killed by a fatal fault).
    """

    def __init__(self, t2w: Token2WavRuntime, compute: ComputeExecutor, lane: str, loop: EngineLoop) -> None:
        self.t2w, self.compute, self.lane, self.loop = t2w, compute, lane, loop
        self.splits = 0  # token2wav batches that raised and were split in halves
        self.failed_jobs = 0  # chunk jobs failed alone (an error even alone, or non-finite audio)

    async def run(self, jobs: list) -> list[np.ndarray | Exception]:
        """The audio of each job, or the :class:`RequestFailedError` of a job that failed alone."""
        if self.loop.is_dead:
            raise EngineDeadError("replica unhealthy: an earlier fault left the device unusable")
        try:
            audios = await self.compute.run(self.t2w.run_batch, jobs, lane=self.lane)
        except Exception as exc:
            if is_fatal(exc):
                logger.exception("token2wav failed fatally; the replica is unhealthy")
                self.loop.kill(exc)
                raise EngineDeadError(f"token2wav failed: {type(exc).__name__}") from None
            if len(jobs) == 1:
                self.failed_jobs += 1
                logger.warning("token2wav failed for one job (%s: %s); failing its request", type(exc).__name__, exc)
                return [RequestFailedError(f"audio generation failed: {type(exc).__name__}: {exc}")]
            self.splits += 1
            logger.warning("token2wav batch of %d failed (%s); retrying in halves", len(jobs), type(exc).__name__)
            half = len(jobs) // 2
            return await self.run(jobs[:half]) + await self.run(jobs[half:])
        return [self.finite(audio) for audio in audios]

    def finite(self, audio: np.ndarray) -> np.ndarray | Exception:
        """``audio``, or the error that fails its request when it has NaN or Inf samples."""
        if np.isfinite(audio).all():
            return audio
        self.failed_jobs += 1
        logger.warning("token2wav produced non-finite samples (NaN/Inf); failing that request")
        return RequestFailedError("audio generation produced non-finite samples (NaN/Inf)")
