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
