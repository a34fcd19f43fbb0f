"""Read an official ``cosyvoice2.yaml`` / ``cosyvoice3.yaml`` without the official code.

The files are HyperPyYAML: ``!new:pkg.Class`` / ``!name:pkg.func`` / ``!apply:func`` tags name
classes we do not have, and ``!ref <key>`` refers to other keys (optionally with arithmetic,
``!ref <chunk_size> * <token_mel_ratio>``). We parse every tag as plain data (never import or
call anything), resolve references, then map each section onto the spec dataclasses of
:mod:`cosyvoice_runtime.config`, checking class names and rejecting unknown or missing keys
with an error that names the file and the key path.
"""
from __future__ import annotations

import ast
import json
import operator
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cosyvoice_runtime.config import (
    CV3_SILENT_TOKENS,
    ConformerEncoderSpec,
    DiTSpec,
    FlowSpec,
    HiftSpec,
    LLMSpec,
    MelSpec,
    ModelSpec,
    Qwen2Spec,
    StreamSpec,
    UNetSpec,
)
from cosyvoice_runtime.errors import ConfigError, ModelLoadError

YAML_NAMES = {"cosyvoice2": "cosyvoice2.yaml", "cosyvoice3": "cosyvoice3.yaml"}
TOKENIZER_DIR = "CosyVoice-BlankEN"

# Top-level keys of the released yamls that only the training pipeline reads.
_TRAINING_KEYS = {
    "hifigan", "parquet_opener", "tokenize", "filter", "resample", "truncate", "compute_fbank",
    "compute_whisper_fbank", "compute_f0", "parse_embedding", "shuffle", "sort", "batch", "padding",
    "data_pipeline", "data_pipeline_gan", "train_conf", "train_conf_gan", "mel_spec_transform1",
    "text_encoder_input_size", "onnx_path", "get_tokenizer", "allowed_special", "qwen_pretrain_path",
    "num_decoding_left_chunks", "spk_embed_dim", "llm_input_size", "llm_output_size", "flow_encoder",
}
# Constructor arguments that exist for training only (dropout, losses...).
_IGNORED_ARGS = {
    "length_normalized_loss", "lsm_weight", "dropout_rate", "positional_dropout_rate",
    "attention_dropout_rate", "dropout", "output_type", "only_mask_loss", "input_frame_rate",
    "n_spks", "num_decoding_left_chunks", "act_fn", "training_cfg_rate", "sigma_min",
    "reg_loss_type", "use_cnn_module", "macaron_style", "normalize_before", "input_layer",
    "pos_enc_layer_type", "selfattention_layer_type", "long_skip_connection", "num_class",
    "in_channels_unused", "key_bias", "activation_type", "dpo", "solver", "pretrain_path",
}


@dataclass(frozen=True)
class Tagged:
    """A ``!new:`` / ``!name:`` / ``!apply:`` node kept as data."""

    kind: str
    target: str  # dotted name, e.g. cosyvoice.llm.llm.Qwen2LM
    args: Any

    @property
    def cls(self) -> str:
        return self.target.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Ref:
    expr: str


class _Loader(yaml.SafeLoader):
    pass


def _tagged(kind: str):
    def construct(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Tagged:
        if isinstance(node, yaml.MappingNode):
            args = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            args = loader.construct_sequence(node, deep=True)
        else:
            args = loader.construct_scalar(node)
        return Tagged(kind, suffix, args)

    return construct


for _kind in ("new", "name", "apply"):
    _Loader.add_multi_constructor(f"!{_kind}:", _tagged(_kind))
_Loader.add_constructor("!ref", lambda loader, node: Ref(loader.construct_scalar(node)))
# YAML 1.1 (PyYAML) reads "1e-06" as a string; HyperPyYAML (ruamel) reads it as a float.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)

_REF_RE = re.compile(r"<([^<>]+)>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv}


def _eval_arith(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval_arith(node.left), _eval_arith(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval_arith(node.operand)
    raise ValueError("only numbers and + - * / are allowed")


def _resolve(value: Any, root: dict, path: Path, key: str, depth: int = 0) -> Any:
    if depth > 32:
        raise ConfigError(path, key, "reference cycle")
    if isinstance(value, Ref):
        names = _REF_RE.findall(value.expr)
        for name in names:
            if name not in root:
                raise ConfigError(path, key, f"!ref to unknown key '{name}'")
        if _REF_RE.fullmatch(value.expr.strip()):
            return _resolve(root[names[0]], root, path, key, depth + 1)
        expr = _REF_RE.sub(lambda m: repr(_resolve(root[m.group(1)], root, path, key, depth + 1)), value.expr)
        try:
            return _eval_arith(ast.parse(expr, mode="eval"))
        except (SyntaxError, ValueError) as exc:
            raise ConfigError(path, key, f"cannot evaluate !ref '{value.expr}': {exc}") from exc
    if isinstance(value, Tagged):
        return Tagged(value.kind, value.target, _resolve(value.args, root, path, key, depth + 1))
    if isinstance(value, dict):
        return {k: _resolve(v, root, path, f"{key}.{k}", depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, root, path, key, depth + 1) for v in value]
    return value


def load_tagged_yaml(path: Path) -> dict:
    """Parse a HyperPyYAML file into plain data (tags -> :class:`Tagged`, refs resolved)."""
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)  # _Loader is a yaml.SafeLoader
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(path, "top level must be a mapping")
    return {k: _resolve(v, raw, path, str(k)) for k, v in raw.items()}


class _Section:
    """Typed access to one constructor's arguments, tracking which keys were consumed."""

    def __init__(self, path: Path, key: str, node: Any, classes: tuple[str, ...] | None = None):
        self.path, self.key = path, key
        if classes is not None and (not isinstance(node, Tagged) or node.cls not in classes):
            found = node.target if isinstance(node, Tagged) else type(node).__name__
            raise ConfigError(path, key, f"expected one of {list(classes)}, found {found}")
        args = node.args if isinstance(node, Tagged) else node
        if not isinstance(args, dict):
            raise ConfigError(path, key, f"expected a mapping of arguments, found {type(args).__name__}")
        self.cls = node.cls if isinstance(node, Tagged) else None
        self.args, self.used = args, set()

    def raw(self, name: str, default: Any = ...) -> Any:
        self.used.add(name)
        if name not in self.args:
            if default is ...:
                raise ConfigError(self.path, f"{self.key}.{name}", "missing")
            return default
        return self.args[name]

    def num(self, name: str, kind: type = int, default: Any = ...) -> Any:
        value = self.raw(name, default)
        if value is None and default is None:
            return None
        try:
            out = kind(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(self.path, f"{self.key}.{name}", f"expected {kind.__name__}, found {value!r}") from exc
        if kind is int and isinstance(value, float) and value != out:
            raise ConfigError(self.path, f"{self.key}.{name}", f"expected an integer, found {value!r}")
        return out

    def ints(self, name: str) -> tuple:
        value = self.raw(name)
        if not isinstance(value, list):
            raise ConfigError(self.path, f"{self.key}.{name}", f"expected a list, found {value!r}")
        return tuple(tuple(int(x) for x in v) if isinstance(v, list) else int(v) for v in value)

    def sub(self, name: str, classes: tuple[str, ...] | None = None) -> _Section:
        return _Section(self.path, f"{self.key}.{name}", self.raw(name), classes)

    def done(self) -> None:
        unknown = sorted(set(self.args) - self.used - _IGNORED_ARGS)
        if unknown:
            raise ConfigError(self.path, f"{self.key}.{unknown[0]}", f"unknown key (unknown: {unknown})")


def _read_backbone(model_dir: Path) -> Qwen2Spec:
    path = model_dir / TOKENIZER_DIR / "config.json"
    if not path.is_file():
        raise ModelLoadError(path, "file is missing (Qwen2 backbone config)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(path, f"is not valid JSON: {exc}") from exc
    sec = _Section(path, "config", cfg)
    spec = Qwen2Spec(
        hidden_size=sec.num("hidden_size"),
        num_layers=sec.num("num_hidden_layers"),
        num_heads=sec.num("num_attention_heads"),
        num_kv_heads=sec.num("num_key_value_heads"),
        intermediate_size=sec.num("intermediate_size"),
        vocab_size=sec.num("vocab_size"),
        rms_norm_eps=sec.num("rms_norm_eps", float),
        rope_theta=sec.num("rope_theta", float, 10000.0),
        tie_word_embeddings=bool(sec.raw("tie_word_embeddings", False)),
    )
    if spec.hidden_size % spec.num_heads or spec.num_heads % spec.num_kv_heads:
        raise ModelLoadError(path, "hidden_size / heads / kv heads are not divisible")
    return spec  # other HF keys (dropout, bos ids, ...) are irrelevant here


def _read_llm(sec: _Section, family: str, backbone: Qwen2Spec) -> LLMSpec:
    expected = "Qwen2LM" if family == "cosyvoice2" else "CosyVoice3LM"
    if sec.cls != expected:
        raise ConfigError(sec.path, "llm", f"{family} needs {expected}, found {sec.cls}")
    sec.sub("llm", ("Qwen2Encoder",)).raw("pretrain_path", None)
    samp = sec.sub("sampling", ("ras_sampling",))
    mix = sec.ints("mix_ratio") if "mix_ratio" in sec.args else (5, 15)
    spec = LLMSpec(
        family=family, backbone=backbone,
        speech_token_size=sec.num("speech_token_size"),
        llm_input_size=sec.num("llm_input_size"), llm_output_size=sec.num("llm_output_size"),
        mix_ratio=(int(mix[0]), int(mix[1])),
        top_p=samp.num("top_p", float), top_k=samp.num("top_k"),
        win_size=samp.num("win_size"), tau_r=samp.num("tau_r", float),
    )
    samp.done()
    sec.done()
    if spec.llm_input_size != backbone.hidden_size or spec.llm_output_size != backbone.hidden_size:
        raise ConfigError(sec.path, "llm.llm_input_size", f"{spec.llm_input_size} != backbone hidden {backbone.hidden_size}")
    return spec


def _read_flow(sec: _Section, family: str) -> FlowSpec:
    expected = "CausalMaskedDiffWithXvec" if family == "cosyvoice2" else "CausalMaskedDiffWithDiT"
    if sec.cls != expected:
        raise ConfigError(sec.path, "flow", f"{family} needs {expected}, found {sec.cls}")
    dec = sec.sub("decoder", ("CausalConditionalCFM",))
    cfm = dec.sub("cfm_params", ("DictConfig",))
    cfm_args = cfm.sub("content")
    t_sched = str(cfm_args.raw("t_scheduler", "cosine"))
    cfg_rate = cfm_args.num("inference_cfg_rate", float)
    cfm_args.done()
    cfm.done()
    dec.raw("spk_emb_dim")
    dec.raw("in_channels")
    common = {
        "family": family, "input_size": sec.num("input_size"), "output_size": sec.num("output_size"),
        "spk_embed_dim": sec.num("spk_embed_dim"), "vocab_size": sec.num("vocab_size"),
        "token_mel_ratio": sec.num("token_mel_ratio"), "pre_lookahead_len": sec.num("pre_lookahead_len"),
        "inference_cfg_rate": cfg_rate, "t_scheduler": t_sched,
    }
    if family == "cosyvoice2":
        enc = sec.sub("encoder", ("UpsampleConformerEncoder",))
        encoder = ConformerEncoderSpec(
            input_size=enc.num("input_size"), output_size=enc.num("output_size"),
            attention_heads=enc.num("attention_heads"), linear_units=enc.num("linear_units"),
            num_blocks=enc.num("num_blocks"), num_up_blocks=enc.num("num_up_blocks", int, 4),
            static_chunk_size=enc.num("static_chunk_size"),
            pre_lookahead_len=common["pre_lookahead_len"],
        )
        enc.done()
        est = dec.sub("estimator", ("CausalConditionalDecoder",))
        unet = UNetSpec(
            in_channels=est.num("in_channels"), out_channels=est.num("out_channels"),
            channels=est.ints("channels"), attention_head_dim=est.num("attention_head_dim"),
            n_blocks=est.num("n_blocks"), num_mid_blocks=est.num("num_mid_blocks"),
            num_heads=est.num("num_heads"), static_chunk_size=est.num("static_chunk_size"),
        )
        est.done()
        spec = FlowSpec(**common, encoder=encoder, unet=unet)
    else:
        pre = sec.sub("pre_lookahead_layer", ("PreLookaheadLayer",))
        if pre.num("in_channels") != common["input_size"] or pre.num("pre_lookahead_len") != common["pre_lookahead_len"]:
            raise ConfigError(sec.path, "flow.pre_lookahead_layer", "in_channels/pre_lookahead_len disagree with flow")
        channels = pre.num("channels")
        pre.done()
        est = dec.sub("estimator", ("DiT",))
        dit = DiTSpec(
            dim=est.num("dim"), depth=est.num("depth"), heads=est.num("heads"), dim_head=est.num("dim_head"),
            ff_mult=est.num("ff_mult"), mel_dim=est.num("mel_dim"), mu_dim=est.num("mu_dim"),
            spk_dim=est.num("spk_dim"), out_channels=est.num("out_channels"),
            static_chunk_size=est.num("static_chunk_size"),
        )
        est.done()
        spec = FlowSpec(**common, pre_lookahead_channels=channels, dit=dit)
    dec.done()
    sec.done()
    return spec


def _read_hift(sec: _Section, family: str) -> HiftSpec:
    causal = family == "cosyvoice3"
    expected = "CausalHiFTGenerator" if causal else "HiFTGenerator"
    if sec.cls != expected:
        raise ConfigError(sec.path, "hift", f"{family} needs {expected}, found {sec.cls}")
    f0 = sec.sub("f0_predictor", ("CausalConvRNNF0Predictor",) if causal else ("ConvRNNF0Predictor",))
    f0_cond, f0_in = f0.num("cond_channels"), f0.num("in_channels")
    f0.done()
    istft = sec.sub("istft_params")
    spec = HiftSpec(
        causal=causal, in_channels=sec.num("in_channels"), base_channels=sec.num("base_channels"),
        nb_harmonics=sec.num("nb_harmonics"), sampling_rate=sec.num("sampling_rate"),
        nsf_alpha=sec.num("nsf_alpha", float), nsf_sigma=sec.num("nsf_sigma", float),
        nsf_voiced_threshold=sec.num("nsf_voiced_threshold", float),
        upsample_rates=sec.ints("upsample_rates"), upsample_kernel_sizes=sec.ints("upsample_kernel_sizes"),
        istft_n_fft=istft.num("n_fft"), istft_hop=istft.num("hop_len"),
        resblock_kernel_sizes=sec.ints("resblock_kernel_sizes"),
        resblock_dilation_sizes=sec.ints("resblock_dilation_sizes"),
        source_resblock_kernel_sizes=sec.ints("source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=sec.ints("source_resblock_dilation_sizes"),
        lrelu_slope=sec.num("lrelu_slope", float), audio_limit=sec.num("audio_limit", float),
        f0_cond_channels=f0_cond,
        conv_pre_look_right=sec.num("conv_pre_look_right", int, 4 if causal else 0),
        f0_look_right=3 if causal else 0,
    )
    istft.done()
    sec.done()
    if f0_in != spec.in_channels:
        raise ConfigError(sec.path, "hift.f0_predictor.in_channels", f"{f0_in} != hift in_channels {spec.in_channels}")
    return spec


def _read_mel(sec: _Section) -> MelSpec:
    if sec.cls != "mel_spectrogram":
        raise ConfigError(sec.path, "feat_extractor", f"expected mel_spectrogram, found {sec.cls}")
    spec = MelSpec(
        n_fft=sec.num("n_fft"), num_mels=sec.num("num_mels"), sampling_rate=sec.num("sampling_rate"),
        hop_size=sec.num("hop_size"), win_size=sec.num("win_size"), fmin=sec.num("fmin", float),
        fmax=sec.num("fmax", float, None),
    )
    if sec.raw("center", False):
        raise ConfigError(sec.path, "feat_extractor.center", "only center: False is supported (as released)")
    sec.done()
    return spec


def detect_family(model_dir: Path) -> str:
    found = [fam for fam, name in YAML_NAMES.items() if (model_dir / name).is_file()]
    if len(found) != 1:
        what = "none" if not found else " and ".join(YAML_NAMES[f] for f in found)
        raise ModelLoadError(model_dir, f"expected exactly one of cosyvoice2.yaml / cosyvoice3.yaml, found {what}")
    return found[0]


def read_model_spec(model_dir: str | Path) -> ModelSpec:
    """Build the :class:`ModelSpec` of an official model directory (yaml + backbone config)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(model_dir, "model directory does not exist")
    family = detect_family(model_dir)
    path = model_dir / YAML_NAMES[family]
    root = load_tagged_yaml(path)
    top = _Section(path, "<top>", {k: v for k, v in root.items() if not str(k).startswith("__")})
    sample_rate = top.num("sample_rate")
    chunk_size = top.num("chunk_size")
    token_frame_rate = top.num("token_frame_rate")
    token_mel_ratio = top.num("token_mel_ratio")
    backbone = _read_backbone(model_dir)
    llm = _read_llm(_Section(path, "llm", top.raw("llm")), family, backbone)
    flow = _read_flow(_Section(path, "flow", top.raw("flow")), family)
    hift = _read_hift(_Section(path, "hift", top.raw("hift")), family)
    mel = _read_mel(_Section(path, "feat_extractor", top.raw("feat_extractor")))
    for key in _TRAINING_KEYS:
        top.used.add(key)
    top.done()
    if hift.samples_per_frame * 50 != sample_rate or mel.hop_size != hift.samples_per_frame:
        raise ConfigError(path, "hift.upsample_rates", "vocoder hop does not match the mel hop / sample rate")
    if flow.token_mel_ratio != token_mel_ratio:
        raise ConfigError(path, "flow.token_mel_ratio", "disagrees with top-level token_mel_ratio")
    stream = StreamSpec(
        token_hop_len=chunk_size, token_max_hop_len=4 * chunk_size,
        silent_tokens=CV3_SILENT_TOKENS if family == "cosyvoice3" else (),
    )
    return ModelSpec(
        family=family, model_dir=model_dir, sample_rate=sample_rate, token_frame_rate=token_frame_rate,
        token_mel_ratio=token_mel_ratio, llm=llm, flow=flow, hift=hift, mel=mel, stream=stream,
        files={"yaml": YAML_NAMES[family], "llm": "llm.pt", "flow": "flow.pt", "hift": "hift.pt",
               "tokenizer": TOKENIZER_DIR, "campplus": "campplus.onnx",
               "speech_tokenizer": "speech_tokenizer_v2.onnx" if family == "cosyvoice2" else "speech_tokenizer_v3.onnx",
               "spk2info": "spk2info.pt"},
    )
