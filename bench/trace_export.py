"""``torch.profiler`` for the benchmarks that read kernels from its trace
(:mod:`bench.profile_first_audio`, :mod:`bench.kernel_profile`): which activities to record, and
the stopped profiler's Chrome trace as JSON. Kept apart from both so that the kernel profile runs
without the serving stack (no Ray, pydantic or PyAV on the lent GPU image).
"""
from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


def trace_profiler(cuda: bool, cpu_ops: bool = False) -> profile:
    """A profiler of CUDA activity on a GPU (recording every CPU op would slow the host threads
    being looked at), of CPU ops elsewhere; ``cpu_ops``: CPU ops too on a GPU (slower: what each
    thread did between two kernels)."""
    if not cuda:
        return profile(activities=[ProfilerActivity.CPU])
    return profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu_ops else []))


def chrome_trace(prof: profile, chrome: Path | None = None) -> dict:
    """A stopped profiler's Chrome trace as JSON; with ``chrome``, also written there (gzip)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        if chrome is not None:
            chrome.write_bytes(gzip.compress(path.read_bytes()))
        return json.loads(path.read_text())
