"""ONNX export of the tiny CV2 / CV3 estimators: onnxruntime (CPU) equals torch for several
batch sizes and lengths (dynamic batch and T axes), with full and with chunk attention."""
from __future__ import annotations

import copy

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from cosyvoice_runtime.trt.export import (
    DEFAULT_OPSET,
    INPUT_NAMES,
    OUTPUT_NAME,
    export_estimator,
    verify_onnx,
)
from tests.runtime.test_flow_batch import _flow, _item

# (batch, frames): odd lengths, batch sizes other than the traced 2, rows right-padded.
SHAPES = ((1, 16), (2, 137), (3, 260), (5, 61))
ATOL, RTOL = 1e-4, 1e-3


@pytest.mark.parametrize("streaming", [False, True], ids=["full", "chunked"])
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_onnx_matches_torch(family, streaming, tmp_path):
    estimator = _flow(family).decoder.estimator
    path = export_estimator(estimator, tmp_path / "estimator.onnx", streaming=streaming)

    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == list(INPUT_NAMES)
    assert [o.name for o in model.graph.output] == [OUTPUT_NAME]
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= max(17, DEFAULT_OPSET)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["x"] == ["batch", 80, "seq_len"] and dims["mask"] == ["batch", 1, "seq_len"]
    assert dims["t"] == ["batch"] and dims["spks"] == ["batch", 80]

    worst = verify_onnx(path, estimator, streaming=streaming, shapes=SHAPES, rtol=RTOL, atol=ATOL)
    assert worst < ATOL


class _OrtEstimator(torch.nn.Module):
    """An onnxruntime session behind the estimator signature (what a TensorRT engine also is)."""

    def __init__(self, path) -> None:
        super().__init__()
        import onnxruntime as ort

        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def forward(self, x, mask, mu, t, spks, cond, streaming=False):
        feeds = {n: a.detach().cpu().numpy() for n, a in zip(INPUT_NAMES, (x, mask, mu, t, spks, cond))}
        return torch.from_numpy(self.session.run([OUTPUT_NAME], feeds)[0]).to(x)


@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_swapped_estimator_gives_the_same_mel(family, tmp_path):
    """The CFM solver runs any module with the estimator signature: the ONNX estimator inside
    a batched solve gives the torch mel."""
    flow = copy.deepcopy(_flow(family))
    gen = torch.Generator().manual_seed(2)
    items = [_item(gen, flow, 20, 40, False, True), _item(gen, flow, 9, 21, False, False)]
    ref = flow.inference_batch(items)
    flow.decoder.estimator = _OrtEstimator(export_estimator(flow.decoder.estimator, tmp_path / "e.onnx"))
    for a, b in zip(ref, flow.inference_batch(items)):
        assert a.shape == b.shape and (a - b).abs().max().item() < 5e-4
