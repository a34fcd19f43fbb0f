"""Timestamps from the model's own text-to-speech-token correspondence, end to end on the REAL
tiny random-weight model of both families, in process: HTTP ``/with-timestamps``, the
``stream-input`` WebSocket (bistream: the engine's interleave) and ``multi-stream-input``.

With random weights the speech says nothing, so only the mechanism is tested: every character
sent is aligned once and in order, times are monotonic, and nothing ends after the audio;
normalisation ("2" -> "two"), and on the text-in WebSockets the session's pronunciation aliases
("NYC" -> "New York City"), are mapped back to the characters sent."""
from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from starlette.testclient import TestClient

from deployments.frontend import FrontendConfig, TextFrontend
from deployments.model_source import ModelSource
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from serve_app.ingress import IngressConfig, TTSIngress
from tests.serve_app.test_ingress_inproc import FakeHandle, client

TEXT = "I have 2 cats. They sleep all day!"
SR = 24000


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def app(request, tmp_path_factory):
    from cosyvoice_runtime.tiny_model import write_tiny_model

    model_dir = str(write_tiny_model(tmp_path_factory.mktemp("tiny") / request.param, request.param))
    frontend = TextFrontend(FrontendConfig(voices_dir=str(tmp_path_factory.mktemp("voices"))), ModelSource(model_dir))
    synth = Synthesizer(SynthesizerConfig(device="cpu", warmup=False, max_model_len=1024), ModelSource(model_dir))

    synth.outside_serve()  # no @serve.batch outside a replica
    # a registered voice (CosyVoice3's transcript carries its <|endofprompt|> prefix)
    prefix = "You are a helpful assistant.<|endofprompt|>" if request.param == "cosyvoice3" else ""
    tone = (0.3 * np.sin(2 * np.pi * 180.0 * np.arange(16000) / 16000)).astype(np.float32)
    asyncio.run(frontend.register_voice("v", prefix + "A prompt transcript.", tone, 16000))
    ingress = TTSIngress(IngressConfig(max_input_chars=1000), FakeHandle(frontend), FakeHandle(synth))
    return ingress.__serve_build_asgi_app__()


def _check(chars: list[str], starts: list[float], ends: list[float], text: str, audio_s: float) -> None:
    assert "".join(chars) == text and len(starts) == len(ends) == len(chars)
    assert starts == sorted(starts) and ends == sorted(ends) and all(s <= e for s, e in zip(starts, ends))
    assert ends[-1] <= audio_s + 1e-3


def test_http_with_timestamps_maps_the_normalised_text_back(app):
    async def main():
        async with client(app) as c:
            return await c.post("/v1/text-to-speech/v/with-timestamps?output_format=pcm_24000",
                                json={"text": TEXT, "seed": 3})

    body = asyncio.run(main()).json()
    audio_s = len(base64.b64decode(body["audio_base64"])) / 2 / SR
    a, n = body["alignment"], body["normalized_alignment"]
    _check(a["characters"], a["character_start_times_seconds"], a["character_end_times_seconds"], TEXT, audio_s)
    normalized = "".join(n["characters"])
    assert "two" in normalized and "2" not in normalized  # what the model read
    _check(n["characters"], n["character_start_times_seconds"], n["character_end_times_seconds"], normalized, audio_s)
    two = normalized.index("two")  # "2" is said where "two" is
    at = TEXT.index("2")
    assert a["character_start_times_seconds"][at] == n["character_start_times_seconds"][two]
    assert a["character_end_times_seconds"][at] == n["character_end_times_seconds"][two + 2]


@pytest.mark.parametrize("route", ["stream-input", "multi-stream-input"])
def test_websocket_alignment_comes_from_the_bistream_interleave(app, route):
    sent, spoken, audio_s = _ws_alignment(app, f"/v1/text-to-speech/v/{route}?output_format=pcm_24000",
                                          {"text": " "}, [word + " " for word in TEXT.split(" ")])
    assert sent == spoken == TEXT + " " and audio_s > 0  # every character pushed, once, in order, read as sent


def _ws_alignment(app, path: str, first: dict, texts: list[str], flush_at: int | None = None):
    """(alignment chars, normalizedAlignment chars, audio seconds) of one text-in session; every
    message's alignment objects are checked (monotonic, within their audio, each of one message)."""
    multi = "multi-stream-input" in path
    sent, spoken, audio_s = "", "", 0.0
    with TestClient(app) as c, c.websocket_connect(path) as ws:
        ws.send_json(first)
        for k, text in enumerate(texts):
            ws.send_json({"text": text, "flush": k == flush_at})
        if multi:
            ws.send_json({"text": "", "flush": True})
            ws.send_json({"close_context": True})
        else:
            ws.send_json({"text": ""})
        while (m := ws.receive())["type"] == "websocket.send":
            msg = json.loads(m["text"])
            assert "error" not in msg, msg
            if msg.get("isFinal"):
                if multi:
                    ws.send_json({"close_socket": True})
                continue
            seconds = len(base64.b64decode(msg["audio"])) / 2 / SR
            for key in ("alignment", "normalizedAlignment"):
                if (a := msg[key]) is not None:
                    starts = [t / 1000 for t in a["charStartTimesMs"]]
                    ends = [(t + d) / 1000 for t, d in zip(a["charStartTimesMs"], a["charDurationsMs"])]
                    _check(a["chars"], starts, ends, "".join(a["chars"]), seconds)
            sent += "".join((msg["alignment"] or {}).get("chars", []))
            spoken += "".join((msg["normalizedAlignment"] or {}).get("chars", []))
            audio_s += seconds
    return sent, spoken, audio_s


@pytest.mark.parametrize("route", ["stream-input", "multi-stream-input"])
def test_websocket_alignment_lists_the_characters_sent_through_aliases(app, route):
    """A pronunciation rule on the text-in path: ``alignment`` is what the client sent (each
    character once, in order), ``normalizedAlignment`` what the model read. The rule's text is
    split over messages, and a flush ends the first turn inside the session."""
    first = {"text": " ", "pronunciation_rules": [{"string_to_replace": "NYC", "alias": "New York City"},
                                                  {"string_to_replace": "um", "alias": ""}]}
    texts = ["I love N", "YC. ", "um ", "Then NYC", " again!"]
    sent, spoken, audio_s = _ws_alignment(app, f"/v1/text-to-speech/v/{route}?output_format=pcm_24000", first,
                                          texts, flush_at=1)
    assert audio_s > 0
    assert sent == "".join(texts)
    assert spoken == "I love New York City. Then New York City again!"
