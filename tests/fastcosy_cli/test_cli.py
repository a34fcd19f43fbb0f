"""fastcosy CLI: argument handling, serve (fake Ray backend), synth (fake HTTP service),
tools, and the generated configuration reference."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf

from fastcosy_cli import serve, synth
from fastcosy_cli.common import CliError
from fastcosy_cli.config_reference import render_reference
from fastcosy_cli.main import build_parser, main
from serve_app.audio_codec import make_stream_encoder

REPO = Path(__file__).resolve().parents[2]
LOCAL_CONFIG = REPO / "configs" / "local.yaml"


def test_every_subcommand_is_registered(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for cmd in ("serve", "synth", "make-tiny-model", "build-trt", "bench", "doctor", "calibrate", "config-reference"):
        assert cmd in text


def test_console_script_is_declared():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fastcosy"] == "fastcosy_cli.main:main"


# ---------------------------------------------------------------------- configuration reference
def test_committed_configuration_reference_is_current():
    committed = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render_reference(), "docs/configuration.md is stale: run fastcosy config-reference"


def test_reference_covers_every_field_of_every_model():
    from fastcosy_cli.config_reference import _models_in_order
    from serve_app.args import AppArgs

    text = render_reference()
    for model, _ in _models_in_order(AppArgs):
        assert f"## {model.__name__}" in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text
    assert "| `max_running` | int | `16` | > 0 | decode slots" in text


def test_config_reference_check_flag(tmp_path, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old")
    assert main(["config-reference", "-o", str(stale), "--check"]) == 1
    assert main(["config-reference", "-o", str(stale)]) == 0
    assert main(["config-reference", "-o", str(stale), "--check"]) == 0


# ------------------------------------------------------------------------------------- serve
class FakeBackend:
    def __init__(self):
        self.calls = []

    def start_local(self, cfg, num_cpus, dashboard):
        self.calls.append(("start", cfg, num_cpus, dashboard))

    def wait(self):
        self.calls.append(("wait",))

    def shutdown(self):
        self.calls.append(("shutdown",))

    def deploy(self, address, document):
        self.calls.append(("deploy", address, document))


def _serve_args(*extra):
    return build_parser().parse_args(["serve", "--config", str(LOCAL_CONFIG), *extra])


def test_serve_local_starts_prints_curl_and_shuts_down(capsys):
    backend = FakeBackend()
    assert serve.run(_serve_args("--num-cpus", "4"), backend=backend) == 0
    kinds = [c[0] for c in backend.calls]
    assert kinds == ["start", "wait", "shutdown"]
    cfg = backend.calls[0][1]
    assert cfg.args.synthesizer.device == "cpu" and backend.calls[0][2] == 4.0
    text = capsys.readouterr().out
    assert "curl -s http://127.0.0.1:8000/v1/audio/speech" in text
    assert "-o hello.wav" in text and '"response_format": "wav"' in text
    assert "RANDOM-WEIGHT" in text  # local.yaml serves the tiny model
    assert "http://127.0.0.1:8000/playground" in text


def test_serve_overrides_host_port_and_model_dir(capsys):
    backend = FakeBackend()
    serve.run(_serve_args("--host", "0.0.0.0", "--port", "8123", "--model-dir", "/m/cv2"), backend=backend)
    cfg = backend.calls[0][1]
    assert cfg.document["http_options"]["host"] == "0.0.0.0" and cfg.document["http_options"]["port"] == 8123
    assert cfg.args.model_dir == "/m/cv2"
    assert "http://127.0.0.1:8123" in capsys.readouterr().out  # 0.0.0.0 is shown as a callable address


def test_serve_deploys_to_a_cluster_without_starting_ray(capsys, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    backend = FakeBackend()
    assert serve.run(_serve_args("--address", "http://head:8265"), backend=backend) == 0
    (kind, address, document), = backend.calls
    assert kind == "deploy" and address == "http://head:8265"
    assert document["applications"][0]["import_path"] == "serve_app.app:build_app"
    assert "watch it: serve status --address http://head:8265" in capsys.readouterr().out


def test_the_status_command_printed_after_a_token_deploy_sends_the_token(capsys, monkeypatch):
    # A token cluster refuses `serve status` from a shell without RAY_AUTH_MODE=token, as it refuses
    # the deploy: the printed line must work when pasted (tests/integration/test_cluster_deploy_ray.py).
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    serve.run(_serve_args("--address", "http://head:8265"), backend=FakeBackend())
    assert "watch it: RAY_AUTH_MODE=token serve status --address http://head:8265" in capsys.readouterr().out


def test_serve_rejects_a_typo_before_starting(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(LOCAL_CONFIG.read_text().replace("max_running: 8", "max_runing: 8"))
    assert main(["serve", "--config", str(bad)]) == 2
    assert "max_runing" in capsys.readouterr().err


def test_serve_accepts_a_bare_args_file(tmp_path):
    bare = tmp_path / "args.yaml"
    bare.write_text("tiny_family: cosyvoice3\nsynthesizer: {device: cpu}\n")
    backend = FakeBackend()
    serve.run(build_parser().parse_args(["serve", "--config", str(bare)]), backend=backend)
    assert backend.calls[0][1].args.tiny_family == "cosyvoice3"


def test_serve_missing_config_is_a_clear_error(capsys):
    assert main(["serve", "--config", "/nonexistent.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- synth
def test_split_segments_packs_sentences_under_the_limit():
    text = "First sentence. Second one! Third? " * 20
    segs = synth.split_segments(text, 100)
    assert all(len(s) <= 100 for s in segs) and len(segs) > 5
    assert " ".join(segs).split() == text.split()  # nothing lost or reordered
    assert synth.split_segments("你好。世界！", 3) == ["你好。", "世界！"]
    assert synth.split_segments("你好。世界！", 100) == ["你好。世界！"]
    assert all(len(s) <= 10 for s in synth.split_segments("x" * 35, 10))  # no break at all: hard cuts
    assert synth.split_segments("  \n ", 10) == []


def test_wav_stream_reader_handles_arbitrary_byte_boundaries():
    samples = (np.sin(np.arange(1000) / 7) * 0.5).astype(np.float32)
    enc = make_stream_encoder("wav", 24000)
    data = enc.encode(samples[:500]) + enc.encode(samples[500:]) + enc.finish()
    reader = synth.WavStreamReader()
    got = np.concatenate([reader.feed(data[i:i + 7]) for i in range(0, len(data), 7)])
    assert reader.sample_rate == 24000 and got.size == 1000
    assert np.abs(got / 32767.0 - samples).max() < 1e-4


class FakeService:
    """/v1/tts answering a streamed WAV of 0.1 s per segment character count (bounded)."""

    def __init__(self, status: int = 200):
        self.requests = []
        self.status = status

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "voice 'x' not found", "type": "t",
                                                                "code": "voice_not_found"}})
        body = request.content
        text = json.loads(body)["text"] if request.headers["content-type"].startswith("application/json") else "zz"
        enc = make_stream_encoder("wav", 24000)
        chunks = [enc.encode(np.full(240 * len(text), 0.25, dtype=np.float32)), enc.finish()]
        return httpx.Response(200, headers={"content-type": "audio/wav"}, content=b"".join(chunks))


def _synth_args(tmp_path, *extra):
    return build_parser().parse_args(["synth", "--url", "http://svc:8000", "-o", str(tmp_path / "out.wav"),
                                          "--no-progress", *extra])


def test_synth_remote_streams_every_segment_into_one_wav(tmp_path, capsys):
    service = FakeService()
    client = httpx.Client(transport=httpx.MockTransport(service))
    text = "One two three. " * 30
    args = _synth_args(tmp_path, "--voice", "alice", "--segment-chars", "60", "--seed", "7", text)
    assert synth.run(args, client=client) == 0
    segments = synth.split_segments(text, 60)
    assert len(service.requests) == len(segments) > 1
    first = json.loads(service.requests[0].content)
    assert first["voice_id"] == "alice" and first["mode"] == "voice" and first["stream"] is True
    assert first["seed"] == 7 and str(service.requests[0].url) == "http://svc:8000/v1/tts"
    audio, sr = sf.read(tmp_path / "out.wav", dtype="float32")
    assert sr == 24000 and audio.size == 240 * sum(len(s) for s in segments)
    assert "wrote" in capsys.readouterr().out


def test_synth_remote_zero_shot_uploads_the_prompt(tmp_path):
    prompt = tmp_path / "prompt.wav"
    sf.write(prompt, np.zeros(16000, dtype=np.float32), 16000)
    service = FakeService()
    client = httpx.Client(transport=httpx.MockTransport(service))
    args = _synth_args(tmp_path, "--prompt-wav", str(prompt), "--prompt-text", "hi there", "Hello.")
    assert synth.run(args, client=client) == 0
    req = service.requests[0]
    assert req.headers["content-type"].startswith("multipart/form-data")
    assert b'name="prompt_audio"' in req.content and b"zero_shot" in req.content


def test_synth_remote_error_is_reported_with_the_service_message(tmp_path, capsys):
    client = httpx.Client(transport=httpx.MockTransport(FakeService(status=404)))
    args = _synth_args(tmp_path, "--voice", "x", "Hello.")
    with pytest.raises(CliError, match="voice 'x' not found"):
        synth.run(args, client=client)


def test_synth_needs_a_voice_or_prompt(tmp_path, capsys):
    assert main(["synth", "--url", "http://svc", "-o", str(tmp_path / "o.wav"), "Hello."]) == 2
    assert "--voice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- tools
def test_bench_forwards_arguments_to_the_named_tool(monkeypatch):
    from bench import capacity, gpu_bench

    seen = {}
    monkeypatch.setattr(gpu_bench, "main", lambda argv: seen.setdefault("throughput", argv))
    monkeypatch.setattr(capacity, "main", lambda argv: seen.setdefault("capacity", argv) and {"slo_streams": 3})
    assert main(["bench", "throughput", "--family", "cosyvoice3", "--size", "tiny"]) == 0
    assert main(["bench", "--", "capacity", "--level", "synth"]) == 0  # a tool's figures are not an exit code
    assert seen == {"throughput": ["--family", "cosyvoice3", "--size", "tiny"], "capacity": ["--level", "synth"]}


def test_bench_lists_its_tools_and_refuses_an_unknown_one(capsys):
    from fastcosy_cli.tools import BENCH_TOOLS

    assert main(["bench", "--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name}" in listing and module in listing for name, (module, _) in BENCH_TOOLS.items())
    assert main(["bench", "gpu_bench"]) == 2
    assert "unknown benchmark 'gpu_bench'" in capsys.readouterr().err


def test_make_tiny_model_refuses_to_clobber(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert main(["make-tiny-model", "--out", str(tmp_path / "m")]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_make_tiny_model_writes_the_official_layout(tmp_path, capsys):
    pytest.importorskip("cosyvoice_runtime.flow.flow")  # the writer builds the real modules
    assert main(["make-tiny-model", "--out", str(tmp_path / "m"), "--family", "cosyvoice3"]) == 0
    assert (tmp_path / "m" / "cosyvoice3.yaml").is_file() and (tmp_path / "m" / "checksums.json").is_file()
    assert "RANDOM-WEIGHT" in capsys.readouterr().out


class FakePipeline:
    """Records what the CLI hands the reference pipeline; returns 0.1 s per text id."""

    def __init__(self):
        self.calls = []
        self.spec = argparse.Namespace(sample_rate=24000)

    def tts(self, text_ids, prompt, llm_prompt_text_ids, llm_use_prompt_speech, stream, speed, seed):
        import torch

        self.calls.append((text_ids, prompt, llm_prompt_text_ids, llm_use_prompt_speech, seed))
        yield torch.full((2400 * int(text_ids.numel()),), 0.1)


def test_synth_local_prepares_with_the_frontend_and_runs_the_pipeline(tmp_path, monkeypatch):
    from deployments.frontend import FrontendConfig, TextFrontend
    from tests.deployments import fakes

    frontend = TextFrontend(FrontendConfig(), runtime_factory=fakes.fake_frontend_runtime)
    pipeline = FakePipeline()
    monkeypatch.setattr(synth, "_local_session", lambda args: (frontend, pipeline, "cpu"))
    prompt = tmp_path / "prompt.wav"
    sf.write(prompt, np.zeros(16000 * 2, dtype=np.float32), 16000)
    args = build_parser().parse_args(["synth", "-o", str(tmp_path / "local.wav"), "--no-progress",
                                          "--prompt-wav", str(prompt), "--prompt-text", "hi", "--seed", "3",
                                          "Ab. Cd."])
    assert synth.run(args) == 0
    # The fake frontend splits "Ab. Cd." into two pieces of 3 byte-ids each.
    assert [c[0].tolist() for c in pipeline.calls] == [list(b"Ab."), list(b"Cd.")]
    _, voice, llm_text_ids, llm_speech, seed = pipeline.calls[0]
    assert llm_text_ids.tolist() == list(b"hi") and llm_speech  # zero-shot: transcript and speech go to the LLM
    assert voice.speech_tokens.shape == (50,) and voice.mel.shape == (100, 80) and voice.embedding.shape == (192,)
    assert seed == 3
    audio, sr = sf.read(tmp_path / "local.wav", dtype="float32")
    assert sr == 24000 and audio.size == 2400 * 6 and abs(audio.mean() - 0.1) < 1e-3


@pytest.fixture
def token_cluster():
    """A dashboard address that answers 401 to a client without Ray's token, as a cluster with
    RAY_AUTH_MODE=token does (Ray 2.60)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            ok = self.headers.get("Authorization") == "Bearer the-token"
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}" if ok else b'{"error": "Unauthorized: missing or invalid authentication token"}')

        do_GET = do_PUT = do_POST = _answer

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_deploy_refused_for_the_ray_token_says_to_set_ray_auth_mode(token_cluster, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(CliError, match=r"set RAY_AUTH_MODE=token \(RAY_AUTH_MODE is unset here"):
        serve.RayBackend().deploy(token_cluster, {"applications": []})


def test_the_hint_is_only_for_an_auth_refusal_without_token_mode():
    assert serve.deploy_hint("HTTP 401 Unauthorized", None)
    assert serve.deploy_hint("HTTP 401 Unauthorized", "token") == ""  # the token itself is wrong: Ray says so
    assert serve.deploy_hint("Connection refused", None) == ""


def test_api_keys_in_the_deploying_shell_are_said_not_to_reach_the_replicas(monkeypatch, caplog):
    monkeypatch.setenv("FAST_COSY_API_KEYS", "k1")
    backend = FakeBackend()
    with caplog.at_level("WARNING"):
        serve.run(_serve_args("--address", "http://head:8265"), backend=backend)
    assert "does not reach the cluster's replicas" in caplog.text
