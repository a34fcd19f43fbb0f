"""CV3 vocoder noise buffers, regenerated bit-exactly by replaying the official construction.

The official ``CausalHiFTGenerator`` draws three tensors from the global CPU RNG when it is
constructed (``SineGen2.rand_ini`` (1, 9), ``SineGen2.sine_waves`` (1, 300·24000, 9),
``SourceModuleHnNSF.uv`` (1, 300·24000, 1)); they are not stored in ``hift.pt``. The RNG stream at
that point is fully determined (parity README, ``manifests/summary.json``):

    seed 0 (``CausalConditionalCFM.__init__``), randn(1, 80, noise_frames)      CFM noise
    Embedding(vocab, flow_input)  Linear(spk_embed_dim, flow_output)            flow init
    Conv1d(80 -> C, k4)  4 x Conv1d(C -> C, k3)  Linear(C, 1)                   f0 predictor
    rand(1, H)  rand(1, N, H)  Linear(H, 1)  rand(1, N, 1)                      NSF source

We replay exactly these draws on a private ``torch.Generator`` (same Mersenne-Twister stream as
the global generator after ``manual_seed(0)``; the global RNG is never touched) using the same
``torch.nn.init`` calls as the module constructors. The buffers are large (259 MB for the noise),
so :func:`official_noise_buffers` caches them per process, keyed by the recipe.
"""
from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass

import torch
from torch.nn import init

from cosyvoice_runtime.config import FlowSpec, HiftSpec

logger = logging.getLogger(__name__)

# Seed set by the official CausalConditionalCFM.__init__ (set_all_random_seed(0)).
CFM_SEED = 0
# The official SineGen2 / SourceModuleHnNSF size the buffers as 300 s at 24 kHz.
BUFFER_SECONDS = 300
F0_KERNELS = (4, 3, 3, 3, 3)


@dataclass(frozen=True)
class NoiseRecipe:
    """Every size that determines the RNG stream up to and including the vocoder buffers."""

    mel_bins: int  # CFM noise channels (flow output size)
    noise_frames: int  # CFM noise length
    flow_vocab: int
    flow_input: int
    spk_embed_dim: int
    flow_output: int
    f0_in: int
    f0_channels: int
    harmonics: int  # nb_harmonics + 1
    samples: int  # buffer length (300 s)

    @classmethod
    def from_specs(cls, hift: HiftSpec, flow: FlowSpec) -> NoiseRecipe:
        return cls(
            mel_bins=flow.output_size, noise_frames=flow.noise_frames, flow_vocab=flow.vocab_size,
            flow_input=flow.input_size, spk_embed_dim=flow.spk_embed_dim, flow_output=flow.output_size,
            f0_in=hift.in_channels, f0_channels=hift.f0_cond_channels, harmonics=hift.nb_harmonics + 1,
            samples=BUFFER_SECONDS * hift.sampling_rate,
        )


@dataclass(frozen=True)
class NoiseBuffers:
    """rand_ini (1, H) with [:, 0] == 0; sine_waves (1, N, H) and uv (1, N, 1) uniform [0, 1)."""

    rand_ini: torch.Tensor
    sine_waves: torch.Tensor
    uv: torch.Tensor | None


def _conv_init(out_ch: int, in_ch: int, k: int, g: torch.Generator) -> None:
    # nn.Conv1d.reset_parameters: kaiming_uniform_(a=sqrt(5)) on the weight, then the bias.
    w = torch.empty(out_ch, in_ch, k, device="cpu")
    init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
    bound = 1 / math.sqrt(in_ch * k)
    init.uniform_(torch.empty(out_ch, device="cpu"), -bound, bound, generator=g)


def _linear_init(out_f: int, in_f: int, g: torch.Generator) -> None:
    w = torch.empty(out_f, in_f, device="cpu")
    init.kaiming_uniform_(w, a=math.sqrt(5), generator=g)
    bound = 1 / math.sqrt(in_f)
    init.uniform_(torch.empty(out_f, device="cpu"), -bound, bound, generator=g)


def replay_noise_buffers(recipe: NoiseRecipe, with_uv: bool = True) -> NoiseBuffers:
    """Regenerate the official CV3 buffers (uncached; ~0.3 GB of CPU memory at full length)."""
    started = time.perf_counter()
    g = torch.Generator(device="cpu").manual_seed(CFM_SEED)
    torch.randn(1, recipe.mel_bins, recipe.noise_frames, generator=g, device="cpu")
    init.normal_(torch.empty(recipe.flow_vocab, recipe.flow_input, device="cpu"), generator=g)
    _linear_init(recipe.flow_output, recipe.spk_embed_dim, g)
    for i, k in enumerate(F0_KERNELS):
        _conv_init(recipe.f0_channels, recipe.f0_in if i == 0 else recipe.f0_channels, k, g)
    _linear_init(1, recipe.f0_channels, g)
    rand_ini = torch.rand(1, recipe.harmonics, generator=g, device="cpu")
    rand_ini[:, 0] = 0
    sine_waves = torch.rand(1, recipe.samples, recipe.harmonics, generator=g, device="cpu")
    uv = None
    if with_uv:
        _linear_init(1, recipe.harmonics, g)
        uv = torch.rand(1, recipe.samples, 1, generator=g, device="cpu")
    logger.info("regenerated CV3 vocoder noise buffers (%d samples) in %.2f s", recipe.samples,
                time.perf_counter() - started)
    return NoiseBuffers(rand_ini=rand_ini, sine_waves=sine_waves, uv=uv)


@functools.lru_cache(maxsize=2)
def _cached(recipe: NoiseRecipe) -> NoiseBuffers:
    return replay_noise_buffers(recipe, with_uv=False)


def official_noise_buffers(hift: HiftSpec, flow: FlowSpec) -> NoiseBuffers:
    """The process-cached official buffers for a model (``uv`` omitted: unused at inference).

    Callers must treat the tensors as read-only (they are shared by every vocoder built from the
    same sizes in this process).
    """
    return _cached(NoiseRecipe.from_specs(hift, flow))


def clear_noise_cache() -> None:
    """Drop the cached buffers (tests; frees ~0.26 GB per model size)."""
    _cached.cache_clear()
