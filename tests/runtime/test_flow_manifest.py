"""The full-size CV2 / CV3 flows, built on the meta device from the released hyper-parameters
(the full-size yaml written by ``tiny_model.write_config_dir``), have exactly the keys and shapes
of the released ``flow.pt`` (manifests in the parity fixture set)."""
from __future__ import annotations

import json

import pytest
import torch

from cosyvoice_runtime.flow.flow import build_flow
from cosyvoice_runtime.tiny_model import write_config_dir
from tests.runtime.parity.common import parity_dir

MANIFESTS = parity_dir() / "manifests"


@pytest.mark.skipif(not (MANIFESTS / "cosyvoice2_flow.json").is_file(), reason="no full-size manifests in this fixture set")
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_full_size_flow_matches_manifest(family, tmp_path):
    manifest = json.loads((MANIFESTS / f"{family}_flow.json").read_text())
    expected = {e["key"]: tuple(e["shape"]) for e in manifest["keys"]}
    spec = write_config_dir(tmp_path, family)
    with torch.device("meta"):
        flow = build_flow(spec.flow)
    ours = {k: tuple(v.shape) for k, v in flow.state_dict().items()}
    assert sorted(set(expected) - set(ours)) == []
    assert sorted(set(ours) - set(expected)) == []
    assert {k: (s, expected[k]) for k, s in ours.items() if expected[k] != s} == {}
    assert len(ours) == manifest["n_keys"]
    assert sum(v.numel() for v in flow.state_dict().values()) == manifest["n_elements_total"]
