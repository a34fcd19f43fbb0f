"""A Serve autoscaling policy the test decides: ``high`` replicas until a marker file exists, then
``low`` (stdlib only: Serve imports it on its controller). It stands for any scale-in decision of
the real policy, made at the moment the test chooses instead of after a load's time average."""
from __future__ import annotations

from pathlib import Path
from typing import Any


class GatedPolicy:
    def __init__(self, marker: str, high: int = 2, low: int = 1) -> None:
        self.marker, self.high, self.low = Path(marker), high, low

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        target = self.low if self.marker.exists() else self.high
        return target, {"gated_target": target}
