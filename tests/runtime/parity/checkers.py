"""Imports every checker module so that each registers its cases."""
from tests.runtime.parity import (  # noqa: F401
    flow_cases,
    frontend_cases,
    hift_cases,
    llm_cases,
    token2wav_cases,
)
