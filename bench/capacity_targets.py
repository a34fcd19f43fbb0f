"""Where ``bench/capacity.py`` sends its requests, and what it samples beside them.

* :class:`SimTarget`: the replica simulation of ``bench/replica_sim.py`` (continuous-batching
  engine thread + token2wav thread around one model, each on its own CUDA stream), in process;
  a request decodes exactly the speech tokens of its drawn length (no text is read: random ids
  stand for it; a voice of the workload's pool is random prompt features of its length).
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
import statistics
import threading
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import soundfile as sf
import torch
from prometheus_client.parser import text_string_to_metric_families

from bench.capacity_counters import _scraped_durations, gc_counters, process_counters, thread_counters
from bench.metrics import RequestTrace, percentile
from bench.replica_sim import ReplicaSim
from bench.workload import PROMPT_RATE, Utterance, VoiceSpec
from cosyvoice_runtime.voice_prompt import VoicePrompt
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


class SimTarget:
    """Requests into a running :class:`ReplicaSim`; the sim is shared by all probes of a search."""

    def __init__(self, sim: ReplicaSim, voice: VoicePrompt, text_tokens_per_s: float = 4.0) -> None:
        self.sim = sim
        self.voice = voice
        self.text_tokens_per_s = text_tokens_per_s  # prompt-text length grows with the utterance (prefill)
        self.voices: dict[str, VoicePrompt] = {}  # the workload's pool and cold voices
        self._waiting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._lock = threading.Lock()
        sim.on_error = self._fail_all

    async def add_voice(self, spec: VoiceSpec) -> None:
        """Random prompt features of the voice's prompt length, seeded by its content."""
        g = torch.Generator().manual_seed(zlib.crc32(spec.content.encode()))
        s, n = self.sim.model.spec, max(2, round(spec.prompt_s * TOKENS_PER_S))
        n_text = max(2, round(spec.prompt_s * self.text_tokens_per_s))
        self.voices[spec.voice_id] = VoicePrompt(
            family=s.family, text_tokens=torch.randint(0, 150000, (n_text,), generator=g, dtype=torch.int32).numpy(),
            speech_tokens=torch.randint(0, s.llm.speech_token_size, (n,), generator=g, dtype=torch.int32).numpy(),
            mel=torch.randn(2 * n, s.flow.output_size, generator=g).numpy(),
            embedding=torch.randn(s.flow.spk_embed_dim, generator=g).numpy().astype(np.float32))

    async def remove_voice(self, voice_id: str) -> None:
        self.voices.pop(voice_id, None)

    async def synthesize(self, rid: str, request: Utterance | float, submitted_s: float) -> RequestTrace:
        request = Utterance.of(request)
        voice = self.voices[request.voice.voice_id] if request.voice else self.voice
        n_tokens = max(2, round(request.drawn_s * TOKENS_PER_S))
        n_text = max(4, round(request.drawn_s * self.text_tokens_per_s))
        text = torch.randint(0, 150000, (n_text,), generator=torch.Generator().manual_seed(hash(rid) % 2**31))
        if self.sim.model.spec.family == "cosyvoice3":
            text[0] = 151646  # <|endofprompt|> must be present
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self.sim.error is not None:
                return RequestTrace(submitted_s=submitted_s, error=f"replica failed: {self.sim.error!r}")
            self._waiting[rid] = (loop, fut)
        self.sim.submit(rid, voice, text.to(self.sim.model.device), submitted_s, n_tokens=n_tokens,
                        on_finish=lambda st: self._finish(rid, st.trace))
        return await fut

    @property
    def failed(self) -> BaseException | None:
        """The replica's own failure (a worker thread died): no later probe means anything."""
        return self.sim.error

    async def counters(self) -> dict[str, float]:
        """The replica's counters that a probe reports as its increments (see :func:`counter_deltas`)."""
        return process_counters()

    def _finish(self, rid: str, trace: RequestTrace) -> None:
        with self._lock:
            loop, fut = self._waiting.pop(rid)
        loop.call_soon_threadsafe(_resolve, fut, trace)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            waiting, self._waiting = self._waiting, {}
        for rid, (loop, fut) in waiting.items():
            trace = self.sim.streams[rid].trace
            trace.error = f"replica failed: {exc!r}"
            loop.call_soon_threadsafe(_resolve, fut, trace)

    def lane_stats(self, t0: float, t1: float) -> dict:
        """Where the replica's time went between ``t0`` and ``t1``: decode steps and token2wav
        batches (``t2w_*`` the bulk lane, ``express_*`` the express lane when there is one)."""
        steps = [e - s for s, e in self.sim.step_log if t0 <= s < t1]
        batches = [(e - s, n, f) for s, e, n, f, lane in self.sim.batch_log if t0 <= s < t1 and lane == "bulk"]
        express = [(e - s, n, f) for s, e, n, f, lane in self.sim.batch_log if t0 <= s < t1 and lane == "express"]
        span = max(t1 - t0, 1e-9)
        new = [s for s in self.sim.streams.values() if t0 <= s.trace.submitted_s < t1]
        token = [s.first_token_s - s.trace.submitted_s for s in new if s.first_token_s]
        job = [s.first_job_s - s.trace.submitted_s for s in new if s.first_job_s]
        bulk_s, express_s = [b[0] for b in batches], [b[0] for b in express]
        passes = [(n, ready) for s, _, n, _, ready in self.sim.pass_log if t0 <= s < t1]
        return {  # first audio = first token + the rest of the first chunk's tokens + wait + first job
                "first_token_ms_p50": _ms_at(token, 50), "first_token_ms_p99": _ms_at(token, 99),
                "first_job_start_ms_p50": _ms_at(job, 50), "first_job_start_ms_p99": _ms_at(job, 99),
                "decode_step_ms_p50": _ms_at(steps, 50), "decode_step_ms_p99": _ms_at(steps, 99),
                "t2w_batch_ms_p50": _ms_at(bulk_s, 50), "t2w_batch_ms_p99": _ms_at(bulk_s, 99),
                "t2w_jobs_per_batch": round(statistics.mean(b[1] for b in batches), 2) if batches else None,
                "t2w_busy_fraction": round(sum(bulk_s) / span, 3),
                "first_chunk_jobs": sum(b[2] for b in batches + express),
                "express_batch_ms_p50": _ms_at(express_s, 50), "express_batch_ms_p99": _ms_at(express_s, 99),
                "express_busy_fraction": round(sum(express_s) / span, 3) if express else None,
                # stepped lane: flow passes and rows per pass (its t2w_* figures time the vocoder only)
                "flow_passes": len(passes) if passes else None,
                "flow_rows_per_pass": round(statistics.mean(n for n, _ in passes), 2) if passes else None,
                "flow_rows_ready_per_pass": round(statistics.mean(r for _, r in passes), 2) if passes else None,
                **self._flow_work(new)}

    def _flow_work(self, new: list) -> dict:
        """Flow work per second of audio of the span's finished requests (estimator frames: what the
        incremental flow and the prompt prefixes cut), and the most the token2wav's caches held since
        the last probe (its peak is reset here)."""
        done = [s for s in new if s.state.finished and s.trace.audio_s]
        audio_s = sum(s.trace.audio_s for s in done)
        t2w = self.sim.t2w
        prefixes = t2w.prompt_prefixes
        peak, t2w.peak_cache_bytes = t2w.peak_cache_bytes, 0
        return {"flow_frames_per_audio_s": round(sum(s.state.flow_frames for s in done) / audio_s, 1) if done else None,
                "flow_cache_gib": round(peak / 2**30, 3), "flow_cache_fallbacks": t2w.flow_fallbacks,
                "prompt_prefix_hits": prefixes.hits if prefixes else 0}


    def timeline(self, t0: float, t1: float) -> dict:
        """Every decode step, token2wav batch and request of the span, in ms from ``t0`` (``--trace``):
        what a late first audio waited behind."""
        def ms(t):
            return None if t is None else round((t - t0) * 1e3, 2)

        sim = self.sim
        return {"steps": [(ms(s), ms(e)) for s, e in sim.step_log if t0 <= s < t1],
                "batches": [(ms(s), ms(e), n, f, lane) for s, e, n, f, lane in sim.batch_log if t0 <= s < t1],
                "passes": [(ms(s), ms(e), n, t) for s, e, n, t, _ in sim.pass_log if t0 <= s < t1],
                "chunks": [[ms(t) for t in st.trace.chunk_times_s] for st in list(sim.streams.values())
                           if t0 <= st.trace.submitted_s < t1],
                "requests": [{"submitted": ms(st.trace.submitted_s), "first_token": ms(st.first_token_s),
                              "first_job": ms(st.first_job_s), "first_audio": ms(st.trace.chunk_times_s[0] if st.trace.chunk_times_s else None),
                              "audio_s": st.trace.audio_s, "tokens": len(st.tokens)}
                             for st in list(sim.streams.values()) if t0 <= st.trace.submitted_s < t1]}


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
                                     "tts_flow_rows_ready_total"):
                    key = sample.name.removeprefix("tts_").removesuffix("_total")
                    out[key] = out.get(key, 0.0) + sample.value
                elif sample.name == "tts_thread_cpu_seconds_total":
                    cpu_s[sample.labels["thread"]] = cpu_s.get(sample.labels["thread"], 0.0) + sample.value
            if family.name == "tts_gil_wait_seconds":
                gil = _scraped_durations(family.samples, SLOW_WAIT_S)
            elif family.name in gc_families:
                by_gen: dict[str, list] = {}
                for sample in family.samples:
                    by_gen.setdefault(sample.labels["generation"], []).append(sample)
                gens = {g: _scraped_durations(samples, SLOW_PAUSE_S) for g, samples in by_gen.items()}
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
                "flow_rows_ready": float(stats["flow_rows_ready_total"])}

    def close(self) -> None:
        """Cancel what still runs on the target's loop (the synthesizer's background tasks), then stop it."""
        async def cancel_rest():
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        self.call(cancel_rest())
        self.loop.call_soon_threadsafe(self.loop.stop)

