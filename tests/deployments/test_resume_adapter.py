"""A continuation through the production adapter (RuntimeTokenEngine, deployments/resume.py): its
first event hands back the prefix (``raw`` whole, ``tokens`` through CosyVoice3's silent-token
filter, which goes on from there), and a prefix whose sequence had ended decodes nothing."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np

from cosyvoice_runtime.lm_messages import LMRequest
from deployments.runtime_adapter import RuntimeTokenEngine
from tests.deployments.test_runtime_engine import _model

SILENT = 7  # made a silent id of the model's spec here (CosyVoice3 has its own list)
TEXT = np.array([100, 200, 300, 400], np.int32)


def _engine() -> RuntimeTokenEngine:
    model = _model("cosyvoice2")
    spec = dataclasses.replace(model.spec, stream=dataclasses.replace(model.spec.stream, silent_tokens=(SILENT,),
                                                                      max_silent_tokens=2))
    return RuntimeTokenEngine(SimpleNamespace(spec=spec, llm=model.llm), max_running=2, max_model_len=256)


def _request(**fields) -> LMRequest:
    return LMRequest(text_ids=TEXT, prompt_text_ids=np.zeros(0, np.int32), prompt_speech_ids=np.zeros(0, np.int32),
                     seed=5, **fields)


def _drain(engine: RuntimeTokenEngine) -> list:
    events = []
    while engine.has_unfinished():
        events += engine.step()
    return events


def test_the_prefix_comes_back_first_filtered_and_raw():
    engine = _engine()
    prefix = [SILENT, SILENT, SILENT, 3, SILENT]
    engine.add("c", _request(prefix=np.array(prefix, np.int32)))
    events = _drain(engine)
    first = events[0]
    assert first.raw == prefix and first.tokens == [SILENT, SILENT, 3, SILENT] and not first.finished
    assert events[-1].finished and len(events) > 1  # the sequence went on decoding after it
    raw = [t for ev in events for t in ev.raw]
    assert raw[:len(prefix)] == prefix

    whole = _engine()
    whole.add("w", _request())
    unbroken = [t for ev in _drain(whole) for t in ev.raw]
    engine.add("k", _request(prefix=np.array(unbroken[:6], np.int32)))
    assert [t for ev in _drain(engine) for t in ev.raw] == unbroken  # the continuation is the unbroken run


def test_an_ended_prefix_decodes_nothing():
    engine = _engine()
    engine.add("d", _request(prefix=np.array([1, 2], np.int32), prefix_done=True))
    assert engine.engine.num_waiting() == 0 and engine.has_unfinished()
    events = _drain(engine)
    assert len(events) == 1 and events[0].finished and events[0].raw == [1, 2] and events[0].tokens == [1, 2]
