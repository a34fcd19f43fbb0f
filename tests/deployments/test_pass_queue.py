"""PassQueue: how many flow passes the token2wav driver keeps queued on the GPU (fake CUDA events)."""
import pytest

from deployments.runtime_adapter import PassQueue


class _Mark:
    def __init__(self, log: list, n: int):
        self.log, self.n = log, n

    def record(self, stream):
        self.log.append(("record", self.n, stream))

    def synchronize(self):
        self.log.append(("wait", self.n))


def _run(depth: int, passes: int) -> list:
    log: list = []
    made = iter(range(passes))
    queue = PassQueue(depth, lambda: _Mark(log, next(made)))
    for i in range(passes):
        queue.make_room()
        log.append(("pass", i))
        queue.queued("s")
    return log


def test_depth_one_waits_for_the_previous_pass_before_the_next():
    assert _run(1, 3) == [("pass", 0), ("record", 0, "s"), ("wait", 0), ("pass", 1), ("record", 1, "s"),
                          ("wait", 1), ("pass", 2), ("record", 2, "s")]


def test_depth_two_prepares_a_pass_while_the_one_before_it_runs():
    # pass 2 waits for pass 0 only: pass 1 may still be on the GPU while pass 2 is queued
    assert _run(2, 4) == [("pass", 0), ("record", 0, "s"), ("pass", 1), ("record", 1, "s"), ("wait", 0),
                          ("pass", 2), ("record", 2, "s"), ("wait", 1), ("pass", 3), ("record", 3, "s")]


def test_no_events_off_cuda_and_nothing_to_wait_for():
    queue = PassQueue(1, None)
    for _ in range(3):
        queue.make_room()
        queue.queued(None)
    assert not queue._marks


def test_depth_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        PassQueue(0, None)
