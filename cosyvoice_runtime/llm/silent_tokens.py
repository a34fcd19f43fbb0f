"""CosyVoice3's silent-token rule (spec §3.7), shared by the reference pipeline and the serving engine."""
from __future__ import annotations

from cosyvoice_runtime.config import ModelSpec


class SilentTokenFilter:
    """CosyVoice3 drops silent/breath tokens from the 6th consecutive one on (spec §3.7).

    The dropped tokens were still fed back into the LLM; only the flow never sees them.
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.silent = frozenset(spec.stream.silent_tokens)
        self.max_run = spec.stream.max_silent_tokens
        self.run = 0

    def keep(self, token: int) -> bool:
        if token not in self.silent:
            self.run = 0
            return True
        self.run += 1
        return self.run <= self.max_run
