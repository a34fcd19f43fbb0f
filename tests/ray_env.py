"""Environment for the Ray clusters the tests start, in this process or in a child.

Serve's own timers on its proxy (ready within 5 s, health checks answered within 10 s) fire on a
heavily loaded runner and kill the proxy mid-test (seen with load average 30 on 2 cores, and with
two busy loops beside the small live ramp: "killed by ray.kill ... never ran"): a test cluster
gives them a minute. Ray's processes read them from the environment they start with.
"""
from __future__ import annotations

SERVE_PROXY_TIMERS = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60"}
