"""Conditional flow matching solver (``CausalConditionalCFM`` inference, spec §4.5).

The solver owns the ODE loop: fixed initial noise, cosine time grid, Euler steps and
classifier-free guidance with a batch of two (conditional row, unconditional row with mu, spks
and cond zeroed). The estimator is any module with the plain tensor signature
``estimator(x, mask, mu, t, spks, cond, streaming) -> (2B, 80, T)``, so a TensorRT engine is a
drop-in swap.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from cosyvoice_runtime.config import FlowSpec
from cosyvoice_runtime.errors import InvalidInputError

# The official CFM seeds every RNG with 0 at construction and draws this buffer once.
NOISE_SEED = 0


@functools.lru_cache(maxsize=8)
def fixed_noise(n_mels: int, frames: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(1, n_mels, frames) standard normal from a CPU generator seeded with 0, on ``device`` in ``dtype``.

    Identical to the official ``torch.manual_seed(0); torch.randn([1, 80, 15000])``; cached per
    process (per device and dtype: a copy per job from host memory would wait for the work queued
    on the stream, :mod:`cosyvoice_runtime.host_copy`) and never written to.
    """
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return fixed_noise(n_mels, frames).to(device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    return torch.randn(1, n_mels, frames, generator=gen)


def time_grid(n_steps: int, scheduler: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """t_span of ``n_steps + 1`` points (cosine: ``1 - cos(pi/2 * k/n)``), in the compute dtype."""
    t = torch.linspace(0, 1, n_steps + 1, device=device, dtype=dtype)
    if scheduler == "cosine":
        t = 1 - torch.cos(t * 0.5 * math.pi)
    elif scheduler != "linear":
        raise ValueError(f"unknown t_scheduler {scheduler}")
    return t


def step_schedule(n_steps: int, scheduler: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(t, dt) of each Euler step, each (n_steps,), in the compute dtype.

    Accumulated as the official loop does (``t = t + dt``; ``dt = t_span[k + 1] - t``), so in bf16
    the step times are not exactly the grid points; a solve run step by step
    (:mod:`cosyvoice_runtime.flow.stepper`) reads the same values as the whole solve.
    """
    t_span = time_grid(n_steps, scheduler, dtype, device)
    t, dt = t_span[0], t_span[1] - t_span[0]
    ts, dts = [], []
    for step in range(1, n_steps + 1):
        ts.append(t)
        dts.append(dt)
        t = t + dt
        if step < n_steps:
            dt = t_span[step + 1] - t
    return torch.stack(ts), torch.stack(dts)


def euler_update(x: torch.Tensor, v: torch.Tensor, dt: torch.Tensor, mask: torch.Tensor, rate: float) -> torch.Tensor:
    """One guided Euler step of x (B, 80, T) from the velocities v (2B, 80, T) of its conditional
    rows then its unconditional rows; dt is 0-dim or (B, 1, 1).

    The DiT does not mask its output; keeping padded frames of a batch at their noise keeps them
    finite (an exact no-op where the mask is 1, i.e. for every valid frame).
    """
    b = x.shape[0]
    return x + dt * (((1.0 + rate) * v[:b] - rate * v[b:]) * mask)


class CFMSolver(nn.Module):
    """The ``decoder`` of the flow: holds the estimator (key prefix ``decoder.estimator``)."""

    def __init__(self, spec: FlowSpec, estimator: nn.Module) -> None:
        super().__init__()
        self.spec = spec
        self.estimator = estimator

    def noise(self, frames: int, like: torch.Tensor, offset: int = 0) -> torch.Tensor:
        if offset + frames > self.spec.noise_frames:
            raise InvalidInputError(f"flow length {offset + frames} frames exceeds the fixed noise buffer "
                             f"({self.spec.noise_frames} frames)")
        z = fixed_noise(self.spec.output_size, self.spec.noise_frames, like.device, like.dtype)
        return z[:, :, offset:offset + frames] * self.spec.temperature

    def forward(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                streaming: bool | torch.Tensor = False, noise: torch.Tensor | None = None, trace: dict | None = None) -> torch.Tensor:
        """Integrate the ODE from noise to mel.

        Args:
            mu: (B, 80, T) encoder output; mask: (B, 1, T); spks: (B, 80); cond: (B, 80, T).
            noise: (B, 80, T) initial state (default: the fixed noise, first T frames).
            trace: if given, receives noise, t_steps, est0_out, est_last_x, est_last_out.

        Returns:
            (B, 80, T) float32.
        """
        b, c, t_len = mu.shape
        dtype = spks.dtype
        x = (self.noise(t_len, spks).expand(b, -1, -1) if noise is None else noise.to(dtype)).clone()
        t_steps, dts = step_schedule(self.spec.n_timesteps, self.spec.t_scheduler, dtype, mu.device)
        # CFG buffers are filled by copy into one allocation (the TensorRT path binds them).
        x_in = torch.zeros(2 * b, c, t_len, device=mu.device, dtype=dtype)
        mask_in = torch.zeros(2 * b, 1, t_len, device=mu.device, dtype=dtype)
        mu_in = torch.zeros_like(x_in)
        cond_in = torch.zeros_like(x_in)
        spks_in = torch.zeros(2 * b, spks.shape[1], device=mu.device, dtype=dtype)
        t_in = torch.zeros(2 * b, device=mu.device, dtype=dtype)
        mu_in[:b], spks_in[:b], cond_in[:b] = mu, spks, cond
        mask_in[:b] = mask_in[b:] = mask
        rate = self.spec.inference_cfg_rate
        if isinstance(streaming, torch.Tensor):
            streaming = streaming.repeat(2)  # per row: conditional rows, then unconditional rows
        if trace is not None:
            trace["noise"] = x.clone()
            trace["t_steps"] = []
        n = len(t_steps)
        for step in range(1, n + 1):
            t = t_steps[step - 1]
            x_in[:b] = x_in[b:] = x
            t_in[:] = t
            v = self.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming)
            if trace is not None:
                trace["t_steps"].append(t.clone())
                if step == 1:
                    trace["est0_out"] = v.clone()
                if step == n:
                    trace["est_last_x"] = x[:1].clone()
                    trace["est_last_out"] = v.clone()
            x = euler_update(x, v, dts[step - 1], mask, rate)
        if trace is not None:
            trace["t_steps"] = torch.stack(trace["t_steps"])
        return x.float()
