"""Device utilisation and memory readings of a replica.

NVML (``nvidia-ml-py``, import name ``pynvml``) gives the real GPU utilisation when present;
otherwise the replica reports the busy fraction of its compute executor, which is what the
autoscaling policy needs anyway: how much of the time the device had work.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class DeviceProbe:
    """Reads utilisation/memory of the replica's device (``cpu`` or ``cuda[:N]``)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self._nvml_handle = None
        if device.startswith("cuda"):
            try:
                import pynvml
                import torch

                pynvml.nvmlInit()
                index = torch.cuda.current_device() if device == "cuda" else int(device.split(":")[1])
                self._nvml_handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except Exception as exc:  # NVML missing or no permission: fall back to the busy fraction
                logger.info("NVML unavailable (%s); reporting compute busy fraction as utilisation", exc)

    def utilization_pct(self, busy_fraction: float) -> float:
        if self._nvml_handle is not None:
            import pynvml

            return float(pynvml.nvmlDeviceGetUtilizationRates(self._nvml_handle).gpu)
        return 100.0 * busy_fraction

    def memory(self) -> tuple[int | None, int | None]:
        """(allocated by this process, total) in bytes, or (None, None) on CPU."""
        if not self.device.startswith("cuda"):
            return None, None
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(torch.cuda.memory_allocated()), int(total)


# Release the CUDA caching allocator's cached blocks only when they are fragmented: split blocks
# nobody uses (``inactive_split_bytes``) above both a share of what the allocator reserved and an
# absolute floor. Never on a timer, never under load: an empty_cache costs the next allocations a
# cudaMalloc each, and without fragmentation it buys nothing.
FRAGMENTED_SHARE = 0.25
FRAGMENTED_MIN_BYTES = 256 << 20


def fragmentation(stats: dict) -> tuple[int, int]:
    """(inactive split bytes, reserved bytes) from ``torch.cuda.memory_stats()``."""
    return int(stats.get("inactive_split_bytes.all.current", 0)), int(stats.get("reserved_bytes.all.current", 0))


def is_fragmented(inactive_split: int, reserved: int) -> bool:
    return reserved > 0 and inactive_split >= FRAGMENTED_MIN_BYTES and inactive_split / reserved >= FRAGMENTED_SHARE


def release_fragmented_cache(device: str) -> dict | None:
    """On a CUDA device: measure fragmentation and empty the cache if it is fragmented.

    Returns None off CUDA, else ``{"inactive_split_bytes", "reserved_bytes", "released"}``.
    """
    if not device.startswith("cuda"):
        return None
    import torch

    inactive, reserved = fragmentation(torch.cuda.memory_stats(device))
    released = is_fragmented(inactive, reserved)
    if released:
        torch.cuda.empty_cache()
        logger.info("CUDA cache fragmented (%.0f MiB of %.0f MiB reserved in unused split blocks): emptied",
                    inactive / 2**20, reserved / 2**20)
    return {"inactive_split_bytes": inactive, "reserved_bytes": reserved, "released": released}
