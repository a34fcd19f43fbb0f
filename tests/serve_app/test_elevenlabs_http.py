"""ElevenLabs-compatible HTTP routes (serve_app/elevenlabs_http.py) in process, through the
official ``elevenlabs`` SDK's own client code where it is installed (the dev extra), with
``xi-api-key`` auth on: audio of every route, output formats, alignment, the error shape."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import wave

import av
import httpx
import numpy as np
import pytest

from deployments import constants
from deployments.protocol import InvalidInputError, TextMarks
from serve_app.alignment import PieceAligner, char_spans
from serve_app.elevenlabs import parse_output_format
from serve_app.ingress import IngressConfig
from tests.deployments import fakes
from tests.serve_app.test_ingress_inproc import _ingress, client

KEY = "sk-synth-0123456789abcdef"
OPS_KEY = "sk-ops-000000000000000000"
SR = fakes.SAMPLE_RATE
TEXT = "Hello there. How are you?"


def _samples(text: str) -> int:
    return len(text.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN


def _pieces_samples(text: str) -> int:  # the fake frontend splits at sentence ends and strips
    return sum(_samples(p) for p in ("Hello there.", "How are you?")) if text == TEXT else _samples(text)


def _run(app, fn):
    async def main():
        async with client(app) as c:
            return await fn(c)

    return asyncio.run(main())


@pytest.fixture
def voiced(monkeypatch):
    """An app whose `default` voice is a shared one (registered without a key, as built-in voices
    are: every key may use it; tests/serve_app/test_ingress_voice_owners.py has the owned ones)."""
    monkeypatch.setenv(constants.ENV_API_KEYS, f"{KEY},{OPS_KEY}:metrics")
    ingress = _ingress(IngressConfig(max_input_chars=1000))
    asyncio.run(ingress.frontend._target.register_voice("default", "hi", np.full(16000, 0.1, np.float32), 16000))
    return ingress.__serve_build_asgi_app__()


def _post(app, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"xi-api-key": key} if key else {}
    return _run(app, lambda c: c.post(path, json=body, headers=headers))


def test_every_route_gives_the_audio_with_xi_api_key(voiced):
    n = _pieces_samples(TEXT)
    for route in ("", "/stream"):
        r = _post(voiced, f"/v1/text-to-speech/alloy{route}?output_format=pcm_24000",
                  {"text": TEXT, "model_id": "eleven_flash_v2_5", "voice_settings": {"stability": 0.4},
                   "previous_text": "Before.", "next_text": "After.", "apply_text_normalization": "auto"})
        assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm" and len(r.content) == 2 * n
    r = _post(voiced, "/v1/text-to-speech/alloy/with-timestamps?output_format=pcm_16000", {"text": TEXT})
    body = r.json()
    assert set(body) == {"audio_base64", "alignment", "normalized_alignment"}
    audio_s = len(base64.b64decode(body["audio_base64"])) / 2 / 16000
    assert abs(audio_s - n / SR) < 0.01
    _check_alignment(body["alignment"], TEXT, audio_s)
    _check_alignment(body["normalized_alignment"], "Hello there. How are you?", audio_s)


def _check_alignment(a: dict, text: str, audio_s: float) -> None:
    """Monotonic, every character once and in order, within the audio."""
    chars, starts, ends = a["characters"], a["character_start_times_seconds"], a["character_end_times_seconds"]
    assert "".join(chars) == text and len(starts) == len(ends) == len(chars)
    assert all(s <= e for s, e in zip(starts, ends)) and starts == sorted(starts) and ends == sorted(ends)
    assert starts[0] == 0.0 and ends[-1] <= audio_s + 1e-3 and ends[-1] > 0.9 * audio_s


def test_stream_with_timestamps_is_ndjson_with_absolute_times(voiced):
    r = _post(voiced, "/v1/text-to-speech/default/stream/with-timestamps?output_format=pcm_24000",
              {"text": TEXT, "voice_settings": {"speed": 1.0}, "seed": 7})
    assert r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(x) for x in r.text.splitlines() if x]
    audio = b"".join(base64.b64decode(x["audio_base64"]) for x in lines)
    assert len(audio) == 2 * _pieces_samples(TEXT)
    spans = [x["alignment"] for x in lines if x["alignment"]]
    assert len(spans) > 2  # characters come with the chunks that start to say them, not per piece
    merged = {k: [v for s in spans for v in s[k]] for k in spans[0]}
    _check_alignment(merged, TEXT, len(audio) / 2 / SR)
    t = 0.0
    for x in lines:  # each line's characters start within its own audio (times are absolute)
        end = t + len(base64.b64decode(x["audio_base64"])) / 2 / SR
        if x["alignment"]:
            assert all(t - 1e-3 <= s <= end + 1e-3 for s in x["alignment"]["character_start_times_seconds"])
        t = end
    # the first piece's characters end where its audio ends
    first = merged["characters"].index("H", 1)  # "How": the second piece
    assert merged["character_end_times_seconds"][first - 2] == pytest.approx(_samples("Hello there.") / SR, abs=1e-3)


@pytest.mark.parametrize("fmt, codec, rate", [("mp3_22050_32", "mp3", 22050), ("opus_48000_64", "opus", 48000),
                                              ("wav_8000", "pcm_s16le", 8000), ("ulaw_8000", None, 8000),
                                              ("alaw_8000", None, 8000), ("pcm_32000", None, 32000)])
def test_output_formats(voiced, fmt, codec, rate):
    r = _post(voiced, f"/v1/text-to-speech/default?output_format={fmt}", {"text": "Hi."})
    assert r.status_code == 200, r.text
    n = _samples("Hi.") * rate // SR
    if codec is None:  # raw: 2 bytes a sample for PCM, 1 for G.711
        assert abs(len(r.content) // (1 if fmt[0] in "ua" else 2) - n) < 64
        return
    with av.open(io.BytesIO(r.content)) as c:
        assert c.streams.audio[0].codec_context.name.startswith(codec) and c.streams.audio[0].rate == rate
        y = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert abs(len(y) - n) < 2000
    if fmt.startswith("wav"):  # a whole WAV has its real sizes
        with wave.open(io.BytesIO(r.content)) as w:
            assert w.getnframes() == len(y)


def test_errors_in_elevenlabs_shape_and_auth(voiced):
    r = _post(voiced, "/v1/text-to-speech/nobody", {"text": "Hi."})
    assert r.status_code == 404 and r.json()["detail"]["status"] == "voice_not_found"
    assert set(r.json()["detail"]) == {"status", "message", "request_id"}
    r = _post(voiced, "/v1/text-to-speech/default?output_format=flac_44100", {"text": "Hi."})
    assert r.status_code == 400 and "output_format" in r.json()["detail"]["message"]
    r = _post(voiced, "/v1/text-to-speech/default", {"text": "Hi.", "voice_settings": {"speed": 9}})
    assert r.status_code == 400 and "speed" in r.json()["detail"]["message"]
    r = _post(voiced, "/v1/text-to-speech/default", {"text": "Hi."}, key=None)
    assert r.status_code == 401 and r.json()["detail"]["status"] == "missing_api_key"
    r = _post(voiced, "/v1/text-to-speech/default", {"text": "Hi."}, key=OPS_KEY)  # no synthesis scope
    assert r.status_code == 403 and r.json()["detail"]["status"] == "insufficient_scope"


def test_piece_aligner_maps_marked_tokens_back_to_the_characters_sent():
    # "2" was normalised to "two": its time is the span of "two"; characters follow their token marks
    aligner = PieceAligner("I have 2 cats. Yes!", [("I have two cats.", 4), ("Yes!", 2)])  # 4 characters a token
    a0, n0 = aligner.piece_chunk(0, TextMarks(0, [0.0, 0.25]), 0.0, 1.0, last=False)
    assert "".join(n0.chars) == "I have t" and n0.starts[0] == 0.0 and n0.starts[4] == 0.25 and n0.ends[-1] == 1.0
    assert "".join(a0.chars) == "I have "  # "2" is out once all of "two" is
    a1, n1 = aligner.piece_chunk(0, TextMarks(2, [0.0, 0.5]), 1.0, 2.0, last=True)
    assert "".join(n1.chars) == "wo cats." and n1.starts[0] == 1.0 and n1.ends[-1] == 2.0
    assert a1.chars[0] == "2" and a1.starts[0] == n0.starts[-1] and a1.ends[0] == n1.ends[1]
    a2, n2 = aligner.piece_chunk(1, None, 2.0, 2.5, last=True)  # no marks: the rest spreads over the chunk
    rest, _ = aligner.finish(2.5)
    assert "".join(a0.chars + a1.chars + a2.chars + rest.chars) == "I have 2 cats. Yes!"
    assert "".join(n0.chars + n1.chars + n2.chars) == "I have two cats. Yes!" and n2.ends[-1] == 2.5
    starts = a0.starts + a1.starts + a2.starts
    assert starts == sorted(starts)
    assert char_spans("$5", "five dollars") == [(0, 6), (6, 12)]


def test_output_format_names():
    assert parse_output_format("opus_48000_64").bit_rate == 64_000
    assert parse_output_format("ulaw_8000").fmt == "ulaw" and parse_output_format("wav_44100").rate == 44100
    for bad in ("pcm_12345", "ulaw_16000", "opus_24000_64", "mp3_48000_128", "mp3_44100_999"):
        with pytest.raises(InvalidInputError, match="not supported"):
            parse_output_format(bad)


# ------------------------------------------------------------------ the official SDK's client code
def test_official_elevenlabs_sdk_stream_and_timestamps(voiced):
    elevenlabs = pytest.importorskip("elevenlabs")

    async def main():
        http = client(voiced)
        sdk = elevenlabs.AsyncElevenLabs(api_key=KEY, base_url="http://t", httpx_client=http)
        tts = sdk.text_to_speech
        whole = b"".join([c async for c in tts.convert("alloy", text=TEXT, model_id="eleven_flash_v2_5",
                                                        output_format="pcm_24000")])
        streamed = b"".join([c async for c in tts.stream("alloy", text=TEXT, output_format="pcm_24000",
                                                          voice_settings=elevenlabs.VoiceSettings(speed=1.0))])
        timed = await tts.convert_with_timestamps("alloy", text=TEXT, output_format="pcm_24000")
        chunks = [c async for c in tts.stream_with_timestamps("alloy", text=TEXT, output_format="pcm_24000")]
        error = None
        try:
            [c async for c in tts.convert("nobody", text="Hi.")]
        except elevenlabs.core.ApiError as exc:
            error = exc
        await http.aclose()
        return whole, streamed, timed, chunks, error

    whole, streamed, timed, chunks, error = asyncio.run(main())
    n = 2 * _pieces_samples(TEXT)
    assert len(whole) == len(streamed) == n
    assert len(base64.b64decode(timed.audio_base_64)) == n and "".join(timed.alignment.characters) == TEXT
    assert sum(len(base64.b64decode(c.audio_base_64)) for c in chunks) == n
    assert "".join(ch for c in chunks if c.alignment for ch in c.alignment.characters) == TEXT
    assert error.status_code == 404 and error.body["detail"]["status"] == "voice_not_found"
