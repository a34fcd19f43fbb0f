"""The ``fastcosy`` console script end to end, as an operator runs it (a subprocess each time).

``make-tiny-model`` writes a tiny random-weight CosyVoice2 directory; ``synth`` turns text into a
WAV through the real local pipeline (frontend, LLM, flow, vocoder: noise, but of the right
shape); bad input exits non-zero with one clear line and no traceback; ``build-trt`` stops
after the ONNX export without TensorRT and prints its summary; ``doctor`` passes on this node
for the tiny model and fails with the fix where serving is blocked.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("cosyvoice_runtime.flow.flow")  # the tiny writer and the pipeline build the real modules

TINY_SAMPLE_RATE = 24000  # cosyvoice2 (and the tiny model's HiFT)
_TIMEOUT_S = 240


def fastcosy(*args: str, cwd: Path | None = None, timeout: float = _TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run the installed console script (``python -m fastcosy_cli`` when it is not on disk)."""
    script = Path(sys.executable).with_name("fastcosy")
    cmd = [str(script)] if script.is_file() else [sys.executable, "-m", "fastcosy_cli"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "FAST_COSY_MODEL_DIR": ""}
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env,
                          check=False)


def assert_clean_failure(res: subprocess.CompletedProcess, command: str, *needles: str) -> str:
    """Non-zero exit, no traceback, and the last stderr line is ``fastcosy <command>: <message>``."""
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"fastcosy {command}: "), res.stderr
    for needle in needles:
        assert needle in last, last
    return last


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("cli") / "tiny-cv2"
    res = fastcosy("make-tiny-model", "--out", str(target), "--family", "cosyvoice2")
    assert res.returncode == 0, res.stderr
    assert "RANDOM-WEIGHT" in res.stdout and str(target) in res.stdout
    assert (target / "cosyvoice2.yaml").is_file() and (target / "checksums.json").is_file()
    return target


# ------------------------------------------------------------------------------------- synth
def test_synth_local_writes_a_valid_24khz_wav_with_a_segment_progress_bar(tiny_model, tmp_path):
    out = tmp_path / "speech" / "hello.wav"  # the folder is created
    res = fastcosy("synth", "--model-dir", str(tiny_model), "--voice", "default", "--device", "cpu",
                   "--segment-chars", "4", "--seed", "1", "-o", str(out), "Hi. Go.")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    # Two segments ("Hi.", "Go."): tqdm counts them on stderr, the result line goes to stdout.
    assert "2/2" in res.stderr and "segment" in res.stderr
    assert f"wrote {out}" in res.stdout and f"at {TINY_SAMPLE_RATE} Hz from 2 segment(s)" in res.stdout

    info = sf.info(str(out))
    assert (info.samplerate, info.channels, info.format, info.subtype) == (TINY_SAMPLE_RATE, 1, "WAV", "PCM_16")
    assert info.frames > 0
    with wave.open(str(out), "rb") as w:  # an independent reader agrees on the header
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (TINY_SAMPLE_RATE, 1, 2)
        assert w.getnframes() == info.frames
    assert out.stat().st_size >= 44 + 2 * info.frames
    reported = float(res.stdout.split(": ")[1].split(" s at")[0])
    assert reported == pytest.approx(info.frames / TINY_SAMPLE_RATE, abs=0.006)
    audio, _ = sf.read(str(out), dtype="float32")
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["hello.wav"]  # no temporary file left


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_synth_empty_text_is_a_one_line_error(tiny_model, tmp_path, text):
    res = fastcosy("synth", "--model-dir", str(tiny_model), "--voice", "default", "-o", str(tmp_path / "o.wav"), text)
    assert res.returncode == 2
    assert_clean_failure(res, "synth", "the text is empty")
    assert not list(tmp_path.iterdir())


def test_synth_missing_model_dir_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no-such-model"
    res = fastcosy("synth", "--model-dir", str(missing), "--voice", "default", "-o", str(tmp_path / "o.wav"), "Hi.")
    assert res.returncode == 2
    assert_clean_failure(res, "synth", str(missing), "does not exist", "make-tiny-model")


def test_synth_incomplete_model_dir_names_the_missing_file(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "flow.pt").unlink()
    res = fastcosy("synth", "--model-dir", str(broken), "--voice", "default", "-o", str(tmp_path / "o.wav"), "Hi.")
    assert res.returncode == 2
    assert_clean_failure(res, "synth", "flow.pt")
    assert not (tmp_path / "o.wav").exists()


def _unwritable_outputs(tmp_path: Path) -> list[tuple[str, Path, str]]:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [("parent is a file", a_file / "o.wav", "is a file, not a folder"),
             ("output is a directory", tmp_path, "is a directory")]
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "read-only"
        ro.mkdir()
        ro.chmod(0o500)
        cases.append(("read-only folder", ro / "o.wav", "Permission denied"))
    return cases


def test_synth_unwritable_output_fails_before_loading_the_model(tiny_model, tmp_path):
    for what, target, needle in _unwritable_outputs(tmp_path):
        res = fastcosy("synth", "--model-dir", str(tiny_model), "--voice", "default", "-o", str(target), "Hi.")
        assert res.returncode == 2, what
        assert_clean_failure(res, "synth", needle)
        assert "loaded" not in res.stderr, f"{what}: the model was loaded before the output was checked"


def test_synth_unknown_voice_fails_and_keeps_the_existing_output(tiny_model, tmp_path):
    out = tmp_path / "keep.wav"
    out.write_bytes(b"previous result")
    res = fastcosy("synth", "--model-dir", str(tiny_model), "--voice", "nobody", "-o", str(out), "Hi.")
    assert res.returncode == 2
    assert_clean_failure(res, "synth", "nobody")
    assert out.read_bytes() == b"previous result"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.wav"]


def test_synth_missing_prompt_wav_and_unreadable_text_file(tmp_path):
    res = fastcosy("synth", "--prompt-wav", str(tmp_path / "none.wav"), "-o", str(tmp_path / "o.wav"), "Hi.")
    assert_clean_failure(res, "synth", "--prompt-wav", "does not exist")
    res = fastcosy("synth", "--voice", "v", "--text-file", str(tmp_path / "none.txt"), "-o", str(tmp_path / "o.wav"))
    assert_clean_failure(res, "synth", "--text-file", "No such file")


def test_synth_unreachable_service_is_a_one_line_error(tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = fastcosy("synth", "--url", f"http://127.0.0.1:{port}", "--voice", "v", "-o", str(tmp_path / "o.wav"), "Hi.")
    assert res.returncode == 2
    assert_clean_failure(res, "synth", "cannot reach")
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------------- build-trt
@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed: plans build")
def test_build_trt_without_tensorrt_writes_onnx_prints_summary_and_exits_2(tiny_model, tmp_path):
    pytest.importorskip("onnx")
    plans = tmp_path / "plans"
    res = fastcosy("build-trt", "--model-dir", str(tiny_model), "--out", str(plans), "--fp16", "--max-batch", "3",
                   "--max-mem-gb", "8", "--attention", "full", "--no-verify")
    assert res.returncode == 2, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    # progress of the export and the reason it stopped (stderr, from the builder)
    assert "[onnx] estimator.full.onnx exported" in res.stderr
    assert "needs TensorRT" in res.stderr and "[trt] extra" in res.stderr
    # the summary (stdout): precision, memory budget, min/opt/max of every input, files, outcome
    text = res.stdout
    assert "build-trt summary" in text and "precision    fp16" in text
    assert "replica budget 8 GB" in text and "TensorRT workspace 4 GB" in text
    assert "rows (2 x flow batch) (2, 4, 6)" in text
    for name in ("x", "mask", "mu", "cond", "t", "spks"):
        assert any(line.split()[:1] == [name] for line in text.splitlines()), name
    assert "(6, 80, 3000)" in text  # max of x: 2 x 3 rows, 60 s of mel frames
    assert "estimator.full.onnx" in text and "none built" in text
    assert "TensorRT is not installed here" in text and "exit 2" in text
    assert (plans / "estimator.full.onnx").stat().st_size > 0
    assert not list(plans.glob("*.plan"))


def test_build_trt_bad_input_is_a_one_line_error(tiny_model, tmp_path):
    res = fastcosy("build-trt", "--model-dir", str(tmp_path / "missing"), "--out", str(tmp_path / "p"))
    assert res.returncode == 2
    assert_clean_failure(res, "build-trt", "model directory does not exist")
    res = fastcosy("build-trt", "--model-dir", str(tiny_model), "--out", str(tmp_path / "p"), "--max-mem-gb", "0.3")
    assert res.returncode == 2
    assert_clean_failure(res, "build-trt", "max_mem_gb 0.3 is too small")
    assert not (tmp_path / "p").exists()  # refused before exporting anything


def test_build_trt_help_lists_the_builder_flags():
    res = fastcosy("build-trt", "--help")
    assert res.returncode == 0
    for flag in ("--model-dir", "--out", "--fp16", "--max-batch", "--max-mem-gb", "--workspace-gb", "--attention"):
        assert flag in res.stdout


# ------------------------------------------------------------------------------------ doctor
def test_doctor_passes_for_the_tiny_model_on_cpu(tiny_model):
    res = fastcosy("doctor", "--model-dir", str(tiny_model), "--device", "cpu")
    assert res.returncode == 0, res.stdout
    assert "[  ok] model_dir: cosyvoice2 file set complete" in res.stdout
    assert "[  ok] model_files:" in res.stdout and "checksums.json" in res.stdout
    assert "[  ok] wetext:" in res.stdout and "0 failed" in res.stdout


def test_doctor_exits_1_with_fixes_when_serving_is_blocked(tiny_model, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model, damaged)
    (damaged / "hift.pt").write_bytes(b"PK\x03\x04 truncated")
    res = fastcosy("doctor", "--model-dir", str(damaged), "--mode", "trt", "--plan-dir", str(tmp_path / "plans"))
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    assert "[FAIL] model_files:" in res.stdout and "hift.pt (checksum mismatch)" in res.stdout
    assert "[FAIL] engine_cache:" in res.stdout and "fastcosy build-trt --model-dir" in res.stdout
    assert "serving is blocked" in res.stdout
