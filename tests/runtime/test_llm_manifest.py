"""The full-size CV2 / CV3 LLM, built on the meta device, has exactly the released llm.pt keys and shapes."""
from __future__ import annotations

import json

import pytest
import torch

from cosyvoice_runtime.config import LLMSpec, Qwen2Spec
from cosyvoice_runtime.llm.model import build_llm
from tests.runtime.parity.common import parity_dir

MANIFESTS = parity_dir() / "manifests"
# The released speech vocabulary (3^8 FSQ codes); not in the Qwen2 config.
SPEECH_TOKEN_SIZE = 6561


def _full_size_spec(family: str) -> LLMSpec:
    cfg = json.loads((MANIFESTS / "summary.json").read_text())[family]["qwen2_backbone_config"]
    backbone = Qwen2Spec(
        hidden_size=cfg["hidden_size"], num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"], rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
    )
    return LLMSpec(family=family, backbone=backbone, speech_token_size=SPEECH_TOKEN_SIZE,
                   llm_input_size=cfg["hidden_size"], llm_output_size=cfg["hidden_size"])


@pytest.mark.skipif(not (MANIFESTS / "summary.json").is_file(), reason="no full-size manifests in this fixture set")
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_full_size_llm_matches_manifest(family: str):
    manifest = json.loads((MANIFESTS / f"{family}_llm.json").read_text())
    expected = {e["key"]: tuple(e["shape"]) for e in manifest["keys"]}
    with torch.device("meta"):
        model = build_llm(_full_size_spec(family))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    assert sorted(set(expected) - set(ours)) == []
    assert sorted(set(ours) - set(expected)) == []
    assert {k: s for k, s in ours.items() if expected[k] != s} == {}
    assert len(ours) == manifest["n_keys"]
    assert sum(v.numel() for v in model.state_dict().values()) == manifest["n_elements_total"]
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    # The text head is tied to the input table (present as a key, one tensor in memory).
    assert model.llm.model.lm_head.weight is model.llm.model.model.embed_tokens.weight
    assert ("llm_decoder.bias" in ours) == (family == "cosyvoice2")
    assert ("llm_embedding.weight" in ours) == (family == "cosyvoice2")
