"""Typed messages exchanged through ``DeploymentHandle`` calls, and the error hierarchy.

Deployments never see HTTP objects: the ingress turns a request into a
:class:`SynthesisRequest`, the frontend turns that into a :class:`PreparedRequest`, and the
synthesizer streams :class:`AudioChunk` objects back. Audio is float32 mono numpy at the
model's sample rate; only ``serve_app`` knows containers (WAV, FLAC...) and status codes.

The voice prompt inside a :class:`PreparedRequest` is the runtime's own
:class:`~cosyvoice_runtime.voice_prompt.VoicePrompt` (numpy only), re-exported here.

Errors: the runtime's own exceptions are re-exported so callers import one module; the
serving-level ones are added here. Every class keeps the single-message constructor of
``Exception`` so that it survives pickling through Ray (a replica's exception is re-raised in
the caller as an instance of the same class).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

from cosyvoice_runtime.errors import (
    ConfigError,
    CosyVoiceError,
    InvalidInputError,
    ModelLoadError,
    VoiceNotFoundError,
)
from cosyvoice_runtime.frontend.aliases import AliasRule
from cosyvoice_runtime.frontend.errors import (
    DictionaryLimitError,
    DictionaryNotFoundError,
    DictionaryStoreUnwritableError,
)
from cosyvoice_runtime.voice_prompt import VoicePrompt

__all__ = [
    "AliasRule",
    "AudioChunk",
    "ConfigError",
    "CosyVoiceError",
    "DictionaryForbiddenError",
    "DictionaryLimitError",
    "DictionaryNotFoundError",
    "DictionaryStoreUnwritableError",
    "EngineDeadError",
    "EngineStats",
    "InvalidInputError",
    "ModelLoadError",
    "OverloadedError",
    "PayloadTooLargeError",
    "PreparedRequest",
    "PronunciationSpec",
    "ReplicaHealth",
    "Resume",
    "ServingError",
    "SynthesisMode",
    "SynthesisRequest",
    "SynthesisResult",
    "TextMarks",
    "TextPiece",
    "VoiceAccess",
    "VoiceExistsError",
    "VoiceForbiddenError",
    "VoiceInfo",
    "VoiceNotFoundError",
    "VoicePrompt",
    "VoiceStoreUnavailableError",
]


# --------------------------------------------------------------------------------------- errors
class ServingError(CosyVoiceError):
    """Base class of errors raised by the serving layer itself."""


class VoiceExistsError(InvalidInputError):
    """A voice id is already registered (409)."""


class VoiceForbiddenError(InvalidInputError):
    """The caller may use this voice but not change it: a shared voice, deleted or replaced only
    by an admin key (403)."""


class DictionaryForbiddenError(InvalidInputError):
    """A shared pronunciation dictionary, changed or deleted only by an admin key (403)."""


class VoiceStoreUnavailableError(ServingError):
    """The voice store refuses writes (read-only, permissions, disk full); the message names its
    path (503)."""


class PayloadTooLargeError(InvalidInputError):
    """Uploaded audio or text exceeds the configured limit (413)."""


class OverloadedError(ServingError):
    """The replica's admission queue is full; retry later (429 + Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, retry_after_s)  # both in args: survives pickling
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return str(self.args[0])


class EngineDeadError(ServingError):
    """The engine loop crashed; the replica is unhealthy and will be replaced (503)."""


class RequestFailedError(ServingError):
    """This request failed on the replica (non-finite logits or audio, an error only it triggers,
    a chunk that does not fit in memory even alone); the replica and other requests go on (500)."""


# ------------------------------------------------------------------------------------- messages
class SynthesisMode(enum.StrEnum):
    """CosyVoice inference modes (spec §1.2)."""

    ZERO_SHOT = "zero_shot"  # uploaded prompt audio + its transcript
    VOICE = "voice"  # a registered voice (stored zero-shot prompt)
    CROSS_LINGUAL = "cross_lingual"  # prompt audio/voice, no transcript given to the LLM
    INSTRUCT = "instruct"  # prompt audio/voice + an instruction in the prompt-text slot


OWNER_META_KEY = "owner"  # VoicePrompt.meta key of the key id that registered the voice (absent: shared)


@dataclass(frozen=True)
class VoiceAccess:
    """Whose voices a call may see and change (issue 41 item 4).

    ``owner``: the caller's key id (a fingerprint, never the key), stored with the voices it
    registers; None registers shared voices. ``sees_all``: an admin key, or a service without keys
    (the default: in-process callers and open mode see and change every voice, as before).
    A caller sees its own voices and the shared ones (built-in, registered with keys off); it
    changes only its own, unless it sees all.
    """

    owner: str | None = None
    sees_all: bool = True

    def may_see(self, voice_owner: str | None) -> bool:
        return self.sees_all or voice_owner is None or voice_owner == self.owner

    def may_change(self, voice_owner: str | None) -> bool:
        return self.sees_all or (voice_owner is not None and voice_owner == self.owner)


@dataclass(frozen=True)
class PronunciationSpec:
    """A request's pronunciation aliases: its own rules, then stored dictionaries (id, version
    or None for the latest), earlier ones winning (cosyvoice_runtime/frontend/aliases.py)."""

    locators: tuple[tuple[str, str | None], ...] = ()
    rules: tuple[AliasRule, ...] = ()


@dataclass
class SynthesisRequest:
    """Ingress -> frontend: what to say and how."""

    request_id: str
    text: str
    mode: SynthesisMode = SynthesisMode.VOICE
    voice_id: str | None = None
    prompt_text: str | None = None
    prompt_audio: np.ndarray | None = None  # (n,) float32 mono, decoded by the ingress
    prompt_sample_rate: int | None = None
    instruct_text: str | None = None
    speed: float = 1.0
    stream: bool = False
    seed: int | None = None
    access: VoiceAccess = field(default_factory=VoiceAccess)  # whose registered voices it may use
    pronunciation: PronunciationSpec | None = None  # aliases applied before normalisation


@dataclass
class TextPiece:
    """One sentence piece: synthesised as an independent LLM sequence (spec §1.1)."""

    text: str
    text_ids: np.ndarray  # (Lt,) int32


@dataclass
class Resume:
    """Where a stream continues on another replica after the one serving it died
    (``serve_app/failover.py``; docs/serving.md, Failover).

    The pieces before ``piece`` were delivered whole; of ``piece``, the client has ``samples``
    samples, made from the LLM's ids ``tokens`` (all it had emitted for that piece, unfiltered),
    and ``llm_done`` says the piece's sequence had ended. ``chunks``: audio chunks sent so far
    (the continuation numbers its chunks on from there).
    """

    piece: int = 0
    tokens: list[int] = field(default_factory=list)
    samples: int = 0
    llm_done: bool = False
    chunks: int = 0


@dataclass
class PreparedRequest:
    """Frontend -> synthesizer: tokenised pieces plus the prompt, per mode.

    ``llm_prompt_text_ids`` / ``llm_use_prompt_speech`` encode the mode table of spec §1.2: the
    LLM sees the transcript (zero-shot / voice), the instruction (instruct) or nothing
    (cross-lingual), and the prompt speech tokens only in the zero-shot modes; the flow always
    gets the full prompt.
    """

    request_id: str
    pieces: list[TextPiece]
    prompt: VoicePrompt
    llm_prompt_text_ids: np.ndarray
    llm_use_prompt_speech: bool
    speed: float = 1.0
    stream: bool = False
    seed: int | None = None
    resume: Resume | None = None  # a continuation of a stream whose replica died


FIRST_AUDIO_STAGES = ("first_token", "first_chunk_tokens", "first_audio")
# Stepped token2wav only (deployments.token2wav_loop): the first chunk's job taken in by the driver
# thread, and its solve and vocoder done there; they split the token2wav stage into waiting for the
# driver, the passes, and the way back to the event loop.
TOKEN2WAV_MARKS = ("t2w_started", "t2w_solved")
# A first chunk's timing also says how long its replica had served when the request came (ms since
# the replica was ready): whether a slow first audio met a replica that had just started
REPLICA_UP = "replica_up"


@dataclass
class TextMarks:
    """Which text tokens one audio chunk starts to say, from the model's own text-to-speech-token
    correspondence (deployments/text_marks.py says how it is made).

    ``first``: the index of the first of them in its LLM sequence's text (a sentence piece's
    ``text_ids``; a bistream sequence's own text ids in the order pushed, the prompt's excluded);
    ``starts``: for each, in order, where its speech starts, as a fraction in [0, 1] of the chunk's
    audio (non-decreasing). A sequence's last chunk carries every text token not marked before.
    """

    first: int
    starts: list[float]


@dataclass
class AudioChunk:
    """Synthesizer -> caller: one piece of audio as soon as it exists."""

    request_id: str
    samples: np.ndarray  # (n,) float32 in [-1, 1]
    sample_rate: int
    index: int  # 0-based chunk index within the request
    piece: int  # sentence piece this chunk belongs to
    is_last: bool = False
    # First chunk only: ms after the synthesizer received the request at which it had the first
    # speech token, the first chunk's tokens and the first audio (FIRST_AUDIO_STAGES); the
    # ingress sends them on as a Server-Timing header.
    timing: dict[str, float] | None = None
    # The LLM's ids of this piece emitted since the previous chunk (unfiltered), and whether its
    # sequence has ended: what a continuation on another replica starts from (Resume).
    tokens: list[int] = field(default_factory=list)
    llm_done: bool = False
    text_marks: TextMarks | None = None  # None from a runtime that reports no speech tokens


@dataclass
class SynthesisResult:
    """The whole utterance of a request answered at once (the ingress handle's ``synthesize``),
    joined from the synthesizer's stream; the times run from the synthesizer call to its first
    chunk and to its end."""

    request_id: str
    samples: np.ndarray
    sample_rate: int
    num_chunks: int
    time_to_first_audio_s: float
    compute_s: float

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate


@dataclass
class VoiceInfo:
    voice_id: str
    prompt_text: str
    family: str
    num_prompt_tokens: int
    created_at: float = 0.0


@dataclass
class EngineStats:
    """Snapshot of a synthesizer replica's engine, for health, metrics and tests."""

    running: int  # sequences holding a decode slot
    waiting: int  # sequences added but not yet admitted
    open_streams: int  # requests with an open result queue in the loop
    max_running: int
    steps: int
    aborted: int
    finished: int


@dataclass
class ReplicaHealth:
    deployment: str
    replica_id: str
    ready: bool
    device: str
    gpu_memory_allocated_bytes: int | None = None
    gpu_memory_total_bytes: int | None = None
    gpu_utilization_pct: float | None = None
    engine: EngineStats | None = None
    detail: dict = field(default_factory=dict)


# Runtime errors that mean "too large" (cosyvoice_runtime.frontend.errors), answered with 413.
_TOO_LARGE_NAMES = frozenset({"TextTooLongError", "PromptTooLongError"})


def portable_error(exc: BaseException) -> BaseException:
    """An equivalent of ``exc`` that survives the trip through Ray.

    Ray re-raises a replica's exception in the caller by unpickling it; classes whose constructor
    takes other arguments than the message (several runtime errors do) fail to unpickle and arrive
    as a bare ``RayTaskError``, which would turn a 4xx into a 500. Those are mapped to the nearest
    class of this module, keeping the message.
    """
    import pickle

    if not isinstance(exc, CosyVoiceError):
        return exc
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any unpickling failure means "not portable"
        portable = False
    else:
        portable = True
    if portable:
        return exc
    message = str(exc)
    if type(exc).__name__ in _TOO_LARGE_NAMES:
        return PayloadTooLargeError(message)
    for cls in (VoiceNotFoundError, VoiceExistsError, PayloadTooLargeError, InvalidInputError, ModelLoadError):
        if isinstance(exc, cls):
            return cls(message) if cls is not ModelLoadError else ServingError(message)
    return ServingError(message)
