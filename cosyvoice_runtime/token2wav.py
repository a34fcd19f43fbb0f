"""Speech tokens -> waveform: the streaming chunk schedule, flow calls and vocoder glue.

A request owns a :class:`StreamState` (hop length, token offset, vocoder caches); the
:class:`Token2Wav` object holds only the shared models, so any replica can serve any chunk
and chunks of different requests can be batched.

Schedule (spec §6.1): the first chunk is ``token_hop_len + pad`` tokens with
``pad = ceil(Lp / hop) * hop - Lp`` so that chunk boundaries fall on the flow's 25-token
attention chunks counted from the prompt start; every flow call recomputes all tokens up to
``offset + hop + lookahead`` and keeps the mel from ``2 * offset``; the hop then grows by
``stream_scale_factor`` up to ``token_max_hop_len``. The official code keeps the hop on the
shared model object (so later requests start at the maximum hop); here it is per request.

Where things live: the schedule's arithmetic (prompt pad, first hop, the vocoder lengths it
produces, the order of flow passes) in :mod:`cosyvoice_runtime.stream_schedule`, which this
module follows per request; a request's state, its all-or-nothing rollback and the voice prompts
kept on the device in :mod:`cosyvoice_runtime.stream_state`; the vocoder's streaming strategies
(CV2 overlap caches, CV3 recompute / incremental) and their per-request state in
:mod:`cosyvoice_runtime.hift.streaming`.
"""
from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Sequence

import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.flow.flow import FlowItem
from cosyvoice_runtime.flow.flow_cache import DEFAULT_FLOW_CACHE_BYTES, FlowCache, PromptPrefixes, grown_capacity
from cosyvoice_runtime.flow.incremental import IncrementalRow
from cosyvoice_runtime.flow.stepper import SolveRow
from cosyvoice_runtime.hift.streaming import VocoderCall, VocoderStream, vocode_batch
from cosyvoice_runtime.stream_schedule import first_hop
from cosyvoice_runtime.stream_state import (
    PrefixJob,
    PromptTensors,
    StreamState,
    Token2WavJob,
    all_or_nothing,
    prompt_key,
)
from cosyvoice_runtime.voice_prompt import VoicePrompt

logger = logging.getLogger(__name__)

PROMPT_VOICES = 256  # voice prompts kept on the device (~60 KB each for a 3.5 s CosyVoice2 prompt in bf16)


class Token2Wav:
    """Flow + HiFT over per-request :class:`StreamState` objects.

    Args:
        spec: the model spec.
        flow: the token-to-mel module (:class:`~cosyvoice_runtime.flow.flow.Flow`; its
            ``inference_batch`` solves the jobs of several requests at once).
        hift: the vocoder module.
        official_final_full_attention: the official code runs the last streamed flow call with
            full attention although all earlier calls used chunk masks (spec §4.8); by default we
            keep the chunk masks so the final frames are computed like the ones before them.
        min_first_hop: None = the official first chunk (``hop + pad`` tokens); else the first
            chunk ends at the first attention-chunk boundary at or past this many tokens
            (:func:`first_hop`), and a first chunk shorter than ``hop`` is followed by a hop of
            ``token_hop_len`` (not yet scaled) so the second chunk also comes early.
        cv3_vocoder: CosyVoice3 vocoder strategy: "recompute" (official: the whole accumulated
            mel every chunk, quadratic in the utterance) or "incremental" (the new frames and a
            bounded left context; same samples within float noise). CosyVoice2 ignores it.
        cv2_flow: CosyVoice2 streamed flow calls: "recompute" (official: every call solves the
            prompt and all earlier tokens again) or "incremental" (each request keeps the
            estimator state of the frames already emitted in its :class:`StreamState` and solves
            only the new frames; same mel within float noise, :mod:`cosyvoice_runtime.flow.incremental`),
            batched and stepped as the recomputed jobs are. CosyVoice3 ignores it.
        cv3_flow: the same choice for CosyVoice3's streamed flow calls (its DiT); CosyVoice2 ignores it.
        flow_cache_bytes: with an incremental flow, the most the open streams' flow caches may
            hold together: a stream whose job would grow them past it drops its cache and is
            recomputed from then on (same mel), instead of the replica running out of memory.
        prompt_cache_bytes: with an incremental flow, keep the flow state of each voice prompt's
            whole attention chunks for later requests with that prompt, up to this many bytes
            (:class:`~cosyvoice_runtime.flow.flow_cache.PromptPrefixes`); 0: off.
    """

    def __init__(self, spec: ModelSpec, flow: torch.nn.Module, hift: torch.nn.Module,
                 official_final_full_attention: bool = False, min_first_hop: int | None = None,
                 cv3_vocoder: str = "recompute", cv2_flow: str = "recompute", prompt_cache_bytes: int = 0,
                 cv3_flow: str = "recompute", flow_cache_bytes: int = DEFAULT_FLOW_CACHE_BYTES) -> None:
        for name, value in (("cv2_flow", cv2_flow), ("cv3_flow", cv3_flow)):
            if value not in ("recompute", "incremental"):
                raise ValueError(f"{name} must be 'recompute' or 'incremental', got {value!r}")
        self.spec = spec
        # what this family's streamed flow calls do
        self.flow_mode = cv2_flow if spec.family == "cosyvoice2" else cv3_flow
        self._prompts = PromptTensors(PROMPT_VOICES)
        self.prompt_prefixes = (PromptPrefixes(prompt_cache_bytes)
                                if prompt_cache_bytes > 0 and self.flow_mode == "incremental" else None)
        self.flow_cache_bytes = flow_cache_bytes
        self._live_caches: weakref.WeakSet[FlowCache] = weakref.WeakSet()  # of open streams (gone with them)
        self._live_lock = threading.Lock()  # the replica's stats read them from another thread
        self.flow_fallbacks = 0  # streams moved to the recompute by the budget
        self.peak_cache_bytes = 0  # the most the open streams' caches were planned to hold (readers may reset it)
        self.cv3_vocoder = cv3_vocoder  # VocoderStream strategy of CV3 streams (CV2 ignores it)
        self.flow = flow
        self.hift = hift
        self.official_final_full_attention = official_final_full_attention
        self.min_first_hop = min_first_hop
        self.lookahead = spec.flow.pre_lookahead_len
        self.ratio = spec.flow.token_mel_ratio

    def new_stream(self, prompt: VoicePrompt, stream: bool, speed: float = 1.0,
                   generator: torch.Generator | None = None) -> StreamState:
        """A request's state; its prompt is copied to the flow's device and dtype here, once."""
        if not (0.5 <= speed <= 2.0) or not math.isfinite(speed):
            raise InvalidInputError(f"speed must be within [0.5, 2.0], got {speed}")
        if stream and speed != 1.0:
            raise InvalidInputError("speed != 1 is only supported without streaming")
        key = prompt_key(prompt)
        tokens, feat, embedding = self._prompts.get(key, lambda: self._prompt_tensors(prompt))
        return StreamState(
            prompt=prompt, prompt_tokens=tokens, prompt_feat=feat, prompt_embedding=embedding, prompt_key=key,
            stream=stream, speed=speed, hop_len=self.spec.stream.token_hop_len,
            vocoder=VocoderStream.create(self.spec, strategy=self.cv3_vocoder), generator=generator,
        )

    def _prompt_tensors(self, prompt: VoicePrompt) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight = next(self.flow.parameters())
        # torch.tensor copies: arrays unpickled from a handle call are read-only.
        return (torch.tensor(prompt.speech_tokens, dtype=torch.int32, device=weight.device).reshape(1, -1),
                torch.tensor(prompt.mel, dtype=weight.dtype, device=weight.device)[None],
                torch.tensor(prompt.embedding, dtype=weight.dtype, device=weight.device).reshape(1, -1))

    def prefix_job(self, state: StreamState) -> PrefixJob | None:
        """A job that solves this stream's voice prompt prefix alone, when the incremental flow keeps
        prefixes, none is kept for its voice and the prompt has a whole attention chunk; else None.
        Run through :meth:`start_solves` / :meth:`finish` (no audio) before the stream's first job.

        Why: without it a new voice's first job solves its whole prompt beside the first chunk
        (up to ~500 frames in one row where a known voice's has ~50-150, a row no captured bucket
        holds past ~9 s of prompt) after the LLM made that chunk. On its own the prefix is solved
        while the LLM decodes, and the first chunk rides like a known voice's.
        Counts the stream's prefix hit or miss (its first job's lookup then counts nothing)."""
        prefixes = self.prompt_prefixes
        if (prefixes is None or not state.stream or state.flow_cache is not None or state.flow_recompute
                or state.prefix_looked_up or self.flow.prompt_prefix_frames(state.prompt_tokens.shape[1]) < 1):
            return None
        state.prefix_looked_up = True
        return PrefixJob(state) if prefixes.get(state.prompt_key) is None else None

    def _prefix_item(self, state: StreamState) -> FlowItem:
        return FlowItem(token=state.prompt_tokens[:, :0], prompt_token=state.prompt_tokens, prompt_feat=state.prompt_feat,
                        embedding=state.prompt_embedding, streaming=True, finalize=False)

    def _next_hop(self, state: StreamState) -> int:
        if state.token_offset == 0:
            return first_hop(state.prompt.n_tokens, self.spec.stream.token_hop_len, self.min_first_hop)
        return state.hop_len

    def tokens_needed(self, state: StreamState) -> int | None:
        """Tokens generated in all at which :meth:`next_job` has the next streamed job; None when
        the next job is the final one (it waits for the end of generation)."""
        if state.finished or not state.stream:
            return None
        return state.token_offset + self._next_hop(state) + self.lookahead

    def next_job(self, state: StreamState, tokens: Sequence[int] | torch.Tensor, llm_done: bool) -> Token2WavJob | None:
        """The job to run now for ``tokens`` generated so far, or None to wait for more tokens."""
        if state.finished:
            return None
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(-1)
        end = self.tokens_needed(state)
        if end is not None and len(tokens) >= end:
            ids, finalize, hop = tokens[:end], False, self._next_hop(state)
        elif llm_done:
            ids, finalize, hop = tokens, True, 0
        else:
            return None
        return Token2WavJob(state, torch.as_tensor(ids, dtype=torch.int32).reshape(1, -1), finalize=finalize, hop=hop)

    def flow_item(self, job: Token2WavJob) -> FlowItem:
        """What the flow solves for ``job``: its tokens over the stream's voice prompt."""
        state = job.state
        streaming_masks = state.stream and not (job.finalize and self.official_final_full_attention)
        return FlowItem(token=job.tokens, prompt_token=state.prompt_tokens, prompt_feat=state.prompt_feat,
                        embedding=state.prompt_embedding, streaming=streaming_masks, finalize=job.finalize)

    def _plan(self, jobs: list[Token2WavJob], items: list[FlowItem]) -> list[bool]:
        """Which jobs are solved incrementally: streamed ones of the incremental flow, while the open
        streams' caches stay within ``flow_cache_bytes`` (counting each job's growth at most to its
        end); a stream that would pass it drops its cache and is recomputed from then on."""
        plan, live = [], None
        for job, item in zip(jobs, items):
            state = job.state
            inc = (self.flow_mode == "incremental" and state.stream and not state.flow_recompute
                   and self.flow.can_solve_incrementally(item))
            if inc:
                have = state.flow_cache.capacity if state.flow_cache is not None else 0
                frames = state.prompt_feat.shape[1] + self.ratio * int(job.tokens.shape[1])
                grow = max(0, grown_capacity(frames) - have) * self.flow.incremental_stepper().frame_bytes
                if grow:  # most jobs fit the capacity their cache has: the sum is taken only for those that grow
                    live = self.live_cache_bytes() if live is None else live
                    inc = live + grow <= self.flow_cache_bytes
                    if inc:
                        live += grow
                        self.peak_cache_bytes = max(self.peak_cache_bytes, live)
                    else:
                        self._fall_back(state, live)
            plan.append(inc)
        return plan

    @torch.inference_mode()
    def flow_mels(self, jobs: list[Token2WavJob]) -> list[torch.Tensor]:
        """New mel frames of each job, (1, n_mels, frames) from its token offset on.

        Recomputed jobs share one CFM solve, incremental ones (``cv2_flow`` / ``cv3_flow``) one incremental solve.
        """
        items = [self.flow_item(job) for job in jobs]
        incremental = self._plan(jobs, items)
        out: list[torch.Tensor | None] = [None] * len(jobs)
        batch = [i for i, inc in enumerate(incremental) if not inc]
        if batch:
            mels = self.flow.inference_batch([items[i] for i in batch])
            for i, mel in zip(batch, mels):
                state = jobs[i].state
                state.flow_frames += state.prompt_feat.shape[1] + mel.shape[-1]
                out[i] = mel[:, :, state.token_offset * self.ratio:]
        inc = [i for i, flag in enumerate(incremental) if flag]
        if inc:
            rows = self._incremental_rows([jobs[i] for i in inc], [items[i] for i in inc])
            self.flow.incremental.solve(rows)
            for i, row in zip(inc, rows):
                out[i] = self._incremental_mel(row)
        return out

    def _incremental_rows(self, jobs: list[Token2WavJob], items: list[FlowItem]) -> list[IncrementalRow]:
        """Rows over each request's cache; a request's first job starts from its voice's prompt
        prefix when one is kept, or marks where that prefix ends so that it is kept afterwards."""
        marks = []
        for job in jobs:
            state, mark = job.state, 0
            if state.flow_cache is None:
                prefixes = self.prompt_prefixes
                prefix = prefixes.get(state.prompt_key, count=not state.prefix_looked_up) if prefixes is not None else None
                state.flow_cache = FlowCache() if prefix is None else prefix.shared()
                with self._live_lock:
                    self._live_caches.add(state.flow_cache)
                if prefix is None and prefixes is not None:
                    mark = self.flow.prompt_prefix_frames(state.prompt_tokens.shape[1])
            marks.append(mark)
        return self.flow.start_incremental_rows(items, [job.state.flow_cache for job in jobs], list(jobs), marks)

    def _incremental_mel(self, row: IncrementalRow) -> torch.Tensor:
        """A finished incremental row's mel from its job's token offset on; its cache advances
        (inside the caller's :func:`all_or_nothing`, which puts the cache back if the job fails)."""
        state = row.tag.state
        start = row.start
        first = state.prompt_feat.shape[1] + state.token_offset * self.ratio - start
        if first < 0:
            raise RuntimeError(f"flow cache of {start} frames is past the job's first new frame")
        state.flow_frames += row.frames
        if row.mark and self.prompt_prefixes is not None:
            self.prompt_prefixes.put(state.prompt_key, row.cache.prefix(start + row.mark, row.mark_convs))
        row.commit()
        return row.x[None, :, first:].float()

    def _fall_back(self, state: StreamState, live: int) -> None:
        """The budget is full: the stream drops its cache and is recomputed from now on."""
        self._drop_cache(state)
        state.flow_recompute = True
        self.flow_fallbacks += 1
        if self.flow_fallbacks & (self.flow_fallbacks - 1) == 0:  # 1, 2, 4, ...: bounded log volume
            logger.warning("flow cache budget full (%.1f of %.1f GiB): %d streams moved to the recompute so far; "
                           "raise token2wav.flow_cache_bytes if memory allows", live / 2**30,
                           self.flow_cache_bytes / 2**30, self.flow_fallbacks)

    def live_cache_bytes(self) -> int:
        """Bytes the open streams' incremental flow caches hold (prefixes they still share included)."""
        with self._live_lock:
            caches = list(self._live_caches)
        return sum(c.nbytes() for c in caches)

    def _drop_cache(self, state: StreamState) -> None:
        """Free a stream's flow cache (its last job, or the budget); an abandoned stream's goes with it."""
        if state.flow_cache is not None:
            with self._live_lock:
                self._live_caches.discard(state.flow_cache)
            state.flow_cache = None

    def flow_mel(self, job: Token2WavJob) -> torch.Tensor:
        return self.flow_mels([job])[0]

    def vocode(self, job: Token2WavJob, mel: torch.Tensor) -> torch.Tensor:
        """Vocode a job's new mel frames and advance its state (:meth:`vocode_many` of one job).
        Returns (samples,) float32."""
        return self.vocode_many([job], [mel])[0]

    def _advance(self, job: Token2WavJob, audio: torch.Tensor) -> torch.Tensor:
        state = job.state
        state.calls += 1
        if job.finalize:
            state.finished = True
            self._drop_cache(state)
        else:
            short_first = state.token_offset == 0 and job.hop < state.hop_len
            state.token_offset += job.hop
            if not short_first:
                state.hop_len = min(self.spec.stream.token_max_hop_len,
                                    state.hop_len * self.spec.stream.stream_scale_factor)
        audio = audio.reshape(-1)
        state.samples_out += audio.numel()
        return audio

    @torch.inference_mode()
    def vocode_many(self, jobs: list[Token2WavJob], mels: list[torch.Tensor]) -> list[torch.Tensor]:
        """:meth:`vocode` of jobs of distinct requests in one vocoder batch
        (:func:`~cosyvoice_runtime.hift.streaming.vocode_batch`). All or nothing (:func:`all_or_nothing`)."""
        with all_or_nothing([job.state for job in jobs]):
            return self._vocode_many(jobs, mels)

    def _vocode_many(self, jobs: list[Token2WavJob], mels: list[torch.Tensor]) -> list[torch.Tensor]:
        calls = [VocoderCall(job.state.vocoder, mel, job.finalize, generator=job.state.generator,
                             source_override=job.source_override, speed=job.state.speed)
                 for job, mel in zip(jobs, mels)]
        return [self._advance(job, audio) for job, audio in zip(jobs, vocode_batch(self.hift, calls))]

    # -- step by step (flow.stepper, flow.incremental): the caller runs the passes, so urgent jobs can overtake --
    def start_solves(self, jobs: list[Token2WavJob | PrefixJob]) -> list[SolveRow | IncrementalRow]:
        """Encode jobs of distinct requests into flow rows at step 0 (``row.tag`` is the job):
        incremental jobs (``cv2_flow`` / ``cv3_flow``) and prompt prefixes (:meth:`prefix_job`) as
        :class:`IncrementalRow`, the others as :class:`SolveRow`. Then :meth:`advance` picked rows
        until ``row.step == n_steps`` and :meth:`finish` them.
        """
        if len({id(job.state) for job in jobs}) != len(jobs):
            raise ValueError("jobs of a request are sequential: at most one row per request")
        rows: list = [None] * len(jobs)

        def place(idx: list[int], made: list) -> None:
            for i, row in zip(idx, made):
                row.oversize = self._oversize(row)
                rows[i] = row

        prefix = [i for i, job in enumerate(jobs) if isinstance(job, PrefixJob)]
        if prefix:
            place(prefix, self.flow.start_prefix_rows([self._prefix_item(jobs[i].state) for i in prefix],
                                                      [jobs[i] for i in prefix]))
        chunks = [i for i, job in enumerate(jobs) if not isinstance(job, PrefixJob)]
        items = [self.flow_item(jobs[i]) for i in chunks]
        incremental = self._plan([jobs[i] for i in chunks], items)
        for flag in (False, True):
            part = [k for k, inc in enumerate(incremental) if inc == flag]
            if not part:
                continue
            part_jobs, part_items = [jobs[chunks[k]] for k in part], [items[k] for k in part]
            place([chunks[k] for k in part], self._incremental_rows(part_jobs, part_items) if flag
                  else self.flow.start_rows(part_items, part_jobs))
        return rows

    def _oversize(self, row: SolveRow | IncrementalRow) -> bool:
        """Whether no bucket holds a pass of this row alone (prompt + audio past the flow graphs'
        ``flow_graph_max_s``): it runs eagerly, and a pass takes the shape of its largest row, so
        :func:`~cosyvoice_runtime.stream_schedule.pick_rows` gives such rows passes of their own
        instead of taking the graphed rows beside them into an eager pass (at 40 sessions on an H100,
        12 such calls went with a token2wav p99 of 1.8 s, 2026-12-07). An unpadded incremental
        stepper (CPU) has no buckets: every row is alike there."""
        if row.kind == "incremental":
            inc = self.flow.incremental
            return inc.padded and inc.bucket_of(1, row.frames, row.start) is None
        return self.flow.stepper.bucket_of(1, row.frames) is None

    @property
    def n_steps(self) -> int:
        return self.spec.flow.n_timesteps

    def advance(self, rows: list[SolveRow | IncrementalRow]) -> None:
        """One flow pass over these rows, all of one ``kind`` (a pass is one graph)."""
        kinds = {row.kind for row in rows}
        if len(kinds) > 1:
            raise ValueError("a pass runs rows of one kind: recomputed or incremental")
        if kinds == {"incremental"}:
            self.flow.incremental.advance(rows)
        elif rows:
            self.flow.stepper.advance(rows)

    @torch.inference_mode()
    def finish(self, rows: list[SolveRow | IncrementalRow]) -> list[torch.Tensor]:
        """Vocode finished rows (their jobs advance); the audio of each, in order. A prompt
        prefix's row (:meth:`prefix_job`) is kept for its voice and gives no audio."""
        if any(r.step < self.n_steps for r in rows):
            raise ValueError("finish() takes rows whose solve is done")
        chunks = [row for row in rows if not isinstance(row.tag, PrefixJob)]
        for row in rows:
            if isinstance(row.tag, PrefixJob) and self.prompt_prefixes is not None:
                # kept for the voice as a copy: a retry finds the row as it was
                self.prompt_prefixes.put(row.tag.state.prompt_key, row.cache.prefix(row.keep, row.new_convs))
                self.prompt_prefixes.primed += 1
        audios = iter(self._finish_jobs(chunks) if chunks else [])
        return [row.x.new_zeros(0, dtype=torch.float32) if isinstance(row.tag, PrefixJob) else next(audios)
                for row in rows]

    def _finish_jobs(self, rows: list[SolveRow | IncrementalRow]) -> list[torch.Tensor]:
        jobs = [row.tag for row in rows]
        with all_or_nothing([job.state for job in jobs]):
            mels = []
            for row, job in zip(rows, jobs):
                if isinstance(row, IncrementalRow):
                    mels.append(self._incremental_mel(row))
                else:
                    job.state.flow_frames += row.frames
                    mels.append(self.flow.row_mel(row, job.state.prompt_feat.shape[1])[:, :, job.state.token_offset * self.ratio:])
            return self._vocode_many(jobs, mels)

    def run(self, job: Token2WavJob) -> torch.Tensor:
        """Flow + vocoder for one job; returns the (samples,) audio to emit."""
        return self.vocode(job, self.flow_mel(job))

    def run_batch(self, jobs: list[Token2WavJob], max_batch: int = 16) -> list[torch.Tensor]:
        """Run jobs of different requests (at most one per request); the audio of each, in order.

        The flow runs as one batched solve per group of ``max_batch`` jobs, the vocoder as one
        batch per group (:meth:`vocode_many`); each request keeps its own caches.
        """
        if len({id(job.state) for job in jobs}) != len(jobs):
            raise ValueError("a batch may hold at most one job per request (jobs of a request are sequential)")
        out: list[torch.Tensor] = []
        with all_or_nothing([job.state for job in jobs]):  # every group, the incremental flow included
            for start in range(0, len(jobs), max_batch):
                group = jobs[start:start + max_batch]
                out += self._vocode_many(group, self.flow_mels(group))
        return out

    def synthesize(self, prompt: VoicePrompt, tokens: Sequence[int] | torch.Tensor, stream: bool = False,
                   speed: float = 1.0, generator: torch.Generator | None = None) -> list[torch.Tensor]:
        """All chunks of an utterance whose tokens are already known (VC path, tests)."""
        state = self.new_stream(prompt, stream=stream, speed=speed, generator=generator)
        chunks = []
        while (job := self.next_job(state, tokens, llm_done=True)) is not None:
            chunks.append(self.run(job))
        return chunks
