"""A replica without a model refuses to start unless the config asks for the tiny model."""
from __future__ import annotations

import pytest

from deployments import constants
from deployments.model_source import ModelNotConfiguredError, ModelSource
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig


@pytest.fixture
def no_model_env(monkeypatch, tmp_path):
    monkeypatch.delenv(constants.ENV_MODEL_DIR, raising=False)
    monkeypatch.setenv(constants.ENV_HOME, str(tmp_path))
    return tmp_path


def test_no_model_and_no_tiny_family_is_an_error_naming_the_settings(no_model_env):
    with pytest.raises(ModelNotConfiguredError, match=r"model_dir.*FAST_COSY_MODEL_DIR.*tiny_family"):
        ModelSource(None).resolve()
    assert not list(no_model_env.iterdir())  # nothing was written


def test_a_configured_directory_or_the_env_wins(no_model_env, monkeypatch):
    assert ModelSource("/models/cv2").resolve().as_posix() == "/models/cv2"
    monkeypatch.setenv(constants.ENV_MODEL_DIR, "/models/from-env")
    assert ModelSource(None).resolve().as_posix() == "/models/from-env"
    assert ModelSource(None, "cosyvoice2").resolve().as_posix() == "/models/from-env"


def test_tiny_family_asks_for_the_tiny_model(no_model_env):
    path = ModelSource(None, "cosyvoice2").resolve()
    assert path == no_model_env / "tiny-cosyvoice2" and (path / "cosyvoice2.yaml").exists()


def test_synthesizer_replica_fails_at_start_without_a_model(no_model_env):
    cfg = SynthesizerConfig(device="cpu", warmup=False, max_running=2, max_ongoing_requests=2,
                            token2wav={"max_batch_size": 2})
    with pytest.raises(ModelNotConfiguredError, match="tiny_family"):
        Synthesizer(cfg, ModelSource(None))


def test_which_configs_ask_for_the_tiny_model():
    from serve_app.args import AppArgs
    from tests.serve_app.test_configs import CONFIGS

    asks = {p.name for p in CONFIGS if AppArgs.from_file(p).tiny_family is not None}
    assert asks == {"local.yaml", "ramp-cpu.yaml"}  # `make serve` and the CPU ramp; never a GPU config


def test_doctor_fails_a_config_that_would_refuse_to_start():
    from fastcosy_cli.doctor_checks import Environment, Status, check_model_dir

    assert check_model_dir(Environment(model_dir=None, tiny_allowed=False)).status is Status.FAIL
    assert check_model_dir(Environment(model_dir=None, tiny_allowed=True)).status is Status.WARN


def test_app_args_name_one_model_for_every_replica(no_model_env):
    from serve_app.args import AppArgs

    app = {"model_dir": "/models/app", "tiny_family": "cosyvoice3"}
    assert AppArgs.model_validate(app).model_source().resolve().as_posix() == "/models/app"
    both = {**app, "frontend": {"model_dir": "/models/f"}, "synthesizer": {"model_dir": "/models/f"}}
    assert AppArgs.model_validate(both).model_source().resolve().as_posix() == "/models/f"
    tiny = AppArgs.model_validate({"tiny_family": "cosyvoice3"})
    assert tiny.configured_model_dir is None
    assert tiny.model_source().resolve() == no_model_env / "tiny-cosyvoice3"
