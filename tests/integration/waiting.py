"""Waiting on replica state in the Ray tests: poll a predicate until it holds. The guard turns a
state that never comes into a failure instead of a hang; it never sets the pace of a test."""
from __future__ import annotations

import time

GUARD_S = 120.0


def wait_for(predicate, what: str, poll_s: float = 0.05, guard_s: float = GUARD_S) -> None:
    """Poll ``predicate`` until it holds; fail after ``guard_s`` (:data:`GUARD_S`) naming ``what``."""
    deadline = time.monotonic() + guard_s
    while not predicate():
        assert time.monotonic() < deadline, f"never reached: {what}"
        time.sleep(poll_s)  # spacing between polls, not a synchronisation
