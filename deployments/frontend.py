"""CPU text frontend deployment: normalisation, splitting, tokenisation, prompt features, voices.

Turns a :class:`~deployments.protocol.SynthesisRequest` into a
:class:`~deployments.protocol.PreparedRequest` for the synthesizer, applying the mode table of
spec §1.2, and owns the voice registry (register / list / get / delete). It autoscales on its
own, on CPU nodes; nothing here touches a GPU.

Voices belong to the key that registered them (:class:`~deployments.protocol.VoiceAccess`, the
owner's key id in the voice's ``meta``): a caller sees and uses its own voices and the shared ones
(no owner: built-in, or registered with keys off), changes only its own; an admin key, and every
caller of a service without keys, sees and changes all. A voice the caller may not see answers as
unknown (404), whoever holds it.
"""
from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field, PositiveFloat, PositiveInt

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.frontend.prompt_rules import CV3_SYSTEM_PROMPT, MODES, instruct_prompt, with_cv3_prefix
from cosyvoice_runtime.frontend.voice_id import check_voice_id  # the one voice-id rule
from deployments.compute import ComputeExecutor
from deployments.model_source import ModelSource
from deployments.observability import replica_id
from deployments.options import DeploymentKnobs
from deployments.pronunciation import PronunciationConfig, PronunciationHandles, PronunciationService
from deployments.protocol import (
    OWNER_META_KEY,
    CosyVoiceError,
    InvalidInputError,
    PayloadTooLargeError,
    PreparedRequest,
    SynthesisMode,
    SynthesisRequest,
    TextPiece,
    VoiceAccess,
    VoiceExistsError,
    VoiceForbiddenError,
    VoiceInfo,
    VoiceNotFoundError,
    VoicePrompt,
    portable_error,
)
from deployments.python_gc import settle_replica
from deployments.runtime_adapter import call_with_timeout
from deployments.runtime_protocol import FrontendRuntime

logger = logging.getLogger(__name__)

FrontendFactory = Callable[["FrontendConfig", ModelSource], FrontendRuntime]


class FrontendConfig(DeploymentKnobs):
    """Text frontend replica (CPU)."""

    model_dir: str | None = None  # None: AppArgs.model_dir
    voices_dir: str | None = None  # None: $FAST_COSY_HOME/voices (use shared storage on a cluster)
    threads: PositiveInt = 1
    max_prompt_audio_s: PositiveFloat = 30.0  # the speech tokenizer's limit
    min_prompt_audio_s: PositiveFloat = 0.5
    max_pieces: PositiveInt = 64
    max_voices: PositiveInt = 10_000  # voices the store may hold (413 past it)
    max_voice_store_bytes: PositiveInt = 4 * 1024**3  # bytes of voice records + tensors the store may hold (413)
    voice_cache_bytes: PositiveInt = 64 * 1024**2  # voice tensors kept in memory per replica (LRU)
    voice_gc_min_age_s: PositiveFloat = 3600.0  # orphaned voice files older than this are removed at start
    # CosyVoice3 needs <|endofprompt|> in the LLM text; this prefix is added where it is missing.
    cv3_system_prompt: str = CV3_SYSTEM_PROMPT
    # Pronunciation dictionaries: where they are stored, and their limits (deployments/pronunciation.py).
    pronunciation: PronunciationConfig = Field(default_factory=PronunciationConfig)
    runtime_factory: str | None = None  # "module:callable" (tests inject fakes)
    startup_timeout_s: PositiveFloat = Field(300.0)


def _default_factory(cfg: FrontendConfig, source: ModelSource) -> FrontendRuntime:
    from deployments.runtime_adapter import load_frontend_runtime

    return load_frontend_runtime(cfg, str(source.resolve()))


class TextFrontend(PronunciationHandles):
    """See the module docstring. Constructed by ``serve_app.app.build_app``."""

    def __init__(self, cfg: FrontendConfig, source: ModelSource | None = None,
                 runtime_factory: FrontendFactory | None = None) -> None:
        self.cfg = cfg
        if runtime_factory is None:
            if cfg.runtime_factory:
                module, _, attr = cfg.runtime_factory.partition(":")
                runtime_factory = getattr(importlib.import_module(module), attr)
            else:
                runtime_factory = _default_factory
        started = time.perf_counter()
        factory, source = runtime_factory, source or ModelSource(cfg.model_dir)
        self.rt = call_with_timeout(lambda: factory(cfg, source), cfg.startup_timeout_s, "frontend runtime")
        self.compute = ComputeExecutor(cfg.threads, name="frontend")
        self.pronunciation = PronunciationService(cfg.pronunciation)
        settle_replica(cfg.gc_freeze)
        logger.info("frontend ready (%s) in %.1f s", self.rt.family, time.perf_counter() - started)

    # ---------------------------------------------------------------- handle API
    async def prepare(self, req: SynthesisRequest) -> PreparedRequest:
        """Validate, normalise, split and tokenise; resolve the prompt for ``req.mode``."""
        return await self._run(self._prepare, req)

    async def prepare_bistream(self, req: SynthesisRequest) -> PreparedRequest:
        """The prompt of a bistream (text-in streaming) request of a registered voice; its text
        follows as fragments (:meth:`tokenize_fragment`), so ``pieces`` is empty."""
        return await self._run(self._prepare_bistream, req)

    async def tokenize_fragment(self, text: str) -> np.ndarray:
        """Text ids of one bistream fragment, tokenised on its own and NOT normalised (spec §3.8:
        the official frontend passes a text generator through untouched)."""
        return await self._run(self.rt.tokenize, text)

    async def register_voice(self, voice_id: str, prompt_text: str, audio: np.ndarray, sample_rate: int,
                             overwrite: bool = False, access: VoiceAccess | None = None) -> VoiceInfo:
        access = access or VoiceAccess()
        check_voice_id(voice_id)
        if not prompt_text or not prompt_text.strip():
            raise InvalidInputError("prompt_text (the transcript of the audio) is required")
        if voice_id in self.rt.list_voices():  # cheap early answer; the store decides atomically
            if not overwrite:
                raise VoiceExistsError(f"voice '{voice_id}' already exists")
            # NOTE: checked here, not in the store's commit: two keys replacing one id at once race
            # (last write wins), as two replicas registering it always did.
            if not access.may_change(_owner(await self._run(self.rt.load_voice, voice_id))):
                raise VoiceExistsError(f"voice '{voice_id}' already exists and is not yours to replace")
        prompt = await self._run(self._prompt_from_audio, audio, sample_rate, prompt_text)
        prompt.meta = {k: v for k, v in prompt.meta.items() if k != OWNER_META_KEY}
        if access.owner is not None:
            prompt.meta[OWNER_META_KEY] = access.owner
        await self._run(self.rt.save_voice, voice_id, prompt, overwrite)
        return _info(voice_id, prompt)

    async def list_voices(self, access: VoiceAccess | None = None) -> list[VoiceInfo]:
        """Every readable voice the caller may see; one that cannot be loaded (deleted meanwhile,
        unreadable) is left out."""
        ids = await self._run(self.rt.list_voices)
        infos = []
        for voice_id in sorted(ids):
            try:
                prompt = await self._run(self.rt.load_voice, check_voice_id(voice_id))
            except (VoiceNotFoundError, InvalidInputError) as exc:
                logger.warning("listing voices: skipped %s: %s", voice_id, exc)
                continue
            if access is None or access.may_see(_owner(prompt)):
                infos.append(_info(voice_id, prompt))
        return infos

    async def get_voice(self, voice_id: str, access: VoiceAccess | None = None) -> VoiceInfo:
        check_voice_id(voice_id)
        return _info(voice_id, self._visible(voice_id, await self._run(self.rt.load_voice, voice_id), access))

    async def delete_voice(self, voice_id: str, access: VoiceAccess | None = None) -> None:
        access = access or VoiceAccess()
        check_voice_id(voice_id)
        if voice_id not in self.rt.list_voices():
            raise VoiceNotFoundError(f"voice '{voice_id}' not found")
        owner = _owner(self._visible(voice_id, await self._run(self.rt.load_voice, voice_id), access))
        if not access.may_change(owner):
            raise VoiceForbiddenError(f"voice '{voice_id}' is shared: only an admin key may delete it")
        await self._run(self.rt.delete_voice, voice_id)

    @staticmethod
    def _visible(voice_id: str, prompt: VoicePrompt, access: VoiceAccess | None) -> VoicePrompt:
        """``prompt``, or the unknown-voice error when the caller may not see it."""
        if access is not None and not access.may_see(_owner(prompt)):
            raise VoiceNotFoundError(f"voice '{voice_id}' not found")
        return prompt

    async def status(self) -> dict:
        """This replica's id and whether its voice and pronunciation stores accept writes:
        ``/health``'s background probe (it also sets the ingress's frontend handle up before a
        user's first request needs it). Each store check creates and removes one small file."""
        where, problem = await self._run(self.rt.voice_store_status)
        lexicons, lexicons_problem = await self._run(self.pronunciation.store_status)
        return {"replica_id": replica_id(),
                "voice_store": {"path": where, "writable": problem is None, "error": problem},
                "pronunciation_store": {"path": lexicons, "writable": lexicons_problem is None,
                                        "error": lexicons_problem}}

    async def _run(self, fn, *args):
        """Blocking runtime work on the executor; runtime errors made portable across Ray."""
        try:
            return await self.compute.run(fn, *args)
        except CosyVoiceError as exc:
            portable = portable_error(exc)
            if portable is exc:
                raise
            raise portable from None

    def check_health(self) -> None:
        pass  # stateless CPU work: a replica that answers is healthy

    @classmethod
    def deployment_options(cls, cfg: FrontendConfig) -> dict[str, Any]:
        return cfg.serve_options("TextFrontend")

    # ---------------------------------------------------------------- blocking parts (executor)
    def _prompt_from_audio(self, audio: np.ndarray, sample_rate: int, prompt_text: str) -> VoicePrompt:
        duration = len(audio) / float(sample_rate)
        if duration > self.cfg.max_prompt_audio_s:
            raise PayloadTooLargeError(
                f"prompt audio is {duration:.1f} s; the limit is {self.cfg.max_prompt_audio_s} s")
        if duration < self.cfg.min_prompt_audio_s:
            raise InvalidInputError(
                f"prompt audio is {duration:.2f} s; at least {self.cfg.min_prompt_audio_s} s needed")
        return self.rt.prompt_from_audio(audio, sample_rate, self._with_cv3_prefix(prompt_text))

    def _with_cv3_prefix(self, text: str) -> str:
        return with_cv3_prefix(self.rt.family, text, self.cfg.cv3_system_prompt)

    def _resolve_prompt(self, req: SynthesisRequest, need_transcript: bool) -> VoicePrompt:
        if req.prompt_audio is not None:
            if req.voice_id:
                raise InvalidInputError("give either a voice or prompt audio, not both")
            if need_transcript and not (req.prompt_text and req.prompt_text.strip()):
                raise InvalidInputError("zero-shot synthesis needs prompt_text, the transcript of the prompt audio")
            return self._prompt_from_audio(req.prompt_audio, int(req.prompt_sample_rate or 0) or 1,
                                           req.prompt_text or "")
        if req.voice_id:
            check_voice_id(req.voice_id)
            return self._visible(req.voice_id, self.rt.load_voice(req.voice_id), req.access)
        raise InvalidInputError(f"mode '{req.mode.value}' needs a voice or prompt audio")

    def _prepare(self, req: SynthesisRequest) -> PreparedRequest:
        text = (req.text or "").strip()
        if not text:
            raise InvalidInputError("input text is empty")
        text = self.pronunciation.rewrite(text, req.pronunciation, req.access)  # before normalisation
        mode = SynthesisMode(req.mode)
        rule = MODES[mode.value]  # what the LLM reads before the text (spec §1.2)
        if mode == SynthesisMode.ZERO_SHOT and req.prompt_audio is None:
            raise InvalidInputError("zero-shot synthesis needs prompt audio")
        if mode == SynthesisMode.VOICE and not req.voice_id:
            raise InvalidInputError("voice synthesis needs a voice id")
        if mode == SynthesisMode.INSTRUCT and not (req.instruct_text and req.instruct_text.strip()):
            raise InvalidInputError("instruct synthesis needs instruct_text")
        prompt = self._resolve_prompt(req, need_transcript=rule.transcript)
        if rule.transcript:
            llm_text_ids = prompt.text_tokens
        elif mode == SynthesisMode.INSTRUCT:
            llm_text_ids = self.rt.tokenize(instruct_prompt(req.instruct_text))  # verbatim, not normalised
        else:  # cross-lingual: no transcript, and CosyVoice3's prefix goes before the text itself
            llm_text_ids = np.zeros(0, dtype=np.int32)
            text = self._with_cv3_prefix(text)
        use_speech = rule.speech
        if prompt.family != self.rt.family:
            raise InvalidInputError(f"voice was made for {prompt.family}, this model is {self.rt.family}")
        pieces = [TextPiece(text=t, text_ids=self.rt.tokenize(t)) for t in self.rt.split(text)]
        pieces = [p for p in pieces if p.text_ids.size]
        if not pieces:
            raise InvalidInputError("input text has nothing to speak after normalisation")
        if len(pieces) > self.cfg.max_pieces:
            raise PayloadTooLargeError(f"input splits into {len(pieces)} pieces; the limit is {self.cfg.max_pieces}")
        return PreparedRequest(request_id=req.request_id, pieces=pieces, prompt=prompt,
                               llm_prompt_text_ids=np.asarray(llm_text_ids, dtype=np.int32),
                               llm_use_prompt_speech=use_speech, speed=req.speed, stream=req.stream, seed=req.seed)


    def _prepare_bistream(self, req: SynthesisRequest) -> PreparedRequest:
        if not req.voice_id:
            raise InvalidInputError("text-in streaming needs a voice id")
        prompt = self._resolve_prompt(req, need_transcript=True)
        if prompt.family != self.rt.family:
            raise InvalidInputError(f"voice was made for {prompt.family}, this model is {self.rt.family}")
        ids = np.asarray(prompt.text_tokens, dtype=np.int32)
        if self.rt.family == "cosyvoice3" and ENDOFPROMPT_TOKEN_ID not in ids:
            # CV3 bistream feeds the prompt up to <|endofprompt|> first (a voice stored without it)
            ids = np.concatenate([self.rt.tokenize(self._with_cv3_prefix("")), ids]).astype(np.int32)
        return PreparedRequest(request_id=req.request_id, pieces=[], prompt=prompt, llm_prompt_text_ids=ids,
                               llm_use_prompt_speech=True, speed=req.speed, stream=True, seed=req.seed)


def _owner(prompt: VoicePrompt) -> str | None:
    owner = (prompt.meta or {}).get(OWNER_META_KEY)
    return str(owner) if owner is not None else None


def _info(voice_id: str, prompt: VoicePrompt) -> VoiceInfo:
    return VoiceInfo(voice_id=voice_id, prompt_text=prompt.text, family=prompt.family,
                     num_prompt_tokens=len(prompt.speech_tokens))
