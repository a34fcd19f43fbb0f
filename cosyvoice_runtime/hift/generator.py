"""HiFT vocoders: mel (B, 80, T) -> 24 kHz waveform (B, 480·T) (spec §5).

* :class:`HiFTGenerator` (CV2): non-causal convs, ConvTranspose upsampling, random NSF source.
* :class:`CausalHiFTGenerator` (CV3): causal convs, a right-looking ``conv_pre`` (4 frames) and
  f0 conv (3 frames), nearest-upsample + causal conv stages, fixed-buffer NSF source, float64 f0.

Both share the body (STFT of the source, three upsampling stages fused with the downsampled
source, MRF residual blocks, ``conv_post``, magnitude/phase head, iSTFT) in :class:`_HiFTBase`.
Parameter names are the official ``hift.pt`` keys (after the ``generator.`` prefix strip).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cosyvoice_runtime.config import FlowSpec, HiftSpec
from cosyvoice_runtime.hift.f0 import F0Predictor
from cosyvoice_runtime.hift.layers import (
    CausalConv1d,
    CausalConv1dDownsample,
    CausalConv1dUpsample,
    ResBlock,
    fold_weight_norm,
    wn,
)
from cosyvoice_runtime.hift.noise import NoiseBuffers, official_noise_buffers
from cosyvoice_runtime.hift.source import HarmonicSource

logger = logging.getLogger(__name__)

CONV_PRE_KERNEL = 7  # CV2 conv_pre (CV3 uses conv_pre_look_right + 1)
CONV_POST_KERNEL = 7
# After the convs the official code uses F.leaky_relu's default slope, not lrelu_slope [quirk].
POST_LRELU_SLOPE = 0.01
MAX_MAGNITUDE = 1e2


def overlap_add_istft(spec: torch.Tensor, n_fft: int, hop: int, window: torch.Tensor) -> torch.Tensor:
    """``torch.istft(spec, n_fft, hop, n_fft, window, center=True)`` without its host sync.

    torch.istft reads its window-envelope check back to the host, which a CUDA graph cannot
    capture (the vocoder graphs of :mod:`cosyvoice_runtime.hift.graphs`). The same inverse:
    irfft of every frame, synthesis window, overlap-add (``F.fold``, deterministic), division
    by the overlap-added squared window, ``n_fft // 2`` samples trimmed at both ends. The
    periodic Hann window at hop n_fft / 4 never has a zero envelope on the kept samples.

    Args:
        spec: (B, n_fft // 2 + 1, F) complex.

    Returns:
        (B, hop · (F - 1)) real.
    """
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window[None, :, None]  # (B, n_fft, F)
    n_frames = frames.shape[2]
    length = n_fft + hop * (n_frames - 1)
    fold = {"output_size": (1, length), "kernel_size": (1, n_fft), "stride": (1, hop)}
    signal = F.fold(frames, **fold).reshape(frames.shape[0], length)
    envelope = F.fold((window * window)[None, :, None].expand(1, n_fft, n_frames), **fold).reshape(1, length)
    half = n_fft // 2
    return signal[:, half:length - half] / envelope[:, half:length - half]


class _HiFTBase(nn.Module):
    """The generator body shared by CV2 and CV3 (everything but f0 and the source)."""

    def __init__(self, spec: HiftSpec) -> None:
        super().__init__()
        self.spec = spec
        causal = spec.causal
        base = spec.base_channels
        n_fft = spec.istft_n_fft
        self.n_fft, self.hop = n_fft, spec.istft_hop
        self.num_kernels = len(spec.resblock_kernel_sizes)
        self.num_upsamples = len(spec.upsample_rates)
        self.samples_per_frame = spec.samples_per_frame
        self.m_source = HarmonicSource(spec)
        if causal:
            self.conv_pre = wn(CausalConv1d(spec.in_channels, base, spec.conv_pre_look_right + 1, side="right"))
        else:
            self.conv_pre = wn(nn.Conv1d(spec.in_channels, base, CONV_PRE_KERNEL, 1, padding=CONV_PRE_KERNEL // 2))
        self.ups = nn.ModuleList()
        for i, (u, k) in enumerate(zip(spec.upsample_rates, spec.upsample_kernel_sizes)):
            cin, cout = base // 2**i, base // 2 ** (i + 1)
            up = CausalConv1dUpsample(cin, cout, k, u) if causal else nn.ConvTranspose1d(cin, cout, k, u, padding=(k - u) // 2)
            self.ups.append(wn(up))
        # Source branch i sees the source STFT (6000 Hz) downsampled to stage i's rate.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        rates = [1] + list(spec.upsample_rates[::-1][:-1])
        cum = [1]
        for r in rates[1:]:
            cum.append(cum[-1] * r)
        for i, (u, k, d) in enumerate(zip(cum[::-1], spec.source_resblock_kernel_sizes, spec.source_resblock_dilation_sizes)):
            ch = base // 2 ** (i + 1)
            if u == 1:
                down = CausalConv1d(n_fft + 2, ch, 1, side="left") if causal else nn.Conv1d(n_fft + 2, ch, 1, 1)
            elif causal:
                down = CausalConv1dDownsample(n_fft + 2, ch, u * 2, u)
            else:
                down = nn.Conv1d(n_fft + 2, ch, u * 2, u, padding=u // 2)
            self.source_downs.append(down)
            self.source_resblocks.append(ResBlock(ch, k, tuple(d), causal))
        self.resblocks = nn.ModuleList()
        for i in range(self.num_upsamples):
            ch = base // 2 ** (i + 1)
            for k, d in zip(spec.resblock_kernel_sizes, spec.resblock_dilation_sizes):
                self.resblocks.append(ResBlock(ch, k, tuple(d), causal))
        if causal:
            self.conv_post = wn(CausalConv1d(ch, n_fft + 2, CONV_POST_KERNEL, side="left"))
        else:
            self.conv_post = wn(nn.Conv1d(ch, n_fft + 2, CONV_POST_KERNEL, 1, padding=CONV_POST_KERNEL // 2))
        self.f0_predictor = F0Predictor(spec.in_channels, spec.f0_cond_channels, causal)
        # scipy.signal.get_window("hann", n_fft, fftbins=True) == the periodic Hann window.
        self.register_buffer("stft_window", torch.hann_window(n_fft, periodic=True), persistent=False)

    def remove_weight_norm(self) -> None:
        """Fold every weight-norm parametrization (call once after loading ``hift.pt``)."""
        logger.debug("folded %d weight-normalised tensors", fold_weight_norm(self))

    # --- STFT helpers ------------------------------------------------------------------------
    def source_stft(self, source: torch.Tensor) -> torch.Tensor:
        """(B, 1, N) -> (B, n_fft + 2, N / hop + 1): real parts then imaginary parts."""
        spec = torch.stft(source.squeeze(1), self.n_fft, self.hop, self.n_fft, window=self.stft_window,
                          return_complex=True)
        spec = torch.view_as_real(spec)
        return torch.cat([spec[..., 0], spec[..., 1]], dim=1)

    def istft(self, head: torch.Tensor) -> torch.Tensor:
        """conv_post output (B, n_fft + 2, F) -> (B, hop·(F - 1)) waveform (before clamping)."""
        bins = self.n_fft // 2 + 1
        magnitude = torch.clip(torch.exp(head[:, :bins]), max=MAX_MAGNITUDE)
        phase = torch.sin(head[:, bins:])  # the sine of the raw output is used as phase [quirk]
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        return overlap_add_istft(spec, self.n_fft, self.hop, self.stft_window)

    def body(self, x: torch.Tensor, s_stft: torch.Tensor) -> torch.Tensor:
        """conv_pre output (B, base, T') + source STFT (B, 18, 120·T' + 1) -> conv_post output."""
        for i in range(self.num_upsamples):
            x = F.leaky_relu(x, self.spec.lrelu_slope)
            x = self.ups[i](x)
            if i == self.num_upsamples - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            xs = self.resblocks[i * self.num_kernels](x)
            for j in range(1, self.num_kernels):
                xs = xs + self.resblocks[i * self.num_kernels + j](x)
            x = xs / self.num_kernels
        return self.conv_post(F.leaky_relu(x, POST_LRELU_SLOPE))

    def f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """(B, 80, T) -> (B, T) Hz (CV3 non-final: (B, T - 3))."""
        return self.f0_predictor(mel, finalize=finalize)


class HiFTGenerator(_HiFTBase):
    """CV2 vocoder (non-causal; the source is random per call)."""

    def __init__(self, spec: HiftSpec) -> None:
        super().__init__(spec)
        # The runtime attaches its CUDA-graph wrapper here (cosyvoice_runtime.hift.graphs.enable_graphs):
        # a plain attribute (not a submodule), so checkpoint keys are unchanged.
        self.graphed_decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) + source (B, 1, 480·T) -> speech (B, 480·T) clamped to ±audio_limit."""
        if self.graphed_decode is not None:
            return self.graphed_decode(mel, source)
        return self.decode_eager(mel, source)

    def decode_eager(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """:meth:`decode` run op by op (what the graphs capture)."""
        x = self.body(self.conv_pre(mel), self.source_stft(source))
        return torch.clamp(self.istft(x), -self.spec.audio_limit, self.spec.audio_limit)

    def source(self, f0: torch.Tensor, generator: torch.Generator | None = None, zero_noise: bool = False) -> torch.Tensor:
        """(B, T) Hz -> (B, 1, 480·T) excitation (draws rand, randn, randn from ``generator``)."""
        return self.m_source(f0, generator=generator, zero_noise=zero_noise)

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, cache_source: torch.Tensor | None = None, finalize: bool = True,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Official ``HiFTGenerator.inference``.

        Args:
            mel: (B, 80, T).
            cache_source: (B, 1, n) source of the previous chunk's overlap; it overwrites the first
                n generated source samples (keeps the excitation phase continuous across chunks).
            finalize: ignored (the non-causal vocoder has no look-ahead); accepted for a common API.
            generator: the request's RNG for the random source; a fresh unseeded one if None
                (never the global RNG).

        Returns:
            speech (B, 480·T) and the source actually used (B, 1, 480·T).
        """
        if generator is None:
            generator = torch.Generator(device=mel.device)
            generator.seed()
        s = self.source(self.f0(mel), generator=generator)
        if cache_source is not None and cache_source.shape[2] > 0:
            s = s.clone()
            s[:, :, : cache_source.shape[2]] = cache_source
        return self.decode(mel, s), s


class CausalHiFTGenerator(_HiFTBase):
    """CV3 vocoder (causal; deterministic thanks to fixed noise buffers and float64 f0).

    The noise buffers (spec §5.2) are non-persistent buffers of ``m_source``; they are filled on
    first use from the process cache of :func:`official_noise_buffers` (or explicitly with
    :meth:`load_noise_buffers`).
    """

    def __init__(self, spec: HiftSpec, flow: FlowSpec | None = None) -> None:
        super().__init__(spec)
        self.flow_spec = flow
        self.conv_pre_look_right = spec.conv_pre_look_right
        self.auto_load_noise = True
        # batched decode through CUDA graphs (cosyvoice_runtime.hift.causal_graphs); None: eager
        self.graphed_body: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    @property
    def f0_look_right(self) -> int:
        return self.f0_predictor.look_right

    @property
    def lag_frames(self) -> int:
        """Mel frames a non-final call withholds: f0 + conv_pre look-ahead + the trimmed frame."""
        return self.f0_look_right + self.conv_pre_look_right + 1

    def load_noise_buffers(self, buffers: NoiseBuffers | None = None) -> None:
        """Install the fixed buffers (default: the official ones, regenerated once per process)."""
        if buffers is None:
            if self.flow_spec is None:
                raise RuntimeError("CausalHiFTGenerator needs the FlowSpec to regenerate the official noise buffers")
            buffers = official_noise_buffers(self.spec, self.flow_spec)
        self.m_source.set_noise_buffers(buffers.rand_ini, buffers.sine_waves)

    def ensure_noise(self) -> None:
        """Install the official noise buffers now if they are missing (``noise="lazy"``)."""
        if not self.m_source.has_noise_buffers:
            if not self.auto_load_noise:
                raise RuntimeError("noise buffers not loaded: call load_noise_buffers() (built with noise='none')")
            self.load_noise_buffers()

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """Official ``CausalHiFTGenerator.decode``.

        finalize=True: mel (B, 80, T), source (B, 1, 480·T) -> (B, 480·T).
        finalize=False: the last ``conv_pre_look_right`` mel frames are look-ahead only; the
        matching source STFT frames and the last frame's samples are dropped -> (B, 480·(T - 5)).
        """
        s_stft = self.source_stft(source)
        look = self.conv_pre_look_right
        if finalize:
            x = self.conv_pre(mel)
        else:
            x = self.conv_pre(mel[:, :, :-look], mel[:, :, -look:])
            s_stft = s_stft[:, :, : -(self.samples_per_frame // self.hop) * look]
        speech = self.istft(self.body(x, s_stft))
        if not finalize:
            speech = speech[:, : -self.samples_per_frame]
        return torch.clamp(speech, -self.spec.audio_limit, self.spec.audio_limit)

    def source(self, f0: torch.Tensor, zero_noise: bool = False) -> torch.Tensor:
        """(B, T) Hz -> (B, 1, 480·T) excitation from the fixed buffers."""
        if not zero_noise:
            self.ensure_noise()
        return self.m_source(f0, zero_noise=zero_noise)

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, cache_source: torch.Tensor | None = None, finalize: bool = True,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Official ``CausalHiFTGenerator.inference``.

        Args:
            mel: (B, 80, T).
            cache_source: unused (must be None or empty); accepted for a common API.
            finalize: False for a streamed chunk: the last 3 frames are f0 look-ahead and the next
                4 conv_pre look-ahead; the output lags the input by :attr:`lag_frames` frames.
            generator: unused (the CV3 source is deterministic).

        Returns:
            speech (B, 480·T) or (B, 480·(T - 8)), and the source (B, 1, 480·T) or (B, 1, 480·(T - 3)).
        """
        if cache_source is not None and cache_source.numel() > 0:
            raise ValueError("the causal vocoder takes no cache_source (it re-vocodes the whole mel)")
        s = self.source(self.f0(mel, finalize=finalize))
        x = mel if finalize else mel[:, :, : -self.f0_look_right]
        return self.decode(x, s, finalize=finalize), s


def build_hift(spec: HiftSpec, flow: FlowSpec | None = None, noise: str = "lazy") -> _HiFTBase:
    """Construct the vocoder of ``spec`` (randomly initialised; load ``hift.pt`` next).

    Args:
        spec: vocoder spec (``spec.causal`` picks the CV3 class).
        flow: the flow spec, needed by CV3 to regenerate the official noise buffers (their RNG
            stream depends on the flow's sizes).
        noise: CV3 only. "lazy": buffers are installed on the first inference (process-cached);
            "eager": installed now; "none": never (call ``load_noise_buffers`` yourself).
    """
    if not spec.causal:
        return HiFTGenerator(spec)
    model = CausalHiFTGenerator(spec, flow)
    if noise not in ("lazy", "eager", "none"):
        raise ValueError(f"noise must be 'lazy', 'eager' or 'none', got {noise}")
    model.auto_load_noise = noise == "lazy"
    if noise == "eager":
        model.load_noise_buffers()
    return model
