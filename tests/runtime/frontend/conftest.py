"""Fixtures: frontend-only model directories (yaml + tiny tokenizer + tiny ONNX files) and audio."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from cosyvoice_runtime import tiny_assets
from tests.runtime.parity.common import parity_dir

FAMILIES = ("cosyvoice2", "cosyvoice3")


def _model_dir(root, family: str):
    """The parity set's yaml and backbone config plus our tiny frontend assets (no weights needed)."""
    src = parity_dir() / family / "model"
    out = root / family
    (out / "CosyVoice-BlankEN").mkdir(parents=True)
    shutil.copy(src / f"{family}.yaml", out / f"{family}.yaml")
    shutil.copy(src / "CosyVoice-BlankEN" / "config.json", out / "CosyVoice-BlankEN" / "config.json")
    tiny_assets.write_tokenizer(out / "CosyVoice-BlankEN", family)
    tiny_assets.write_campplus_onnx(out / "campplus.onnx")
    tok = "speech_tokenizer_v2.onnx" if family == "cosyvoice2" else "speech_tokenizer_v3.onnx"
    tiny_assets.write_speech_tokenizer_onnx(out / tok)
    return out


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frontend_models")
    return {f: _model_dir(root, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def frontends(model_dirs, tmp_path_factory):
    from cosyvoice_runtime.frontend import Frontend

    voices = tmp_path_factory.mktemp("voices")
    return {f: Frontend.from_model_dir(d, voices_dir=voices / "shared") for f, d in model_dirs.items()}


def tone(seconds: float, sr: int, freqs=(220.0, 3000.0), amps=(0.3, 0.1), channels: int = 1) -> np.ndarray:
    t = np.arange(round(seconds * sr)) / sr
    x = sum(a * np.sin(2 * np.pi * f * t) for f, a in zip(freqs, amps)).astype(np.float32)
    return x if channels == 1 else np.stack([x * (1.0 - 0.25 * c) for c in range(channels)], axis=1)


def encode(samples: np.ndarray, sr: int, fmt: str, subtype: str | None = None) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def dump(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)
