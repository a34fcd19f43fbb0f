"""ComputeExecutor: lanes run side by side; busy time of overlapping lanes counts once."""
from __future__ import annotations

import asyncio
import threading

from deployments.compute import ComputeExecutor


def test_two_lanes_run_at_the_same_time():
    ex = ComputeExecutor(lanes=("token2wav",))
    both = threading.Barrier(2, timeout=60)  # broken (-> error) unless both calls are inside at once (a guard)

    async def main():
        return await asyncio.gather(ex.run(both.wait), ex.run(both.wait, lane="token2wav"))

    assert sorted(asyncio.run(main())) == [0, 1]
    ex.shutdown()


def test_busy_fraction_is_the_union_of_lane_intervals():
    ex = ComputeExecutor(window_s=10.0, lanes=("token2wav",))
    # main busy 100-104, token2wav 102-106 (overlap 2 s), main again 108-109: 7 s of 10.
    ex._intervals.extend([(100.0, 104.0), (102.0, 106.0), (108.0, 109.0)])
    assert abs(ex.busy_fraction(now=110.0) - 0.7) < 1e-9
    # the window cuts the first interval at 101: 1 + ... = 3 + 2 + 1 = 6 s of 10
    assert abs(ex.busy_fraction(now=111.0) - 0.6) < 1e-9
    ex.shutdown()
