"""The deployed autoscaling policy, unchanged, with each of its decisions written down for the live ramp.

``RecordedPolicy`` wraps the policy the config names (``deployments.autoscaling_policy:LoadBandPolicy``
with the config's kwargs): Serve calls it on the controller, it calls the real policy and returns
its answer as is, and appends what the policy saw and said to a JSON-lines file: the running
count, Serve's aggregated streams in flight per replica, the handles' queued and total requests,
and the policy's own state (``demand_streams``, ``load_pct``, ``decision``, ``reason``). A line at
most every ``every_s`` seconds and whenever the decision changes (Serve calls a policy every
0.1 s). Standard library only, as Serve's controller imports it.
"""
from __future__ import annotations

import importlib
import json
import time
from typing import Any


class RecordedPolicy:
    def __init__(self, inner: str, inner_kwargs: dict[str, Any], record: str, every_s: float = 1.0) -> None:
        module, _, attr = inner.partition(":")
        self.policy = getattr(importlib.import_module(module), attr)(**inner_kwargs)
        self.record, self.every_s = record, float(every_s)
        self._last_at = 0.0
        self._last_decision: int | None = None

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision, state = self.policy(ctx)
        now = time.time()
        if decision != self._last_decision or now - self._last_at >= self.every_s:
            self._last_at, self._last_decision = now, decision
            metrics = ctx.aggregated_metrics or {}
            line = {"wall_s": round(now, 3), "running": int(ctx.current_num_replicas),
                    "target": int(ctx.target_num_replicas), "decision": int(decision),
                    "total_requests": float(ctx.total_num_requests or 0),
                    "queued_requests": float(ctx.total_queued_requests or 0),
                    "streams_in_flight": {str(getattr(k, "unique_id", k)): round(float(v), 3) for k, v in
                                          (metrics.get("streams_in_flight") or {}).items()},
                    "state": {k: v for k, v in (state or {}).items() if isinstance(v, (int, float, str, type(None)))}}
            with open(self.record, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        return decision, state
