"""ONNX export of the tiny CV2 / CV3 estimators: onnxruntime (CPU) equals torch for several
batch sizes and lengths (dynamic batch and T axes), with full and with chunk attention."""
from __future__ import annotations

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from cosyvoice_runtime.trt.export import (
    DEFAULT_OPSET,
    INPUT_NAMES,
    OUTPUT_NAME,
    export_estimator,
    verify_onnx,
)
from tests.runtime.test_flow_batch import _flow

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
