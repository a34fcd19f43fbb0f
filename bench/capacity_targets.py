"""Where ``bench/capacity.py`` sends its requests, and what it samples beside them.

* :class:`HttpTarget`: the whole Serve application, ``POST /v1/audio/speech`` streaming raw PCM;
  time to first audio is the first body byte (raw PCM has no header: every byte is audio).
* :class:`InProcessTarget`: the config's frontend and synthesizer objects in this process.

What is sampled beside the requests (counters, GPU utilisation) is in ``bench/capacity_counters.py``.
"""
from __future__ import annotations

import asyncio
import io
import random
import ssl
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import soundfile as sf
from prometheus_client.parser import text_string_to_metric_families

from bench.capacity_counters import gc_counters, process_counters, scraped_durations, thread_counters
from bench.metrics import RequestTrace, percentile
from bench.workload import PROMPT_RATE, Utterance, VoiceSpec
from deployments.protocol import SynthesisRequest
from deployments.python_gc import SLOW_PAUSE_S
from deployments.thread_load import SLOW_WAIT_S
from serve_app.stage_timing import first_audio_stages, parse_server_timing

PCM_RATE = 24000
TOKENS_PER_S = 25  # speech tokens per second of audio (both families)
# Random weights rarely emit the end token, so a served request decodes to its length limit: 20
# speech tokens per text token (0.8 s of audio). A one-word text of k letters the tiny tokenizer
# keeps as k tokens (none of them starts a merge) asks for ~0.8 k s: lengths are quantised to 0.8 s.
SECONDS_PER_TEXT_TOKEN = 20 / TOKENS_PER_S
_LETTERS = "bcdfgjklmpquvwxyz"


def _resolve(fut: asyncio.Future, trace: RequestTrace) -> None:
    if not fut.done():
        fut.set_result(trace)


def _ms_at(seconds: list[float], q: float) -> float | None:
    """The ``q``-th percentile in milliseconds (None when nothing was timed)."""
    return round(percentile(seconds, q) * 1e3, 2) if seconds else None


def text_for(audio_s: float, rng: random.Random) -> str:
    """A one-word text that makes the random-weight service speak about ``audio_s`` seconds."""
    k = max(2, round(audio_s / SECONDS_PER_TEXT_TOKEN))
    return "".join(rng.choice(_LETTERS) for _ in range(k))


class HttpTarget:
    """Streaming PCM requests to a running service, a connection per request (as separate voice
    agents would open them; a client of its own also keeps each probe's event loop separate)."""

    def __init__(self, base_url: str, voice: str, timeout_s: float = 120.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.voice = voice
        self.timeout_s = timeout_s
        self.transport = transport  # tests: an in-process ASGI app
        # One TLS context for every client: httpx builds one per client otherwise, loading the CA
        # bundle (16 ms on the 2-core VM, 2026-12-04) on the probe's event loop at every request,
        # which delayed the other sessions' chunk times and counted into their first audio.
        self._tls = ssl.create_default_context()

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, verify=self._tls,
                                 transport=self.transport)

    async def add_voice(self, spec: VoiceSpec) -> None:
        """``POST /v1/voices`` with the voice's prompt (overwriting a voice of that id)."""
        async with self._client() as client:
            r = await client.post("/v1/voices", files={"audio": (f"{spec.voice_id}.wav", spec.wav(), "audio/wav")},
                                  data={"voice_id": spec.voice_id, "prompt_text": spec.prompt_text, "overwrite": "true"})
        if r.status_code != 201:
            raise RuntimeError(f"registering voice {spec.voice_id}: HTTP {r.status_code} {r.text[:200]}")

    async def remove_voice(self, voice_id: str) -> None:
        async with self._client() as client:
            r = await client.delete(f"/v1/voices/{voice_id}")
        if r.status_code >= 300:
            raise RuntimeError(f"removing voice {voice_id}: HTTP {r.status_code} {r.text[:200]}")

    async def synthesize(self, rid: str, request: Utterance | float, submitted_s: float) -> RequestTrace:
        request = Utterance.of(request)
        trace = RequestTrace(submitted_s=submitted_s, sample_rate=PCM_RATE)
        body = {"model": "tts-1", "input": request.text or text_for(request.drawn_s, random.Random(rid)),
                "voice": request.voice.voice_id if request.voice else self.voice, "response_format": "pcm",
                "stream": True}
        carry = 0  # a chunk boundary may split a 16-bit sample
        try:
            async with (self._client() as client,
                        client.stream("POST", "/v1/audio/speech", json=body) as resp):
                if resp.status_code != 200:
                    trace.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return trace
                trace.stages_ms = parse_server_timing(resp.headers.get("server-timing", ""))
                async for data in resp.aiter_raw():
                    total = carry + len(data)
                    if total // 2:
                        trace.add_chunk(time.perf_counter(), total // 2)
                    carry = total % 2
        except httpx.HTTPError as exc:
            trace.error = f"{type(exc).__name__}: {exc}"
        if trace.error is None and not trace.chunk_times_s:
            trace.error = "empty body"
        return trace

    async def counters(self) -> dict[str, float]:
        """The synthesizer's counters from the service's ``/metrics`` (summed over the replicas a
        scrape shows), to difference around a probe."""
        async with self._client() as client:
            text = (await client.get("/metrics")).text
        gc_families = {"tts_gc_pause_seconds": "gc", "tts_ingress_gc_pause_seconds": "ingress_gc"}
        out = {"graph_captures": 0.0, "graph_misses": 0.0}
        cpu_s: dict[str, float] = {}
        gil = None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "tts_cuda_graph_captures_total":
                    out["graph_captures"] += sample.value
                elif sample.name == "tts_cuda_graph_misses_total":
                    out["graph_misses"] += sample.value
                elif sample.name in ("tts_flow_passes_total", "tts_flow_rows_in_passes_total",
                                     "tts_flow_rows_ready_total", "tts_flow_prompt_prefix_hits_total",
                                     "tts_flow_prompt_prefix_misses_total"):
                    key = sample.name.removeprefix("tts_").removesuffix("_total")
                    out[key] = out.get(key, 0.0) + sample.value
                elif sample.name == "tts_flow_prompt_cache_budget_bytes":  # a level, not differenced
                    out["prompt_cache_gib"] = out.get("prompt_cache_gib", 0.0) + sample.value / 1024**3
                elif sample.name == "tts_thread_cpu_seconds_total":
                    cpu_s[sample.labels["thread"]] = cpu_s.get(sample.labels["thread"], 0.0) + sample.value
            if family.name == "tts_gil_wait_seconds":
                gil = scraped_durations(family.samples, SLOW_WAIT_S)
            elif family.name in gc_families:
                by_gen: dict[str, list] = {}
                for sample in family.samples:
                    by_gen.setdefault(sample.labels["generation"], []).append(sample)
                gens = {g: scraped_durations(samples, SLOW_PAUSE_S) for g, samples in by_gen.items()}
                snapshot = {"by_generation": gens, "slow": sum(g["slow"] for g in gens.values())}
                out.update(gc_counters(snapshot, prefix=gc_families[family.name]))
        gil = gil or {"count": 0.0, "seconds": 0.0, "slow": 0.0}
        if cpu_s or gil["count"]:
            out.update(thread_counters(cpu_s, gil))
        return out


class InProcessTarget:
    """The service's own frontend and synthesizer objects in this process, without Ray or HTTP
    (``--level synth``). Beside ``--level serve`` at the same load it separates what Ray's hops
    and the HTTP path cost from what the deployments' code does. Both objects live on an event
    loop thread of their own for the whole run, as in a replica; a probe's loop awaits them (the
    load generator shares their process and GIL, a small share: no HTTP, no audio encoding).

    Args:
        make: a coroutine function returning ``(frontend, synthesizer)``, run on that loop (their
            constructors see a running loop, as in Serve).
        voice: the registered voice the requests use (see :meth:`register`).
    """

    def __init__(self, make: Callable[[], Awaitable[tuple[Any, Any]]], voice: str) -> None:
        self.voice = voice
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="synth-level-loop", daemon=True).start()
        self.frontend, self.synth = self.call(make())

    def call(self, coro) -> Any:
        """Run ``coro`` on the target's loop and wait for it (set-up, from outside any loop)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def register(self, prompt_wav: bytes, prompt_text: str) -> None:
        audio, rate = sf.read(io.BytesIO(prompt_wav), dtype="float32")
        self.call(self.frontend.register_voice(self.voice, prompt_text, audio, rate, True))

    async def _on_loop(self, coro) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def add_voice(self, spec: VoiceSpec) -> None:
        await self._on_loop(self.frontend.register_voice(spec.voice_id, spec.prompt_text, spec.audio(), PROMPT_RATE,
                                                         True))

    async def remove_voice(self, voice_id: str) -> None:
        await self._on_loop(self.frontend.delete_voice(voice_id))

    async def synthesize(self, rid: str, request: Utterance | float, submitted_s: float) -> RequestTrace:
        return await self._on_loop(self._one(rid, request, submitted_s))

    async def _one(self, rid: str, request: Utterance | float, submitted_s: float) -> RequestTrace:
        request = Utterance.of(request)
        trace = RequestTrace(submitted_s=submitted_s)
        req = SynthesisRequest(request_id=rid, text=request.text or text_for(request.drawn_s, random.Random(rid)),
                               voice_id=request.voice.voice_id if request.voice else self.voice, stream=True)
        try:  # the ingress's path (serve_app.ingress._synthesize), its handle calls made directly
            started = time.perf_counter()
            prepared = await self.frontend.prepare(req)
            prepared_at = time.perf_counter()
            stamped = None  # the synthesizer's first chunk carries the stage stamps
            async for chunk in self.synth.synthesize(prepared):
                now = time.perf_counter()
                stamped = stamped or chunk
                if not chunk.samples.size:  # first audio is timed at a chunk with samples, as over HTTP
                    continue
                if not trace.chunk_times_s:
                    trace.sample_rate = chunk.sample_rate
                    trace.stages_ms = first_audio_stages(started, prepared_at, now, stamped)
                trace.add_chunk(now, chunk.samples.size)
        except Exception as exc:  # noqa: BLE001 - a failed request is a probe's result, not the tool's end
            trace.error = f"{type(exc).__name__}: {exc}"
        if trace.error is None and not trace.chunk_times_s:
            trace.error = "no audio"
        return trace

    async def counters(self) -> dict[str, float]:
        stats = self.synth.stats()  # the stepped token2wav's passes, as /metrics has them at the serve level
        return {**process_counters(), "flow_passes": float(stats["flow_passes_total"]),
                "flow_rows_in_passes": float(stats["flow_rows_in_passes_total"]),
                "flow_rows_ready": float(stats["flow_rows_ready_total"]),
                "flow_prompt_prefix_hits": float(stats["flow_prompt_prefix_hits_total"]),
                "flow_prompt_prefix_misses": float(stats["flow_prompt_prefix_misses_total"]),
                "prompt_cache_gib": float(stats["flow_prompt_cache_budget_bytes"]) / 1024**3}

    def close(self) -> None:
        """Cancel what still runs on the target's loop (the synthesizer's background tasks), then stop it."""
        async def cancel_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.call(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)

