"""Architecture specs of CosyVoice2 / CosyVoice3, read from an official model directory.

Every number the runtime needs lives in one of these frozen dataclasses; model modules take
them in their constructors so nothing is hard-coded twice. This module is data only:
:func:`cosyvoice_runtime.yaml_config.read_model_spec` builds a :class:`ModelSpec` from
``cosyvoice2.yaml`` / ``cosyvoice3.yaml`` (never evaluating the hyperpyyaml tags) and
``CosyVoice-BlankEN/config.json``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Family = Literal["cosyvoice2", "cosyvoice3"]

# CosyVoice3 hard-codes this text id in its LLM (it must appear in prompt_text ++ text).
ENDOFPROMPT_TOKEN_ID = 151646
# FSQ codes of silence/breath that CosyVoice3 caps at `max_silent_tokens` in a row.
CV3_SILENT_TOKENS = (1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323)


@dataclass(frozen=True, slots=True)
class Qwen2Spec:
    """The Qwen2 backbone (``CosyVoice-BlankEN/config.json``)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True, slots=True)
class LLMSpec:
    """Speech-token LM: Qwen2 body + speech embedding/head, sampling defaults."""

    family: Family
    backbone: Qwen2Spec
    speech_token_size: int  # S: number of real speech tokens (6561)
    llm_input_size: int
    llm_output_size: int
    mix_ratio: tuple[int, int] = (5, 15)
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    # Special ids (see the parity README table). CV2 keeps sos/task_id in a separate 2-row
    # `llm_embedding`; CV3 keeps them inside `speech_embedding`.
    @property
    def sos(self) -> int:
        return 0 if self.family == "cosyvoice2" else self.speech_token_size

    @property
    def task_id(self) -> int:
        return 1 if self.family == "cosyvoice2" else self.speech_token_size + 2

    @property
    def eos(self) -> int:
        return self.speech_token_size if self.family == "cosyvoice2" else self.speech_token_size + 1

    @property
    def fill(self) -> int:
        return self.speech_token_size + (2 if self.family == "cosyvoice2" else 3)

    @property
    def num_control_tokens(self) -> int:
        return 3 if self.family == "cosyvoice2" else 200

    @property
    def vocab_out(self) -> int:
        """Rows of `speech_embedding` and outputs of `llm_decoder`."""
        return self.speech_token_size + self.num_control_tokens

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.vocab_out))

    @property
    def decoder_bias(self) -> bool:
        return self.family == "cosyvoice2"

    @property
    def official_min_len_masked_id(self) -> int:
        """The id the official code masks before min_len: S for both (wrong for CV3)."""
        return self.speech_token_size


@dataclass(frozen=True, slots=True)
class ConformerEncoderSpec:
    """CosyVoice2 `UpsampleConformerEncoder`."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int
    static_chunk_size: int  # tokens; the up-sampled part uses 2x
    pre_lookahead_len: int
    upsample_stride: int = 2
    upsample_kernel_size: int = 5  # stride * 2 + 1


@dataclass(frozen=True, slots=True)
class UNetSpec:
    """CosyVoice2 `CausalConditionalDecoder` estimator."""

    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    static_chunk_size: int  # mel frames

    @property
    def time_embed_dim(self) -> int:
        return self.channels[0] * 4


@dataclass(frozen=True, slots=True)
class DiTSpec:
    """CosyVoice3 DiT estimator."""

    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int  # mel frames
    conv_pos_kernel: int = 31
    conv_pos_groups: int = 16
    freq_embed_dim: int = 256


@dataclass(frozen=True, slots=True)
class FlowSpec:
    """Token -> mel: token front, CFM solver parameters and one of the two estimators."""

    family: Family
    input_size: int  # token embedding width (512 CV2 / 80 CV3)
    output_size: int  # mel bins
    spk_embed_dim: int
    vocab_size: int
    token_mel_ratio: int
    pre_lookahead_len: int
    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    temperature: float = 1.0
    noise_frames: int = 15000  # length of the fixed CFM noise buffer
    encoder: ConformerEncoderSpec | None = None  # CV2
    unet: UNetSpec | None = None  # CV2
    pre_lookahead_channels: int | None = None  # CV3
    dit: DiTSpec | None = None  # CV3


@dataclass(frozen=True, slots=True)
class HiftSpec:
    """HiFT vocoder (`HiFTGenerator` for CV2, `CausalHiFTGenerator` for CV3)."""

    causal: bool
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_cond_channels: int
    conv_pre_look_right: int = 0  # CV3: 4
    f0_look_right: int = 0  # CV3: 3 (first f0 conv has k=4, right-looking)

    @property
    def samples_per_frame(self) -> int:
        hop = self.istft_hop
        for r in self.upsample_rates:
            hop *= r
        return hop


@dataclass(frozen=True, slots=True)
class MelSpec:
    """Matcha `mel_spectrogram` parameters of the prompt mel (yaml `feat_extractor`)."""

    n_fft: int
    num_mels: int
    sampling_rate: int
    hop_size: int
    win_size: int
    fmin: float
    fmax: float | None


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """Streaming schedule constants (`CosyVoice2Model` / `CosyVoice3Model`)."""

    token_hop_len: int  # = yaml chunk_size (25 in the released models)
    token_max_hop_len: int  # 4 * chunk_size
    stream_scale_factor: int = 2
    mel_cache_len: int = 8  # CV2 vocoder overlap, mel frames
    silent_tokens: tuple[int, ...] = ()
    max_silent_tokens: int = 5


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Everything about one model directory."""

    family: Family
    model_dir: Path
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    llm: LLMSpec
    flow: FlowSpec
    hift: HiftSpec
    mel: MelSpec
    stream: StreamSpec
    files: dict[str, str] = field(default_factory=dict)  # role -> file name

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)
