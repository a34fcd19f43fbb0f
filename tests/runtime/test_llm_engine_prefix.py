"""A continuation (``LMRequest.prefix``, ``LLMEngine.add_request(prefix=...)``): a sequence started
again from the ids it had emitted, with their embeddings prefilled after the prompt, emits the ids
an unbroken run emitted after them: sampled (RAS, seeded) on the eager and on the static (CUDA
graph) decode step, alone and beside other requests."""
from __future__ import annotations

import pytest
import torch

from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.sampling import SamplingParams
from tests.runtime.test_llm_engine import prompts, tiny_model

MIN_LEN, MAX_LEN = 30, 40  # past min_len a stop id may end it: the stop is continued too


def _run(engine: LLMEngine, requests: dict) -> dict[str, list[int]]:
    """``requests``: id -> (lm_input, prefix or None); every request's emitted ids after its prefix."""
    params = SamplingParams(seed=11, top_k=10)
    out = {}
    for rid, (x, prefix) in requests.items():
        engine.add_request(rid, x, MIN_LEN, MAX_LEN, params, prefix=prefix)
        out[rid] = []
    while engine.has_unfinished():
        for ev in engine.step():
            out[ev.request_id].extend(ev.tokens)
    return out


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
def test_a_continuation_emits_what_the_unbroken_run_did(family, static):
    model = tiny_model(family)

    def engine():
        return LLMEngine(model, max_batch_size=4, max_seq_len=256, static_decode=static)

    x, other = prompts([12, 7])
    whole = _run(engine(), {"a": (x, None)})["a"]
    assert len(whole) > 10
    for k in (3, len(whole) - 1):
        # beside another request (batched decode and prefill), as a replica under load runs it
        rest = _run(engine(), {"b": (other, None), "a": (x, torch.tensor(whole[:k]))})["a"]
        assert whole[:k] + rest == whole, k


def test_a_prefix_that_does_not_fit_is_refused():
    model = tiny_model()
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=256)
    x = prompts([5])[0]
    with pytest.raises(InvalidInputError, match="continuation"):
        engine.add_request("a", x, 1, 4, prefix=[1, 2, 3, 4])  # as many as max_len: nothing left
    with pytest.raises(InvalidInputError, match="continuation"):
        engine.add_request("b", x, 1, 10, prefix=[1, 10_000])  # not a speech id
