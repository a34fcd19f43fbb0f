"""Loading official model directories: strictness and errors that name the file and the problem."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from cosyvoice_runtime.errors import ConfigError, ModelLoadError
from cosyvoice_runtime.model import load_model
from cosyvoice_runtime.yaml_config import read_model_spec
from tests.runtime.parity.common import parity_dir

FAMILIES = ["cosyvoice2", "cosyvoice3"]


@pytest.fixture(params=FAMILIES)
def model_copy(request, tmp_path) -> tuple[str, Path]:
    src = parity_dir() / request.param / "model"
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return request.param, dst


def test_loads_parity_model_strictly(model_copy):
    family, path = model_copy
    model = load_model(path)
    assert model.spec.family == family
    # every tensor of every checkpoint was loaded (strict): compare one value per file
    for name in ("llm", "flow"):
        ref = torch.load(path / f"{name}.pt", weights_only=True)
        ours = getattr(model, name).state_dict()
        key = next(iter(ref))
        assert torch.equal(ours[key], ref[key]), f"{name}.pt {key} not loaded"


def test_a_legacy_checkpoint_loads_and_the_model_keeps_nothing_of_the_mapped_files(model_copy):
    """Checkpoints are mapped, not read (cold start); a pre-zip one cannot be and is read instead.
    The parameters are the model's own memory: rewriting a file after the load changes nothing."""
    _, path = model_copy
    state = torch.load(path / "flow.pt", weights_only=True)
    torch.save(state, path / "flow.pt", _use_new_zipfile_serialization=False)
    model = load_model(path)
    key = next(iter(state))
    before = model.flow.state_dict()[key].clone()
    assert torch.equal(before, state[key])
    llm = torch.load(path / "llm.pt", weights_only=True)
    llm_key = next(iter(llm))
    torch.save({k: torch.zeros_like(v) for k, v in llm.items()}, path / "llm.pt")
    assert torch.equal(model.llm.state_dict()[llm_key], llm[llm_key]) and llm[llm_key].abs().sum() > 0


@pytest.mark.parametrize("missing", ["llm.pt", "flow.pt", "hift.pt"])
def test_missing_checkpoint_names_the_file(model_copy, missing):
    _, path = model_copy
    (path / missing).unlink()
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    assert missing in str(err.value) and "missing" in str(err.value)


def test_missing_yaml_and_backbone_config(model_copy):
    family, path = model_copy
    (path / "CosyVoice-BlankEN" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json.*missing"):
        read_model_spec(path)
    (path / f"{family}.yaml").unlink()
    with pytest.raises(ModelLoadError, match="cosyvoice2.yaml / cosyvoice3.yaml"):
        read_model_spec(path)


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_truncated_checkpoint(model_copy, name):
    _, path = model_copy
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    assert name in str(err.value) and "truncated or corrupt" in str(err.value)


def test_wrong_shape_tensor(model_copy):
    _, path = model_copy
    state = torch.load(path / "flow.pt", weights_only=True)
    key = "spk_embed_affine_layer.weight"
    state[key] = torch.zeros(state[key].shape[0] + 1, state[key].shape[1])
    torch.save(state, path / "flow.pt")
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    msg = str(err.value)
    assert "flow.pt" in msg and "wrong shapes" in msg and key in msg


def test_missing_and_unexpected_keys(model_copy):
    _, path = model_copy
    state = torch.load(path / "llm.pt", weights_only=True)
    removed = min(state)
    del state[removed]
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, path / "llm.pt")
    with pytest.raises(ModelLoadError) as err:
        load_model(path)
    msg = str(err.value)
    assert "llm.pt" in msg and f"missing keys: {removed}" in msg and "unexpected keys: extra.weight" in msg


def test_not_a_state_dict(model_copy):
    _, path = model_copy
    torch.save([torch.zeros(1)], path / "hift.pt")
    with pytest.raises(ModelLoadError, match="hift.pt.*expected a state dict"):
        load_model(path)


def test_bad_yaml_syntax(model_copy):
    family, path = model_copy
    (path / f"{family}.yaml").write_text("llm: [unclosed\n")
    with pytest.raises(ModelLoadError, match=f"{family}.yaml.*not valid YAML"):
        read_model_spec(path)


def test_unknown_yaml_key(model_copy):
    family, path = model_copy
    yml = path / f"{family}.yaml"
    yml.write_text(yml.read_text().replace("    nb_harmonics: 8\n", "    nb_harmonics: 8\n    nb_harmonicz: 8\n"))
    with pytest.raises(ConfigError) as err:
        read_model_spec(path)
    assert err.value.key == "hift.nb_harmonicz" and f"{family}.yaml" in str(err.value)


def test_missing_yaml_key(model_copy):
    family, path = model_copy
    yml = path / f"{family}.yaml"
    yml.write_text(yml.read_text().replace("    base_channels: 32\n", ""))
    with pytest.raises(ConfigError) as err:
        read_model_spec(path)
    assert err.value.key == "hift.base_channels" and "missing" in str(err.value)


def test_wrong_class_for_family(model_copy):
    family, path = model_copy
    yml = path / f"{family}.yaml"
    other = "CosyVoice3LM" if family == "cosyvoice2" else "Qwen2LM"
    mine = "Qwen2LM" if family == "cosyvoice2" else "CosyVoice3LM"
    yml.write_text(yml.read_text().replace(f"cosyvoice.llm.llm.{mine}", f"cosyvoice.llm.llm.{other}"))
    with pytest.raises(ConfigError, match=f"{family} needs {mine}"):
        read_model_spec(path)


def test_yaml_tags_are_never_executed(tmp_path):
    """A `!apply:` tag naming a dangerous callable is parsed as data, not called."""
    from cosyvoice_runtime.yaml_config import Tagged, load_tagged_yaml

    marker = tmp_path / "pwned"
    f = tmp_path / "x.yaml"
    f.write_text(f"a: !apply:os.system ['touch {marker}']\nb: !ref <c> * 2\nc: 3\n")
    data = load_tagged_yaml(f)
    assert isinstance(data["a"], Tagged) and data["a"].target == "os.system"
    assert data["b"] == 6
    assert not marker.exists()


def test_a_load_without_random_init_gives_every_tensor_of_an_initialised_build(model_copy):
    """load_model builds its modules without the layers' random initialisation (skipped_init): every
    parameter and buffer equals what a build with it and the same strict load hold, the layers'
    reset_parameters are back afterwards, and the caller's random stream is untouched."""
    from cosyvoice_runtime.model import HIFT_KEY_PREFIX, _fold_weight_norm, build_modules
    from cosyvoice_runtime.weights import load_checkpoint

    _, path = model_copy
    restored = {cls: cls.reset_parameters for cls in (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Embedding)}
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    model = load_model(path)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert {cls: cls.reset_parameters for cls in restored} == restored
    spec = read_model_spec(path)
    built = build_modules(spec)
    for name, module in built.items():
        load_checkpoint(module, path / spec.files[name], strip_prefix=HIFT_KEY_PREFIX if name == "hift" else None)
        if name == "hift":
            _fold_weight_norm(module)
        ours = getattr(model, name).state_dict()
        theirs = module.eval().state_dict()
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            assert torch.equal(ours[key], value), f"{name} {key}"
