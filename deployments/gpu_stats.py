"""Device readings of a replica, for dashboards: NVML utilisation, SM activity, memory.

These readings are *not* the autoscaling signal. NVML's ``utilization.gpu`` is the share of time
any kernel ran, and it saturates with one stream: it barely moves from one stream to 64 while
throughput grows (issue 17; the reading: docs/tuning.md §5, "Why not GPU utilisation"). The
policy scales on offered load against the replica's SLO capacity instead
(``deployments.autoscaling_policy``).

The replica's GPU is found by identity, never by index: inside a Ray worker
``torch.cuda.current_device()`` is 0 on every GPU of a node, while NVML numbers all of the node's
GPUs. :func:`nvml_candidates` lists, in order of preference, the UUID and the PCI bus id torch
reports for the device, then the ``CUDA_VISIBLE_DEVICES`` entry it maps to. A sampler thread
reads NVML about once a second and keeps a rolling mean; SM activity (NVML GPM, Hopper and
later) is reported where the GPU supports it and absent otherwise. Without NVML (no
``nvidia-ml-py``, no driver, a CPU replica) the probe reports the compute executor's busy
fraction as utilisation and no SM activity.
"""
from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from deployments import constants

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 1.0
WINDOW_S = 10.0


@dataclass(frozen=True)
class DeviceIdentity:
    """What torch knows about the replica's CUDA device (``uuid`` / ``pci_bus_id`` may be None)."""

    local_index: int
    uuid: str | None = None
    pci_bus_id: str | None = None


def torch_device_identity(device: str) -> DeviceIdentity:
    """Identity of ``cuda`` / ``cuda:N`` as this process sees it (needs a CUDA build of torch)."""
    import torch

    index = torch.cuda.current_device() if device == "cuda" else int(device.split(":")[1])
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    pci = None
    if getattr(props, "pci_bus_id", None) is not None:
        pci = "{:08x}:{:02x}:{:02x}.0".format(getattr(props, "pci_domain_id", 0), props.pci_bus_id, props.pci_device_id)
    return DeviceIdentity(index, str(uuid) if uuid is not None else None, pci)


def nvml_candidates(identity: DeviceIdentity, visible_devices: str | None) -> list[tuple[str, str | int]]:
    """Ways to name the device to NVML, best first: ``("uuid", ...)``, ``("pci", ...)``, ``("index", n)``.

    ``visible_devices`` is ``$CUDA_VISIBLE_DEVICES`` (Ray sets it per worker): its entry at the
    local index is either a physical index or a ``GPU-<uuid>``; a ``MIG-`` entry names a MIG slice,
    whose utilisation NVML does not report, so it yields nothing.
    """
    out: list[tuple[str, str | int]] = []
    if identity.uuid:
        uuid = identity.uuid if identity.uuid.startswith(("GPU-", "MIG-")) else f"GPU-{identity.uuid}"
        if uuid.startswith("GPU-"):
            out.append(("uuid", uuid))
    if identity.pci_bus_id:
        out.append(("pci", identity.pci_bus_id))
    entries = [e.strip() for e in (visible_devices or "").split(",") if e.strip()]
    if visible_devices is None or not entries:
        out.append(("index", identity.local_index))
    elif identity.local_index < len(entries):
        entry = entries[identity.local_index]
        if entry.isdigit():
            out.append(("index", int(entry)))
        elif entry.startswith("GPU-"):
            out.append(("uuid", entry))
    return out


def open_nvml_handle(nvml: Any, candidates: list[tuple[str, str | int]]) -> tuple[Any, str] | None:
    """The first candidate NVML resolves: (handle, how it was found), or None."""
    lookups: dict[str, Callable[[Any], Any]] = {
        "uuid": nvml.nvmlDeviceGetHandleByUUID,
        "pci": nvml.nvmlDeviceGetHandleByPciBusId,
        "index": nvml.nvmlDeviceGetHandleByIndex,
    }
    for kind, key in candidates:
        try:
            return lookups[kind](key), f"{kind} {key}"
        except Exception as exc:  # noqa: BLE001 - NVMLError_NotFound and friends: try the next way
            logger.debug("NVML lookup by %s %s failed: %s", kind, key, exc)
    return None


def _import_nvml() -> ModuleType | None:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        return None


class _GpmSampler:
    """SM activity between consecutive NVML GPM samples (Hopper and later); raises where unsupported."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
            raise RuntimeError("GPM not supported on this GPU")
        self._nvml, self._handle = nvml, handle
        self._samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        nvml.nvmlGpmSampleGet(handle, self._samples[0])

    def sm_activity_pct(self) -> float:
        """Share of SM cycles active since the previous call (NVML_GPM_METRIC_SM_UTIL)."""
        nvml = self._nvml
        prev, cur = self._samples
        nvml.nvmlGpmSampleGet(self._handle, cur)
        query = nvml.c_nvmlGpmMetricsGet_t()
        query.version = nvml.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = 1
        query.sample1, query.sample2 = prev, cur
        query.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
        nvml.nvmlGpmMetricsGet(query)
        self._samples = [cur, prev]
        return float(query.metrics[0].value)

    def close(self) -> None:
        for sample in self._samples:
            self._nvml.nvmlGpmSampleFree(sample)


class DeviceProbe:
    """Utilisation, SM activity and memory of the replica's device (``cpu`` or ``cuda[:N]``).

    Args:
        device: the replica's torch device string.
        nvml: the ``pynvml`` module (tests inject a fake); None imports it if installed.
        identity: the CUDA device's identity; None asks torch (only for ``cuda`` devices).
        visible_devices: ``$CUDA_VISIBLE_DEVICES``; None reads it from the environment.
        clock: monotonic clock of the rolling window (tests pass a fake one).
        sample_interval_s: period of the sampler thread; None starts no thread (tests call
            :meth:`sample` themselves).
        window_s: length of the rolling mean.
    """

    def __init__(self, device: str, nvml: ModuleType | Any | None = None, identity: DeviceIdentity | None = None,
                 visible_devices: str | None = None, clock: Callable[[], float] = time.monotonic,
                 sample_interval_s: float | None = SAMPLE_INTERVAL_S, window_s: float = WINDOW_S) -> None:
        self.device = device
        self.found_by: str | None = None  # how NVML found the device, for /health and logs
        self._nvml = None
        self._handle = None
        self._gpm: _GpmSampler | None = None
        self._clock = clock
        self._window_s = window_s
        self._readings: deque[tuple[float, float, float | None]] = deque()  # (t, util %, SM %)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.startswith("cuda"):
            self._open(device, nvml, identity, visible_devices)
        if self._handle is not None and sample_interval_s is not None:
            self._thread = threading.Thread(target=self._run, args=(sample_interval_s,), name="nvml-sampler",
                                            daemon=True)
            self._thread.start()

    def _open(self, device: str, nvml: Any, identity: DeviceIdentity | None, visible: str | None) -> None:
        nvml = nvml if nvml is not None else _import_nvml()
        if nvml is None:
            logger.info("nvidia-ml-py not installed: no NVML readings; utilisation is the compute busy fraction")
            return
        try:
            nvml.nvmlInit()
            identity = identity if identity is not None else torch_device_identity(device)
            visible = visible if visible is not None else constants.cuda_visible_devices()
            found = open_nvml_handle(nvml, nvml_candidates(identity, visible))
        except Exception as exc:  # noqa: BLE001 - no driver, no permission
            logger.info("NVML unavailable (%s); utilisation is the compute busy fraction", exc)
            return
        if found is None:
            logger.warning("NVML could not find device %s (%s, CUDA_VISIBLE_DEVICES=%s); no NVML readings",
                           device, identity, visible)
            return
        self._nvml, (self._handle, self.found_by) = nvml, found
        try:
            self._gpm = _GpmSampler(nvml, self._handle)
        except Exception as exc:  # noqa: BLE001 - pre-Hopper GPU, old driver, or a module without GPM
            logger.info("SM activity unavailable (%s)", exc)
        logger.info("NVML readings for %s: device found by %s, SM activity %s", device, self.found_by,
                    "on" if self._gpm is not None else "absent")

    @property
    def has_nvml(self) -> bool:
        return self._handle is not None

    def sample(self) -> None:
        """Take one NVML reading into the rolling window (the sampler thread calls this each second)."""
        if self._handle is None:
            return
        util = float(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
        sm = None
        if self._gpm is not None:
            try:
                sm = self._gpm.sm_activity_pct()
            except Exception as exc:  # noqa: BLE001 - GPM stopped answering: report no SM activity
                logger.info("SM activity reading failed (%s): no longer reported", exc)
                self._gpm = None
        now = self._clock()
        with self._lock:
            self._readings.append((now, util, sm))
            while self._readings and self._readings[0][0] < now - self._window_s:
                self._readings.popleft()

    def _run(self, interval_s: float) -> None:
        # NOTE: Event.wait is the timer and the stop signal at once; close() ends the thread at once.
        while not self._stop.wait(interval_s):
            try:
                self.sample()
            except Exception as exc:  # noqa: BLE001 - a driver hiccup must not end the replica
                logger.warning("NVML sample failed: %s", exc)

    def _means(self) -> tuple[float | None, float | None]:
        with self._lock:
            utils = [u for _, u, _ in self._readings]
            sms = [s for _, _, s in self._readings if s is not None]
        return (sum(utils) / len(utils) if utils else None, sum(sms) / len(sms) if sms else None)

    def nvml_utilization_pct(self) -> float | None:
        """Rolling mean of NVML ``utilization.gpu`` (%), None without NVML readings."""
        return self._means()[0]

    def sm_activity_pct(self) -> float | None:
        """Rolling mean of SM activity (%), None where the GPU or NVML does not report it."""
        return self._means()[1]

    def utilization_pct(self, busy_fraction: float) -> float:
        """NVML utilisation when there are readings, else ``100 * busy_fraction`` of the compute executor."""
        util = self.nvml_utilization_pct()
        return util if util is not None else 100.0 * busy_fraction

    def memory(self) -> tuple[int | None, int | None]:
        """(allocated by this process, total) in bytes, or (None, None) on CPU."""
        if not self.device.startswith("cuda"):
            return None, None
        import torch

        _free, total = torch.cuda.mem_get_info()
        return int(torch.cuda.memory_allocated()), int(total)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._gpm is not None:
            self._gpm.close()
            self._gpm = None


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
