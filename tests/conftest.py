"""Every test: replicas built in the pytest process skip the collect-and-freeze that ends a
replica's start (deployments.python_gc), unless the test is marked ``gc_freeze``.

Why: the freeze begins with a full collection, which in a replica walks its own start-up heap once
(~0.1-0.3 s) but here walks the whole test process's heap again for every replica a test builds:
the in-process serve_app and deployments tests took 51 s before the freeze and 95 s with it (2-core
VM, 2026-12-05). Ray tests' replicas run in processes of their own and freeze as in production.
What a marked test froze is given back to the collector afterwards, so objects of its discarded
replicas stay collectable in this process.
"""
from __future__ import annotations

import gc

import pytest

from deployments import python_gc


@pytest.fixture(autouse=True)
def _startup_heap_freeze_only_where_asked(request, monkeypatch):
    if request.node.get_closest_marker("gc_freeze") is None:
        monkeypatch.setattr(python_gc, "freeze_startup_heap", gc.get_freeze_count)
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
