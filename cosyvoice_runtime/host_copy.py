"""Host -> device copies that never wait for the GPU.

A copy from ordinary (pageable) host memory to a CUDA device synchronizes the current stream first:
PyTorch waits until every kernel queued there has run. On the token2wav thread that stream holds
the flow pass in flight and the one queued behind it, so each small copy (a job's tokens, a batch's
lengths) left the GPU's token2wav lane idle while the thread waited and then launched the next
pass late. Through pinned memory the copy is queued behind that work instead; PyTorch's pinned
allocator keeps the staging buffer until the copy has run.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; from host memory to CUDA as a queued copy, never a wait."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
