"""ONNX export of the flow estimator (CV2 U-Net / CV3 DiT), the input of the TensorRT build.

Same tensor interface as the official ``flow.decoder.estimator.fp32.onnx`` (spec §7.3): inputs
``x (B, 80, T)``, ``mask (B, 1, T)``, ``mu (B, 80, T)``, ``t (B,)``, ``spks (B, 80)``,
``cond (B, 80, T)`` in this order, output ``estimator_out (B, 80, T)``, float32. Unlike the
official file the batch axis is dynamic too (the official one is fixed at 2 = one CFG pair),
so one engine serves batched CFM solves of several requests (spec §6.2 C).

The attention pattern is baked in at export: ``streaming=False`` gives full (padding-only)
attention like the official export; ``streaming=True`` gives a second model with the
50-frame chunk masks, so streaming calls need not fall back to full attention (spec §9.3
item 5).

CLI (offline tooling, never run inside a replica)::

    python -m cosyvoice_runtime.trt.export --model-dir DIR --out estimator.onnx [--streaming]
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

INPUT_NAMES = ("x", "mask", "mu", "t", "spks", "cond")
OUTPUT_NAME = "estimator_out"
DEFAULT_OPSET = 18
# Shapes of the dummy inputs the graph is traced with (the axes stay dynamic).
DUMMY_BATCH = 2
DUMMY_FRAMES = 256
# The official export check (rtol 1e-2, atol 1e-4) on random lengths.
VERIFY_RTOL = 1e-2
VERIFY_ATOL = 1e-4


class EstimatorForExport(nn.Module):
    """The estimator with its attention pattern fixed: ``forward(x, mask, mu, t, spks, cond)``."""

    def __init__(self, estimator: nn.Module, streaming: bool) -> None:
        super().__init__()
        self.estimator = estimator
        self.streaming = streaming

    def forward(self, x, mask, mu, t, spks, cond):
        return self.estimator(x, mask, mu, t, spks, cond, self.streaming)


def dummy_inputs(n_mels: int, spk_dim: int, batch: int, frames: int, seed: int = 0,
                 lengths: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    """Random float32 estimator inputs; ``lengths`` (per item, ≤ frames) right-pads the mask."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n_mels, frames, generator=gen)
    mu = torch.randn(batch, n_mels, frames, generator=gen)
    cond = torch.randn(batch, n_mels, frames, generator=gen)
    spks = torch.randn(batch, spk_dim, generator=gen)
    t = torch.rand(batch, generator=gen)
    mask = torch.ones(batch, 1, frames)
    for i, n in enumerate(lengths or []):
        mask[i, :, n:] = 0.0
    return x, mask, mu, t, spks, cond


def _estimator_dims(estimator: nn.Module) -> tuple[int, int]:
    """(mel channels, speaker-vector width) of a U-Net or DiT estimator."""
    spec = estimator.spec
    if hasattr(spec, "spk_dim"):  # DiTSpec
        return spec.mel_dim, spec.spk_dim
    return spec.out_channels, spec.out_channels  # UNetSpec: spks is projected to the mel width


def export_estimator(estimator: nn.Module, path: str | Path, streaming: bool = False,
                     opset: int = DEFAULT_OPSET) -> Path:
    """Trace ``estimator`` (eval, float32, CPU copy) to ONNX with dynamic batch and T axes."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    device = next(estimator.parameters()).device
    dtype = next(estimator.parameters()).dtype
    module = EstimatorForExport(estimator, streaming).eval()
    if device.type != "cpu" or dtype != torch.float32:
        raise ValueError(f"export a float32 CPU estimator (got {dtype} on {device}); TensorRT sets precision later")
    n_mels, spk_dim = _estimator_dims(estimator)
    args = dummy_inputs(n_mels, spk_dim, DUMMY_BATCH, DUMMY_FRAMES)
    seq = {0: "batch", 2: "seq_len"}
    dynamic_axes = {"x": seq, "mask": seq, "mu": seq, "cond": seq, OUTPUT_NAME: seq,
                    "t": {0: "batch"}, "spks": {0: "batch"}}
    with torch.no_grad():
        torch.onnx.export(
            module, args, str(path), dynamo=False, input_names=list(INPUT_NAMES), output_names=[OUTPUT_NAME],
            dynamic_axes=dynamic_axes, opset_version=opset, do_constant_folding=True, export_params=True,
        )
    logger.info("exported %s estimator (streaming=%s, opset %d) to %s", type(estimator).__name__, streaming, opset, path)
    return path


def verify_onnx(path: str | Path, estimator: nn.Module, streaming: bool = False,
                shapes: tuple[tuple[int, int], ...] = ((1, 16), (2, 137), (4, 333)),
                rtol: float = VERIFY_RTOL, atol: float = VERIFY_ATOL) -> float:
    """Run the ONNX file with onnxruntime (CPU) against the torch estimator.

    Every ``(batch, frames)`` shape is checked with right-padded items (each row a different
    length) so the key-padding path is exercised too.

    Returns:
        the largest absolute deviation seen.

    Raises:
        AssertionError: a deviation exceeds ``atol + rtol * |reference|``.
    """
    import onnxruntime as ort  # optional backend, imported only here

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    n_mels, spk_dim = _estimator_dims(estimator)
    worst = 0.0
    for seed, (batch, frames) in enumerate(shapes):
        lengths = [max(1, frames - 7 * i) for i in range(batch)]
        args = dummy_inputs(n_mels, spk_dim, batch, frames, seed=seed, lengths=lengths)
        with torch.inference_mode():
            ref = estimator(*args, streaming=streaming).numpy()
        got = session.run([OUTPUT_NAME], {name: a.numpy() for name, a in zip(INPUT_NAMES, args)})[0]
        err = abs(got - ref)
        worst = max(worst, float(err.max()))
        bad = err > atol + rtol * abs(ref)
        if bad.any():
            raise AssertionError(f"{path}: batch {batch} T {frames}: max err {err.max():.3e}, "
                                 f"{int(bad.sum())} of {err.size} outside rtol {rtol} atol {atol}")
    return worst


def main(argv: list[str] | None = None) -> int:
    from cosyvoice_runtime.flow.flow import build_flow
    from cosyvoice_runtime.weights import load_checkpoint
    from cosyvoice_runtime.yaml_config import read_model_spec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--streaming", action="store_true", help="bake in the chunk attention masks")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET)
    parser.add_argument("--no-verify", action="store_true", help="skip the onnxruntime check")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    spec = read_model_spec(args.model_dir)
    flow = build_flow(spec.flow)
    load_checkpoint(flow, args.model_dir / spec.files["flow"])
    estimator = flow.decoder.estimator.eval()
    export_estimator(estimator, args.out, streaming=args.streaming, opset=args.opset)
    if not args.no_verify:
        worst = verify_onnx(args.out, estimator, streaming=args.streaming)
        logger.info("onnxruntime matches torch (max abs err %.2e)", worst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
