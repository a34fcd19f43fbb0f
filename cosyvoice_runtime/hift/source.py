"""Harmonic-plus-noise excitation (official ``SineGen2`` + ``SourceModuleHnNSF``, spec §5.2).

f0 (B, T) at the mel rate -> source (B, 1, S·T) at the sample rate, S = samples per frame.

Randomness:
* CV2 draws, per call and in this order, ``rand(B, H)`` initial phases (harmonic 0 zeroed),
  ``randn(B, S·T, H)`` additive noise (filled in channel-major memory order, as the official
  ``randn_like`` of a transposed tensor does) and ``randn(B, S·T, 1)`` for the official
  (discarded) noise branch. They come from the ``generator`` argument; with a CPU generator seeded like the
  global RNG the draws equal the official ``torch.rand`` / ``randn_like`` ones.
* CV3 uses construction-time buffers instead (:mod:`cosyvoice_runtime.hift.noise`): the fixed
  initial phases ``rand_ini`` (1, H) and the *uniform* noise ``sine_waves`` (1, N, H), sliced by
  absolute sample index. They are non-persistent buffers (not in ``hift.pt``) that follow the
  module's device; they are filled by :meth:`HarmonicSource.set_noise_buffers`.

Frame-rate shortcut (bit-exact): the official code builds the normalised frequency at the sample
rate and downsamples it by linear interpolation with factor 1/S (align-corners off). That picks,
per frame k, samples ``S·k + S/2 - 1`` and ``S·k + S/2`` (both inside frame k, equal values), so
the result is exactly the frame's own value; we compute it at the frame rate directly. The random
initial phase is added to sample 0 only, which is therefore never read unless S == 1 **[quirk]**.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import HiftSpec
from cosyvoice_runtime.errors import InvalidInputError


class HarmonicSource(nn.Module):
    """``m_source``: sine harmonics + noise merged by ``l_linear`` and tanh.

    Args:
        spec: the vocoder spec (harmonics, NSF amplitudes, voicing threshold, rates, causal).
    """

    def __init__(self, spec: HiftSpec) -> None:
        super().__init__()
        self.causal = spec.causal
        self.dim = spec.nb_harmonics + 1
        self.sampling_rate = spec.sampling_rate
        self.upsample = spec.samples_per_frame
        self.sine_amp = spec.nsf_alpha
        self.noise_std = spec.nsf_sigma
        self.voiced_threshold = spec.nsf_voiced_threshold
        self.l_linear = nn.Linear(self.dim, 1)
        self.register_buffer("harmonic_numbers", torch.arange(1, self.dim + 1, dtype=torch.float32), persistent=False)
        if self.causal:
            self.register_buffer("rand_ini", torch.zeros(1, self.dim), persistent=False)
            self.register_buffer("sine_waves", torch.zeros(1, 0, self.dim), persistent=False)

    # --- CV3 fixed buffers -------------------------------------------------------------------
    @property
    def has_noise_buffers(self) -> bool:
        return self.causal and self.sine_waves.shape[1] > 0

    def set_noise_buffers(self, rand_ini: torch.Tensor, sine_waves: torch.Tensor) -> None:
        """Install the CV3 fixed buffers ((1, H) phases with [0] == 0, (1, N, H) uniform noise)."""
        if not self.causal:
            raise ValueError("only the causal (CV3) source uses fixed noise buffers")
        if rand_ini.shape != (1, self.dim) or sine_waves.dim() != 3 or sine_waves.shape[2] != self.dim:
            raise ValueError(f"noise buffers of shapes {tuple(rand_ini.shape)}, {tuple(sine_waves.shape)}")
        device = self.l_linear.weight.device
        self.rand_ini = rand_ini.to(device=device, dtype=torch.float32)
        self.sine_waves = sine_waves.to(device=device, dtype=torch.float32)

    @property
    def max_samples(self) -> int:
        """Longest source the fixed noise buffer covers (CV3), or unlimited (CV2: -1)."""
        return int(self.sine_waves.shape[1]) if self.causal else -1

    # --- pieces (pure functions of their inputs) ---------------------------------------------
    def frame_rad(self, f0: torch.Tensor) -> torch.Tensor:
        """(B, T) Hz -> (B, T, H) per-frame normalised frequencies ``(f0·h / sr) mod 1``."""
        fn = f0.unsqueeze(-1) * self.harmonic_numbers.to(f0.device)
        return (fn / self.sampling_rate) % 1

    def phase(self, rad: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, H) -> (B, S·T, H) sample-rate phase in radians.

        ``offset`` (B, H) float64: cumulative ``rad`` of the frames before ``rad[:, 0]``, for an
        incremental caller. Without it this is the official float32 ``cumsum`` (which on the CPU
        accumulates in float64, so the offset form gives the same float32 values).
        """
        if offset is None:
            cum = torch.cumsum(rad, dim=1)
        else:
            cum = (torch.cumsum(rad.double(), dim=1) + offset.unsqueeze(1)).to(rad.dtype)
        return self.upsample_phase(cum)

    def upsample_phase(self, cum: torch.Tensor) -> torch.Tensor:
        """(B, T, H) cumulative frame rad -> (B, S·T, H) sample-rate phase in radians."""
        ph = (cum * 2 * math.pi).transpose(1, 2) * self.upsample
        if self.causal:  # nearest phase upsampling [quirk, reproduce]: piecewise-constant phase
            ph = torch.repeat_interleave(ph, self.upsample, dim=2)
        else:
            ph = F.interpolate(ph, scale_factor=float(self.upsample), mode="linear")
        return ph.transpose(1, 2)

    def merge(self, f0: torch.Tensor, phase: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
        """Sines + noise -> source.

        Args:
            f0: (B, T) Hz.
            phase: (B, S·T, H) radians.
            noise: (B or 1, S·T, H) unit noise (normal for CV2, uniform buffer slice for CV3),
                or None for the noise-free source.

        Returns:
            (B, 1, S·T) source in (-1, 1).
        """
        sines = torch.sin(phase) * self.sine_amp
        uv = (torch.repeat_interleave(f0, self.upsample, dim=1) > self.voiced_threshold).to(sines.dtype).unsqueeze(-1)
        harmonics = sines * uv
        if noise is not None:
            amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
            harmonics = harmonics + amp * noise
        return torch.tanh(self.l_linear(harmonics)).transpose(1, 2)

    def buffer_noise(self, start: int, length: int) -> torch.Tensor:
        """CV3: (1, length, H) slice of the fixed noise buffer from absolute sample ``start``."""
        if not self.has_noise_buffers:
            raise RuntimeError("the CV3 noise buffers are not loaded (CausalHiFTGenerator.load_noise_buffers)")
        if start + length > self.sine_waves.shape[1]:
            raise InvalidInputError(
                f"utterance of {(start + length) / self.sampling_rate:.1f} s exceeds the vocoder's "
                f"{self.sine_waves.shape[1] / self.sampling_rate:.0f} s noise buffer"
            )
        return self.sine_waves[:, start:start + length]

    # --- the official forward ----------------------------------------------------------------
    def forward(self, f0: torch.Tensor, generator: torch.Generator | None = None,
                zero_noise: bool = False) -> torch.Tensor:
        """(B, T) Hz -> (B, 1, S·T) source.

        Args:
            generator: CV2 only, the request's RNG (required unless ``zero_noise``).
            zero_noise: every random draw replaced by 0 (CV2 ``s_zero_noise``; CV3: no noise and
                no initial phase).
        """
        f0 = f0.float()
        b, t = f0.shape
        n = t * self.upsample
        rad = self.frame_rad(f0)
        if self.causal:
            ini = None if zero_noise else self.rand_ini
            noise = None if zero_noise else self.buffer_noise(0, n)
        elif zero_noise:
            ini = noise = None
        else:
            if generator is None:
                raise ValueError("the CV2 source needs a torch.Generator (the request's RNG)")
            ini = torch.rand(b, self.dim, generator=generator, device=generator.device).to(f0.device)
            ini[:, 0] = 0
            noise = _normal_time_major(b, n, self.dim, generator).to(f0.device)
            _normal_time_major(b, n, 1, generator)  # the official (discarded) noise branch
        if ini is not None and self.upsample == 1:  # see the module docstring: otherwise unread
            rad = rad.clone()
            rad[:, 0] = rad[:, 0] + ini
        return self.merge(f0, self.phase(rad), noise)


def _normal_time_major(b: int, n: int, c: int, generator: torch.Generator) -> torch.Tensor:
    """(b, n, c) standard normal laid out as (b, c, n) in memory, drawn on the generator's device.

    The official ``randn_like`` runs on a transposed (channel-major) tensor, which fills memory
    in (b, c, n) order through the non-contiguous kernel path; this reproduces both the values
    and the generator's consumption.
    """
    out = torch.empty(b, c, n, device=generator.device).transpose(1, 2)
    return out.normal_(generator=generator)
