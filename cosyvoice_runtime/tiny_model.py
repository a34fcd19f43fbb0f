"""Write a tiny random-weight model directory in the exact official layout.

It is the embedded default for demos and tests, since real weights cannot be bundled: the
audio it produces is NOT speech. The directory has the official file set (``<family>.yaml``,
``llm.pt``, ``flow.pt``, ``hift.pt``, ``CosyVoice-BlankEN/``, ``campplus.onnx``,
``speech_tokenizer_v{2,3}.onnx``) and loads through exactly the same code path as a real one.

    python -m cosyvoice_runtime.tiny_model --family cosyvoice2 --out models/tiny-cosyvoice2
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.weights import ours_to_official
from cosyvoice_runtime.yaml_config import read_model_spec

logger = logging.getLogger(__name__)

# Tiny sizes (same wiring as the released models). The text vocabulary keeps the released
# 151936 rows so that the real special-token ids (151646...) stay valid.
TINY_DIMS = {
    "cosyvoice2": {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "inter": 96, "flow_in": 32, "enc_out": 32,
                   "enc_heads": 4, "enc_units": 64, "enc_blocks": 2, "unet_ch": 32, "unet_head_dim": 16,
                   "unet_blocks": 1, "unet_mid": 2, "unet_heads": 2, "hift_ch": 32},
    "cosyvoice3": {"hidden": 32, "layers": 2, "heads": 4, "kv_heads": 2, "inter": 96, "pre_ch": 64, "dit_dim": 48,
                   "dit_depth": 2, "dit_heads": 3, "dit_head_dim": 16, "hift_ch": 32},
}
# The released architectures, for benchmarks with random weights (no download needed).
_FULL = {
    "cosyvoice2": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "inter": 4864, "flow_in": 512,
                   "enc_out": 512, "enc_heads": 8, "enc_units": 2048, "enc_blocks": 6, "unet_ch": 256,
                   "unet_head_dim": 64, "unet_blocks": 4, "unet_mid": 12, "unet_heads": 8, "hift_ch": 512},
    "cosyvoice3": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "inter": 4864, "pre_ch": 1024,
                   "dit_dim": 1024, "dit_depth": 22, "dit_heads": 16, "dit_head_dim": 64, "hift_ch": 512},
}
TEXT_VOCAB_ROWS = 151936

_HIFT_COMMON = """    in_channels: 80
    base_channels: {hift_ch}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
"""

_CFM = """    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
"""


# First line of every config this module writes: how a served directory is known to be random-weight.
RANDOM_WEIGHT_MARKER = "# Tiny RANDOM-WEIGHT model"


def is_random_weight_model(model_dir: str | Path) -> bool:
    """True for a directory written by this module (its ``<family>.yaml`` starts with the marker)."""
    for family in ("cosyvoice2", "cosyvoice3"):
        try:
            with open(Path(model_dir) / f"{family}.yaml", encoding="utf-8") as f:
                return f.readline().startswith(RANDOM_WEIGHT_MARKER)
        except OSError:
            continue
    return False


def _yaml_text(family: str, dims: dict) -> str:
    d = dims
    head = f"""{RANDOM_WEIGHT_MARKER} written by cosyvoice_runtime.tiny_model: it does not speak.
# Same classes and wiring as the released {family}.yaml, shrunken sizes.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
sample_rate: 24000
llm_input_size: {d['hidden']}
llm_output_size: {d['hidden']}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.{'Qwen2LM' if family == 'cosyvoice2' else 'CosyVoice3LM'}
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

"""
    if family == "cosyvoice2":
        flow = f"""flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {d['flow_in']}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {d['enc_out']}
        attention_heads: {d['enc_heads']}
        linear_units: {d['enc_units']}
        num_blocks: {d['enc_blocks']}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {d['flow_in']}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
{_CFM}        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{d['unet_ch']}]
            dropout: 0.0
            attention_head_dim: {d['unet_head_dim']}
            n_blocks: {d['unet_blocks']}
            num_mid_blocks: {d['unet_mid']}
            num_heads: {d['unet_heads']}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
{_HIFT_COMMON.format(hift_ch=d['hift_ch'])}    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {d['hift_ch']}
"""
        fmax = "8000"
    else:
        flow = f"""flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {d['pre_ch']}
        pre_lookahead_len: 3
{_CFM}        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {d['dit_dim']}
            depth: {d['dit_depth']}
            heads: {d['dit_heads']}
            dim_head: {d['dit_head_dim']}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
{_HIFT_COMMON.format(hift_ch=d['hift_ch'])}    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {d['hift_ch']}
"""
        fmax = "null"
    tail = f"""
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True{'' if family == 'cosyvoice2' else chr(10) + '    version: cosyvoice3'}
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: {fmax}
    center: False
"""
    return head + flow + tail


def _backbone_config(dims: dict) -> dict:
    d = dims
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": d["hidden"], "intermediate_size": d["inter"], "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"], "num_key_value_heads": d["kv_heads"], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 32768, "sliding_window": 32768,
        "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": TEXT_VOCAB_ROWS,
        "bos_token_id": 151643, "eos_token_id": 151643, "torch_dtype": "float32",
    }


def write_config_dir(out_dir: str | Path, family: str, dims: dict | None = None) -> ModelSpec:
    """Write only ``<family>.yaml`` + ``CosyVoice-BlankEN/config.json`` (full size by default).

    Enough for :func:`~cosyvoice_runtime.yaml_config.read_model_spec`, so benchmarks can build the released
    architectures with random weights without writing gigabytes of checkpoints.
    """
    out = Path(out_dir)
    dims = dims or _FULL[family]
    (out / "CosyVoice-BlankEN").mkdir(parents=True, exist_ok=True)
    (out / f"{family}.yaml").write_text(_yaml_text(family, dims), encoding="utf-8")
    (out / "CosyVoice-BlankEN" / "config.json").write_text(json.dumps(_backbone_config(dims), indent=2))
    return read_model_spec(out)


DEFAULT_VOICE_WAV = "default_voice.wav"
DEFAULT_VOICE_TEXT = "default_voice.txt"
DEFAULT_VOICE_TRANSCRIPT = "This is the default demo voice of the tiny model."


def write_default_voice(model_dir: Path, seed: int = 0, seconds: float = 4.0, sample_rate: int = 24000) -> None:
    """A synthetic prompt recording (a gliding harmonic tone with breath noise) and its transcript,
    so the demo service has a ``default`` voice without anyone recording one. Not speech either."""
    import numpy as np
    import soundfile as sf

    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    f0 = 140 + 25 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t) ** 2
    wav = 0.2 * envelope * voiced + 0.01 * rng.standard_normal(t.size)
    sf.write(model_dir / DEFAULT_VOICE_WAV, (wav / np.abs(wav).max() * 0.7).astype(np.float32), sample_rate,
             subtype="PCM_16")
    (model_dir / DEFAULT_VOICE_TEXT).write_text(DEFAULT_VOICE_TRANSCRIPT + "\n", encoding="utf-8")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_tiny_model(out_dir: str | Path, family: str = "cosyvoice2", seed: int = 0, overwrite: bool = False,
                     size: str = "tiny") -> Path:
    """Write the tiny model directory atomically (temp dir + rename) and return its path.

    ``size="full"``: the same directory with the full-size architecture's random weights (the
    official hyper-parameters, ~2 GB of checkpoints): a GPU replica's real cost without real weights.
    The tokenizer, voice prompt and ONNX feature models stay tiny.
    """
    from cosyvoice_runtime import tiny_assets
    from cosyvoice_runtime.model import build_modules

    if family not in TINY_DIMS:
        raise ValueError(f"family must be one of {sorted(TINY_DIMS)}, got {family!r}")
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    out = Path(out_dir)
    if out.exists():
        if not overwrite:
            return out
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        spec = write_config_dir(tmp, family, TINY_DIMS[family] if size == "tiny" else None)
        tiny_assets.write_tokenizer(tmp / "CosyVoice-BlankEN", family)
        # PyTorch's default initialisation is already fan-in scaled; fork the RNG so writing a
        # model never disturbs the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            modules = build_modules(spec, device="cpu")
        for name, module in modules.items():
            torch.save(ours_to_official(module), tmp / spec.files[name])
        write_default_voice(tmp, seed=seed)
        tiny_assets.write_campplus_onnx(tmp / spec.files["campplus"], seed=seed)
        tiny_assets.write_speech_tokenizer_onnx(tmp / spec.files["speech_tokenizer"], seed=seed)
        manifest = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / "checksums.json").write_text(json.dumps(manifest, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s random-weight %s model to %s", size, family, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(TINY_DIMS), default="cosyvoice2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--size", choices=["tiny", "full"], default="tiny",
                        help="full: the full-size architecture with random weights (GPU benchmarks)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    print(write_tiny_model(args.out, args.family, args.seed, args.overwrite, size=args.size))


if __name__ == "__main__":
    main()
