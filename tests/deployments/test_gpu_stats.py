"""DeviceProbe: which GPU NVML is asked about, the rolling mean, and life without NVML."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from deployments.gpu_stats import DeviceIdentity, DeviceProbe, nvml_candidates

UUIDS = ["GPU-aaaaaaaa-0000-0000-0000-000000000000", "GPU-bbbbbbbb-1111-1111-1111-111111111111",
         "GPU-cccccccc-2222-2222-2222-222222222222"]
PCI = ["00000000:17:00.0", "00000000:65:00.0", "00000000:CA:00.0"]


class NotFound(Exception):
    pass


class FakeNvml:
    """The parts of ``pynvml`` the probe uses, for a node of three GPUs with set utilisations."""

    def __init__(self, utils=(5, 50, 95), gpm: bool = False, sm=(10.0, 20.0, 30.0)) -> None:
        self.utils = list(utils)
        self.sm = list(sm)
        self.gpm = gpm
        self.lookups: list[tuple[str, object]] = []
        self.freed = 0
        self.c_nvmlGpmMetricsGet_t = _MetricsQuery
        self.NVML_GPM_METRICS_GET_VERSION = 1
        self.NVML_GPM_METRIC_SM_UTIL = 2

    def nvmlInit(self) -> None:
        pass

    def _find(self, kind, key, table):
        self.lookups.append((kind, key))
        if key not in table:
            raise NotFound(key)
        return table.index(key)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        return self._find("uuid", uuid, UUIDS)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id):
        return self._find("pci", bus_id, PCI)

    def nvmlDeviceGetHandleByIndex(self, index):
        return self._find("index", index, [0, 1, 2])

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=self.utils[handle], memory=0)

    def nvmlGpmQueryDeviceSupport(self, handle):
        return SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self):
        return object()

    def nvmlGpmSampleGet(self, handle, sample):
        self._gpm_handle = handle

    def nvmlGpmMetricsGet(self, query):
        assert query.metrics[0].metricId == self.NVML_GPM_METRIC_SM_UTIL
        query.metrics[0].value = self.sm[self._gpm_handle]
        return query

    def nvmlGpmSampleFree(self, sample):
        self.freed += 1


class _MetricsQuery:
    def __init__(self) -> None:
        self.metrics = [SimpleNamespace(metricId=None, value=None)]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _probe(nvml, identity, visible, clock=None, **kw) -> DeviceProbe:
    return DeviceProbe("cuda", nvml=nvml, identity=identity, visible_devices=visible, clock=clock or FakeClock(),
                       sample_interval_s=None, **kw)


def test_the_gpu_is_found_by_uuid_not_by_local_index():
    # Inside a Ray worker the replica's GPU is local index 0; physically it is the third GPU.
    nvml = FakeNvml()
    probe = _probe(nvml, DeviceIdentity(0, uuid=UUIDS[2][4:], pci_bus_id=PCI[2]), visible="2")
    probe.sample()
    assert probe.found_by == f"uuid {UUIDS[2]}" and nvml.lookups == [("uuid", UUIDS[2])]
    assert probe.nvml_utilization_pct() == 95


def test_pci_bus_id_when_the_uuid_is_unknown_to_nvml():
    nvml = FakeNvml()
    probe = _probe(nvml, DeviceIdentity(0, uuid="deadbeef", pci_bus_id=PCI[1]), visible="1")
    probe.sample()
    assert probe.found_by == f"pci {PCI[1]}" and probe.nvml_utilization_pct() == 50


@pytest.mark.parametrize("visible, local, expected", [
    ("2,0", 0, 95),            # physical index 2 at local index 0
    ("2,0", 1, 5),
    (f"{UUIDS[1]},{UUIDS[2]}", 1, 95),  # Ray may list UUIDs
    (None, 1, 50),             # nothing hidden: local index = NVML index
])
def test_cuda_visible_devices_maps_local_to_physical(visible, local, expected):
    probe = _probe(FakeNvml(), DeviceIdentity(local), visible)
    probe.sample()
    assert probe.nvml_utilization_pct() == expected


def test_mig_slices_and_unmapped_devices_give_no_nvml_reading():
    assert nvml_candidates(DeviceIdentity(0), "MIG-1234") == []
    assert nvml_candidates(DeviceIdentity(3), "0,1") == []
    probe = _probe(FakeNvml(), DeviceIdentity(0), "MIG-1234")
    probe.sample()
    assert not probe.has_nvml and probe.nvml_utilization_pct() is None
    assert probe.utilization_pct(0.25) == 25.0  # dashboards fall back to the busy fraction


def test_rolling_mean_over_the_window():
    nvml, clock = FakeNvml(utils=(0, 0, 0)), FakeClock()
    probe = _probe(nvml, DeviceIdentity(0), "0", clock=clock, window_s=10.0)
    for t, util in [(0, 90), (1, 60), (2, 30)]:
        clock.t, nvml.utils[0] = t, util
        probe.sample()
    assert probe.nvml_utilization_pct() == pytest.approx(60)
    clock.t, nvml.utils[0] = 11.5, 30  # readings at t=0 and t=1 leave the 10 s window
    probe.sample()
    assert probe.nvml_utilization_pct() == pytest.approx(30)
    assert probe.utilization_pct(0.99) == pytest.approx(30)  # NVML wins over the busy fraction


def test_sm_activity_where_the_gpu_reports_it_else_absent():
    with_gpm = _probe(FakeNvml(gpm=True), DeviceIdentity(0), "1")
    with_gpm.sample()
    assert with_gpm.sm_activity_pct() == 20.0
    with_gpm.close()
    without = _probe(FakeNvml(gpm=False), DeviceIdentity(0), "1")
    without.sample()
    assert without.sm_activity_pct() is None and without.nvml_utilization_pct() == 50


def test_gpm_samples_are_freed_on_close():
    nvml = FakeNvml(gpm=True)
    probe = _probe(nvml, DeviceIdentity(0), "0")
    probe.close()
    assert nvml.freed == 2


def test_missing_nvml_module(monkeypatch):
    monkeypatch.setattr("deployments.gpu_stats._import_nvml", lambda: None)
    probe = DeviceProbe("cuda", identity=DeviceIdentity(0), visible_devices="0", sample_interval_s=1.0)
    probe.sample()
    assert not probe.has_nvml and probe._thread is None  # no sampler thread without NVML
    assert probe.nvml_utilization_pct() is None and probe.sm_activity_pct() is None
    assert probe.utilization_pct(0.5) == 50.0


def test_nvml_init_failure_is_not_fatal():
    class NoDriver(FakeNvml):
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    probe = _probe(NoDriver(), DeviceIdentity(0), "0")
    assert not probe.has_nvml and probe.utilization_pct(0.1) == pytest.approx(10.0)


def test_cpu_replica_never_touches_nvml():
    nvml = FakeNvml()
    probe = DeviceProbe("cpu", nvml=nvml, sample_interval_s=1.0)
    assert nvml.lookups == [] and probe._thread is None and probe.memory() == (None, None)


def test_sampler_thread_reads_and_stops_on_close():
    sampled = threading.Event()

    class Signalling(FakeNvml):
        def nvmlDeviceGetUtilizationRates(self, handle):
            sampled.set()
            return super().nvmlDeviceGetUtilizationRates(handle)

    probe = DeviceProbe("cuda", nvml=Signalling(), identity=DeviceIdentity(0), visible_devices="0",
                        sample_interval_s=0.001)
    assert sampled.wait(timeout=30)
    probe.close()
    assert probe._thread is None and probe.nvml_utilization_pct() == 5
