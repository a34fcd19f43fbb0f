"""Tiny stand-ins for the frontend assets of a model directory (used by :mod:`tiny_model`).

* :func:`write_tokenizer`: a ``CosyVoice-BlankEN``-format tokenizer (Qwen2 byte-level BPE) that
  ``AutoTokenizer.from_pretrained(dir)`` loads offline. The regular vocabulary is the 256-symbol
  byte alphabet, a handful of merges and inert filler entries up to the Qwen2 size, so every special
  token sits at its released id (151643... ``<|endoftext|>``, 151646 ``<|endofprompt|>``) and the
  total length is 151663 (CV2) / 151924 (CV3). Byte-level means any text encodes without unknowns.
* :func:`write_campplus_onnx`: input ``"input"`` float32 ``(1, T, 80)`` -> float32 ``(1, 192)``.
* :func:`write_speech_tokenizer_onnx`: input 0 float32 ``(1, 128, T)``, input 1 int32 ``[1]`` ->
  int64 ids ``(1, ceil(ceil(T/2)/2))`` in ``[0, 3^8 - 1]`` (two stride-2 convs + an FSQ-style
  ternary quantiser, like the released tokenizers' output contract).

The ONNX graphs are small, seeded random layers: deterministic and input-dependent, not speech models.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cosyvoice_runtime.frontend.special_tokens import (
    EOS_TOKEN,
    QWEN_BASE_SPECIALS,
    QWEN_BASE_VOCAB,
    family_specials,
)

FBANK_BINS = 80
SPEAKER_DIM = 192
WHISPER_BINS = 128
FSQ_DIMS = 8  # 3^8 = 6561 codes
FSQ_LEVELS = 3
ONNX_OPSET = 17

# Merges that make common English/ASCII text shorter than one id per byte (order = priority).
_TINY_MERGES = ("Ġ t", "h e", "Ġ a", "i n", "Ġt he", "e r", "o n", "Ġ s", "r e", "a n")


def _byte_alphabet() -> list[str]:
    """GPT-2 byte-to-unicode table: printable bytes map to themselves, others to U+0100..."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def write_tokenizer(out_dir: str | Path, family: str = "cosyvoice2", with_cosyvoice_specials: bool = True) -> Path:
    """Write vocab.json, merges.txt and tokenizer_config.json (leaves an existing config.json alone).

    ``with_cosyvoice_specials=False`` writes only the Qwen2 base specials, like the released
    ``CosyVoice-BlankEN`` (the runtime then registers the family's tokens itself).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {}
    for sym in _byte_alphabet():
        vocab[sym] = len(vocab)
    for merge in _TINY_MERGES:
        vocab["".join(merge.split())] = len(vocab)
    # Inert fillers: never produced (no merge builds them), they only pad the ids to the Qwen2 size.
    while len(vocab) < QWEN_BASE_VOCAB:
        vocab[f"<unused_{len(vocab)}>"] = len(vocab)

    specials = list(QWEN_BASE_SPECIALS)
    if with_cosyvoice_specials:
        specials += list(family_specials(family))  # type: ignore[arg-type]
    added = {
        str(QWEN_BASE_VOCAB + i): {"content": tok, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": True}
        for i, tok in enumerate(specials)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": specials[1:],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 32768,
    }
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(_TINY_MERGES) + "\n", encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1), encoding="utf-8")
    return out


def _save(graph, path: str | Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", ONNX_OPSET)],
                              producer_name="cosyvoice_runtime.tiny_assets")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def write_campplus_onnx(path: str | Path, seed: int = 0) -> Path:
    """Tiny CAM++ stand-in: ``(1, T, 80)`` fbank -> tanh(x W1 + b1) -> mean over T -> W2 -> ``(1, 192)``."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed + 101)
    hidden = 64
    w1 = (rng.standard_normal((FBANK_BINS, hidden)) / np.sqrt(FBANK_BINS)).astype(np.float32)
    b1 = (0.1 * rng.standard_normal(hidden)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, SPEAKER_DIM)) / np.sqrt(hidden)).astype(np.float32)
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"),
             numpy_helper.from_array(w2, "w2")]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h2"]),
        helper.make_node("ReduceMean", ["h2"], ["pooled"], axes=[1], keepdims=0),  # (1, hidden)
        helper.make_node("MatMul", ["pooled", "w2"], ["embedding"]),
    ]
    graph = helper.make_graph(
        nodes, "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", FBANK_BINS])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, SPEAKER_DIM])],
        initializer=inits,
    )
    return _save(graph, path)


def write_speech_tokenizer_onnx(path: str | Path, seed: int = 0) -> Path:
    """Tiny speech-tokenizer stand-in with the released input/output contract (see module doc)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed + 202)
    ch = 16
    # Gains chosen so tanh outputs straddle the +-0.5 rounding thresholds for log-mel inputs.
    w1 = (2.0 * rng.standard_normal((ch, WHISPER_BINS, 3)) / np.sqrt(3 * WHISPER_BINS)).astype(np.float32)
    w2 = (2.0 * rng.standard_normal((FSQ_DIMS, ch, 3)) / np.sqrt(3 * ch)).astype(np.float32)
    b2 = (0.3 * rng.standard_normal(FSQ_DIMS)).astype(np.float32)
    powers = (FSQ_LEVELS ** np.arange(FSQ_DIMS)).astype(np.float32)
    inits = [
        numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(b2, "b2"),
        numpy_helper.from_array(powers, "powers"), numpy_helper.from_array(np.float32(0.999), "shrink"),
        numpy_helper.from_array(np.float32(1.0), "one"),
    ]
    conv = {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}  # T -> ceil(T / 2)
    nodes = [
        helper.make_node("Conv", ["feats", "w1"], ["c1"], **conv),
        helper.make_node("Tanh", ["c1"], ["a1"]),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], **conv),  # (1, 8, T')
        helper.make_node("Tanh", ["c2"], ["a2"]),
        helper.make_node("Mul", ["a2", "shrink"], ["a3"]),
        helper.make_node("Round", ["a3"], ["q"]),  # {-1, 0, 1}
        helper.make_node("Add", ["q", "one"], ["digits"]),  # {0, 1, 2}
        helper.make_node("Transpose", ["digits"], ["digits_t"], perm=[0, 2, 1]),  # (1, T', 8)
        helper.make_node("MatMul", ["digits_t", "powers"], ["code_f"]),  # (1, T') base-3 index
        helper.make_node("Cast", ["code_f"], ["tokens"], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes, "tiny_speech_tokenizer",
        [helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, WHISPER_BINS, "T"]),
         helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1])],
        [helper.make_tensor_value_info("tokens", TensorProto.INT64, [1, "T_out"])],
        initializer=inits,
    )
    return _save(graph, path)
