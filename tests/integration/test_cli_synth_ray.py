"""``fastcosy synth --url`` against the real app on real local Ray: a real HTTP round trip.

The session's ``tts_app`` (tests/integration/conftest.py: real ingress, frontend and
synthesizer deployments with injected fake model math) serves ``POST /v1/tts``; the console
script runs as a subprocess, streams each text segment into one WAV, and reports service
errors as one line. The fakes make the expected length exact: every text id of every
sentence piece gives ``TOKENS_PER_TEXT_ID x SAMPLES_PER_TOKEN`` samples.
"""
from __future__ import annotations

import io
import subprocess
import sys
import wave
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from fastcosy_cli.synth import split_segments
from tests.deployments import fakes

pytestmark = pytest.mark.ray

VOICE = "cli-voice"


def fastcosy(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).with_name("fastcosy")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "fastcosy_cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=180, check=False)


def _prompt_wav(path: Path, seconds: float = 2.0, sr: int = 16000) -> Path:
    t = np.arange(int(seconds * sr)) / sr
    sf.write(path, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), sr)
    return path


def _expected_samples(segments: list[str]) -> int:
    runtime = fakes.FakeFrontendRuntime()
    return sum(len(piece.encode()) * fakes.TOKENS_PER_TEXT_ID * fakes.SAMPLES_PER_TOKEN
               for seg in segments for piece in runtime.split(seg))


@pytest.fixture(scope="module")
def service(tts_app, tmp_path_factory):
    url = tts_app["base_url"]
    prompt = _prompt_wav(tmp_path_factory.mktemp("prompt") / "p.wav")
    r = httpx.post(f"{url}/v1/voices", data={"voice_id": VOICE, "prompt_text": "hello there", "overwrite": "true"},
                   files={"audio": ("p.wav", prompt.read_bytes(), "audio/wav")}, timeout=30)
    assert r.status_code == 201, r.text
    return {"url": url, "prompt": prompt}


def test_synth_url_streams_every_segment_into_one_wav(service, tmp_path):
    text = "The first sentence is here. A second one follows! Is there a third? Yes, and a fourth."
    out = tmp_path / "remote.wav"
    res = fastcosy("synth", "--url", service["url"], "--voice", VOICE, "--segment-chars", "40", "--seed", "3",
                   "-o", str(out), text)
    assert res.returncode == 0, res.stderr
    segments = split_segments(text, 40)
    assert len(segments) >= 3
    assert f"{len(segments)}/{len(segments)}" in res.stderr  # the progress bar counted every segment
    assert f"at {fakes.SAMPLE_RATE} Hz from {len(segments)} segment(s)" in res.stdout
    with wave.open(str(out), "rb") as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (fakes.SAMPLE_RATE, 1, 2)
        frames = w.getnframes()
    assert frames == _expected_samples(segments)
    reported = float(res.stdout.split(": ")[1].split(" s at")[0])
    assert reported == pytest.approx(frames / fakes.SAMPLE_RATE, abs=0.006)


def test_synth_url_zero_shot_uploads_the_prompt(service, tmp_path):
    out = tmp_path / "zero-shot.wav"
    res = fastcosy("synth", "--url", service["url"], "--prompt-wav", str(service["prompt"]),
                   "--prompt-text", "hello there", "--no-progress", "-o", str(out), "Bonjour.")
    assert res.returncode == 0, res.stderr
    audio, sr = sf.read(io.BytesIO(out.read_bytes()), dtype="float32")
    assert sr == fakes.SAMPLE_RATE and audio.size == _expected_samples(["Bonjour."])


def test_synth_url_service_error_is_one_line_and_leaves_no_file(service, tmp_path):
    out = tmp_path / "never.wav"
    res = fastcosy("synth", "--url", service["url"], "--voice", "nobody-registered", "--no-progress", "-o", str(out),
                   "Hello.")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("fastcosy synth: HTTP 404") and "nobody-registered" in last, res.stderr
    assert not list(tmp_path.iterdir())
