"""The voice-agent frameworks' own client classes against a local service (docs/voice-agents.md):
LiveKit Agents' elevenlabs and openai TTS plugins, Pipecat's ElevenLabs (WebSocket and HTTP) and
OpenAI services, each streamed and not where the framework offers both, with keys required
(``xi-api-key`` for the ElevenLabs clients, ``Authorization: Bearer`` for the OpenAI ones).

The service is the in-process app on the test fakes (tests/deployments/fakes.py: 2 speech tokens
per text byte, 40 ms a token), served by uvicorn on a local port, since the frameworks bring
their own HTTP and WebSocket clients (aiohttp). Timestamps are checked where the client asks for
them: LiveKit's timed transcripts and Pipecat's word frames carry every word of the text, in
order. The frameworks are in the ``dev`` extra; without them these tests skip.
"""
from __future__ import annotations

import asyncio
import re
import socket
import threading

import numpy as np
import pytest

from deployments import constants
from serve_app.ingress import IngressConfig
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress

KEY = "sk-synth-0123456789abcdef"
TEXT = "Hello there. How are you?"
WORDS = TEXT.split()
PER_BYTE = fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN  # the fake tokenizer: a text id per UTF-8 byte
SAMPLES = len(TEXT.encode()) * PER_BYTE  # WebSocket (bistream): the text as sent
PIECE_SAMPLES = len(TEXT.replace(". ", ".").encode()) * PER_BYTE  # HTTP: two sentence pieces, stripped
FRAME_PAD = fakes.SAMPLE_RATE // 20  # a client's last audio frame may be padded (<= 50 ms)

aiohttp = pytest.importorskip("aiohttp")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture
def port(monkeypatch):
    """The app on 127.0.0.1:<port> (its socket listens before the server starts: no wait needed)."""
    monkeypatch.setenv(constants.ENV_API_KEYS, f"{KEY}:synthesis+voices")
    ingress = _ingress(IngressConfig(max_input_chars=1000))
    asyncio.run(ingress.frontend._target.register_voice("default", "hi", np.full(16000, 0.1, np.float32), 16000))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(ingress.__serve_build_asgi_app__(), log_level="warning",
                                           ws="websockets-sansio"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join()
    sock.close()


def _words(text: str) -> list[str]:
    return re.findall(r"\S+", text)


# ------------------------------------------------------------------------------ LiveKit Agents
def test_livekit_elevenlabs_plugin_synthesize_and_stream(port):
    """``TTS.synthesize`` (HTTP ``/stream``) and ``TTS.stream`` (WebSocket ``multi-stream-input``,
    its timed transcripts on)."""
    elevenlabs = pytest.importorskip("livekit.plugins.elevenlabs")

    async def main():
        async with aiohttp.ClientSession() as http:
            tts = elevenlabs.TTS(api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", voice_id="alloy",
                                 model="eleven_flash_v2_5", encoding="pcm_24000", http_session=http)
            whole = [ev.frame async for ev in tts.synthesize(TEXT)]
            stream = tts.stream()
            for word in TEXT.split(" "):
                stream.push_text(word + " ")
            stream.end_input()
            streamed = [ev.frame async for ev in stream]
            await tts.aclose()
            return whole, streamed

    whole, streamed = asyncio.run(main())
    n_whole = sum(f.samples_per_channel for f in whole)
    assert all(f.sample_rate == 24000 for f in whole + streamed)
    assert PIECE_SAMPLES <= n_whole <= PIECE_SAMPLES + FRAME_PAD
    n_streamed = sum(f.samples_per_channel for f in streamed)
    assert SAMPLES <= n_streamed <= SAMPLES + FRAME_PAD + PER_BYTE  # the plugin may send a trailing space
    timed = [t for f in streamed for t in (f.userdata or {}).get("lk.timed_transcripts", [])]
    assert _words("".join(str(t) for t in timed)) == WORDS  # every word, in order


def test_livekit_openai_plugin_synthesize_and_stream_adapter(port):
    """``openai.TTS.synthesize`` and the framework's own ``StreamAdapter`` (sentence by sentence)."""
    openai = pytest.importorskip("livekit.plugins.openai")
    from livekit.agents import tokenize
    from livekit.agents.tts import StreamAdapter

    async def main():
        tts = openai.TTS(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, model="tts-1", voice="alloy",
                         response_format="pcm")
        whole = [ev.frame async for ev in tts.synthesize(TEXT)]
        adapter = StreamAdapter(tts=tts, sentence_tokenizer=tokenize.basic.SentenceTokenizer())
        stream = adapter.stream()
        stream.push_text(TEXT)
        stream.end_input()
        streamed = [ev.frame async for ev in stream]
        await adapter.aclose()
        await tts.aclose()
        return whole, streamed

    whole, streamed = asyncio.run(main())
    assert PIECE_SAMPLES <= sum(f.samples_per_channel for f in whole) <= PIECE_SAMPLES + FRAME_PAD
    assert PIECE_SAMPLES <= sum(f.samples_per_channel for f in streamed) <= PIECE_SAMPLES + 2 * FRAME_PAD


# ------------------------------------------------------------------------------ Pipecat
def _pipecat_run(make) -> tuple[bytes, list[tuple[str, int | None]]]:
    """Pipecat's own test pipeline around the service ``make(aiohttp_session)`` returns: one
    TTSSpeakFrame in; its audio and its word frames (text, presentation time) out."""
    from pipecat.frames.frames import TTSAudioRawFrame, TTSSpeakFrame, TTSTextFrame
    from pipecat.tests.utils import run_test

    async def main():
        async with aiohttp.ClientSession() as http:
            down, _ = await run_test(make(http), frames_to_send=[TTSSpeakFrame(TEXT)])
        audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
        return audio, [(f.text, f.pts) for f in down if isinstance(f, TTSTextFrame)]

    return asyncio.run(main())


@pytest.mark.parametrize("transport", ["websocket", "http"])
def test_pipecat_elevenlabs_services(port, transport):
    """``ElevenLabsTTSService`` (``multi-stream-input``) and ``ElevenLabsHttpTTSService``
    (``/stream/with-timestamps``): audio, and word frames timed from the alignment."""
    tts = pytest.importorskip("pipecat.services.elevenlabs.tts")
    if transport == "websocket":
        def make(http):
            return tts.ElevenLabsTTSService(api_key=KEY, url=f"ws://127.0.0.1:{port}", sample_rate=24000,
                                            settings=tts.ElevenLabsTTSService.Settings(voice="alloy"))
    else:
        def make(http):
            return tts.ElevenLabsHttpTTSService(api_key=KEY, base_url=f"http://127.0.0.1:{port}", aiohttp_session=http,
                                                sample_rate=24000,
                                                settings=tts.ElevenLabsHttpTTSService.Settings(voice="alloy"))
    audio, words = _pipecat_run(make)
    assert len(audio) == 2 * (SAMPLES if transport == "websocket" else PIECE_SAMPLES)
    assert [w for w, _ in words] == WORDS
    times = [t for _, t in words]
    assert None not in times and times == sorted(times) and times[0] < times[-1]


def test_pipecat_openai_service(port):
    tts = pytest.importorskip("pipecat.services.openai.tts")
    audio, words = _pipecat_run(lambda http: tts.OpenAITTSService(
        api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", sample_rate=24000,
        settings=tts.OpenAITTSService.Settings(voice="alloy")))
    assert len(audio) == 2 * PIECE_SAMPLES and [w for w, _ in words] == [TEXT]  # no timestamps on this API
