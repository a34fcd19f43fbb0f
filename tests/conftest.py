"""Every test: what a replica built in this process froze out of the garbage collector's walks is
given back to it afterwards (deployments.python_gc), so objects of one test's discarded replicas
are still collectable later in the same pytest process."""
from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _unfreeze_gc():
    yield
    if gc.get_freeze_count():
        gc.unfreeze()
