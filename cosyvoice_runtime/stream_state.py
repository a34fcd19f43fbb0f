"""What a request's token2wav stream holds, and how a failed call puts it back.

A request owns a :class:`StreamState` (its voice prompt as the flow takes it, the hop schedule's
position, vocoder caches, the incremental flow's cache) and asks :class:`~cosyvoice_runtime.token2wav.Token2Wav`
for one :class:`Token2WavJob` at a time. A call over several streams is all or nothing
(:func:`all_or_nothing`): a job that fails leaves its stream as it was, so a retry gives the
audio the first attempt would have given. Voice prompts are copied to the flow's device once per
voice (:class:`PromptTensors`, keyed by :func:`prompt_key`).
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields

import torch

from cosyvoice_runtime.flow.flow_cache import FlowCache
from cosyvoice_runtime.hift.streaming import VocoderStream
from cosyvoice_runtime.voice_prompt import VoicePrompt


@dataclass
class StreamState:
    """Per-request token2wav state, owned by the caller and passed in on every call.

    ``prompt_tokens`` / ``prompt_feat`` / ``prompt_embedding`` are the voice prompt as the flow
    takes it, on the flow's device: (1, Lp) int32, (1, 2 * Lp, n_mels) and (1, spk_dim) in the
    flow's dtype, shared by the streams of one voice and never written (made by
    ``Token2Wav.new_stream``); ``prompt_key`` identifies that content (:func:`prompt_key`).
    """

    prompt: VoicePrompt
    prompt_tokens: torch.Tensor = field(repr=False)
    prompt_feat: torch.Tensor = field(repr=False)
    prompt_embedding: torch.Tensor = field(repr=False)
    prompt_key: bytes = field(repr=False)
    stream: bool
    speed: float
    hop_len: int
    vocoder: VocoderStream
    generator: torch.Generator | None = None
    token_offset: int = 0
    calls: int = 0
    finished: bool = False
    samples_out: int = 0
    flow_cache: FlowCache | None = field(default=None, repr=False)  # incremental flow only
    flow_recompute: bool = False  # the incremental flow's cache budget was full: recomputed from then on
    flow_frames: int = 0  # estimator frames solved for this request so far (each of 2 x n_timesteps passes)
    prefix_looked_up: bool = False  # its voice's prompt prefix was looked up (counted) by Token2Wav.prefix_job


@dataclass
class Token2WavJob:
    """One flow + vocoder call: tokens ``[0, n_tokens)`` of a request."""

    state: StreamState
    tokens: torch.Tensor  # (1, n_tokens) int32
    finalize: bool
    hop: int  # tokens this call advances the offset by (0 for the final call)
    source_override: torch.Tensor | None = field(default=None, repr=False)


@dataclass(eq=False)
class PrefixJob:
    """A flow solve of a voice prompt's kept prefix alone, for a stream whose voice has none kept
    (``Token2Wav.prefix_job``): it runs while the LLM makes the stream's first chunk, which then
    starts after the prefix like a later request of that voice. No audio, no change to ``state``."""

    state: StreamState


def prompt_key(prompt: VoicePrompt) -> bytes:
    """What identifies a voice prompt to the flow: its speech tokens, mel and speaker embedding."""
    h = hashlib.blake2b(digest_size=16)
    for arr in (prompt.speech_tokens, prompt.mel, prompt.embedding):
        h.update(str(arr.dtype).encode() + str(arr.shape).encode())
        h.update(arr.tobytes())
    return h.digest()


class PromptTensors:
    """Voice prompts on the flow's device by content (:func:`prompt_key`), the least recently used
    out past ``max_voices``. Why: each request copied its prompt's tokens, mel and speaker
    embedding from pageable memory, three copies that each waited for the stream, on the event
    loop before the request reached the LLM (seen in a profiler trace; no gain showed at one stream
    without the profiler: docs/tuning.md §1). Readers never write them.
    Thread-safe (new_stream runs on the event loop, the VC path on compute lanes)."""

    def __init__(self, max_voices: int) -> None:
        self.max_voices = max_voices
        self._items: OrderedDict[bytes, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: bytes, make: Callable[[], tuple]) -> tuple:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = make()  # outside the lock: a copy to the device may wait for the stream
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.max_voices:
                self._items.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._items)


@contextlib.contextmanager
def all_or_nothing(states: list[StreamState]) -> Iterator[None]:
    """If the block raises, every stream is put back as it was (schedule fields, vocoder caches,
    incremental flow cache, random-source positions), so a retry of the same jobs gives the
    audio a first attempt would have given: no click from a half-advanced overlap cache, no
    frames skipped by an advanced flow cache."""
    saved = [_checkpoint(st) for st in states]
    try:
        yield
    except BaseException:
        for st, cp in zip(states, saved):
            _rollback(st, cp)
        raise


def _checkpoint(state: StreamState) -> tuple:
    """What a token2wav call changes in a stream. The vocoder state and the flow cache have their
    fields reassigned, never written in place (the flow cache's tensors only past its frames), so
    shallow copies keep the old values; the random generators are saved by position."""
    gens = {id(g): g for g in (state.generator, state.vocoder.generator) if g is not None}
    return (copy.copy(state), copy.copy(state.vocoder), copy.copy(state.flow_cache),
            [(g, g.get_state()) for g in gens.values()])


def _rollback(state: StreamState, cp: tuple) -> None:
    before, vocoder, flow_cache, gens = cp
    for f in fields(StreamState):
        setattr(state, f.name, getattr(before, f.name))
    state.vocoder = vocoder
    if state.flow_cache is not None:  # the same object the job's flow row holds: restored in place
        for f in fields(FlowCache):
            setattr(state.flow_cache, f.name, getattr(flow_cache, f.name))
    for g, position in gens:
        g.set_state(position)
