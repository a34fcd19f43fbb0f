"""Bistream requests in the continuous-batching engine reproduce ``bistream_decode`` exactly.

The model is the tiny random-weight LLM (``cosyvoice_runtime.tiny_model`` dims, real speech and
text vocabularies). The reference pulls its text chunks synchronously; the engine gets them
whenever the test feeds them (all before the first step, or one id at a time between steps,
also while the request is parked waiting for text), alone or beside a normal request.
"""
from __future__ import annotations

import copy

import pytest
import torch

from cosyvoice_runtime.config import ENDOFPROMPT_TOKEN_ID
from cosyvoice_runtime.errors import InvalidInputError
from cosyvoice_runtime.llm.bistream import BistreamState, bistream_decode
from cosyvoice_runtime.llm.bistream_seq import FINISH_PROTOCOL
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.generate import DecodeState, decode_all
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.model import build_llm
from cosyvoice_runtime.llm.sampling import SamplingParams
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from tests.runtime.test_llm_run_ahead import spy_launches

TEXT = [1000 + 37 * i for i in range(23)]  # 23 target text ids: 4 groups of 5 and a rest of 3
PROMPT_SPEECH = list(range(100, 120))  # 20 tokens: one full group, the next fill after 10 generated


@pytest.fixture(scope="module", params=["cosyvoice2", "cosyvoice3"])
def model(request, tmp_path_factory):
    spec = write_config_dir(tmp_path_factory.mktemp(request.param), request.param, TINY_DIMS[request.param])
    torch.manual_seed(0)
    llm = build_llm(spec.llm).eval()
    with torch.no_grad():  # clear greedy margins: batched and single forwards pick the same ids
        llm.llm_decoder.weight.mul_(8.0)
    return llm


def prompt_text(model) -> list[int]:
    ids = [11, 12, 13, 14, 15, 16]
    return [7, ENDOFPROMPT_TOKEN_ID, *ids] if model.spec.family == "cosyvoice3" else ids


def greedy_then_eos(spec, n_final: int):
    """Greedy over the speech ids, or fill where it beats them before the text ended (never another
    control id, which the quirk mode's mask allows); in the final stage eos after ``n_final``
    tokens. A fresh one per run (it counts its final-stage calls)."""
    calls = [0]

    def fn(logp: torch.Tensor, state: BistreamState) -> int:
        speech = int(logp[:spec.speech_token_size].argmax())
        if state.final:
            calls[0] += 1
            return spec.eos if calls[0] > n_final else speech
        return spec.fill if logp[spec.fill] > logp[speech] else speech

    return fn


def reference(model, chunks, quirks, params=None):
    """bistream_decode's emitted ids, all ids (fills included) and positions fed; greedy_then_eos
    unless ``params`` (then its default sampler with a generator seeded like the engine's)."""
    cache = KVCache.for_model(model, 1, 1024)
    if params is None:
        state, kwargs = BistreamState(), {"sample_fn": greedy_then_eos(model.spec, 6)}
    else:
        state, kwargs = BistreamState(params=params, generator=torch.Generator().manual_seed(params.seed)), {}
    tokens = list(bistream_decode(model, cache, chunks, prompt_text(model), PROMPT_SPEECH, state,
                                  official_quirks=quirks, **kwargs))
    return tokens, state.tokens, cache.lengths[0]


def run_engine(engine, feeds, rid="b", normal=None, sample_fn=None, params=None, max_steps=2000):
    """``feeds``: step index -> (chunks, end) fed before that step. ``normal``: (rid, lm_input, n)
    added at step 0 beside the bistream request. Returns emitted tokens per id and the bistream state."""
    engine.add_bistream_request(rid, prompt_text(engine.model), PROMPT_SPEECH, params=params,
                                sample_fn=sample_fn)
    state = engine.state_of(rid)
    tokens = {rid: []}
    if normal is not None:
        nid, x, n = normal
        engine.add_request(nid, x, n, n, SamplingParams(method="greedy"))
        tokens[nid] = []
    finished = set()
    for step in range(max_steps):
        if step in feeds:
            chunks, end = feeds[step]
            assert engine.feed_text(rid, chunks, end)
        if len(finished) == len(tokens):
            break
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.tokens)
            if ev.finished:
                finished.add(ev.request_id)
    assert finished == set(tokens), "did not finish"
    return tokens, state


def one_id_per_step(text, start=0, every=1):
    """Feed one id per chunk, one chunk every ``every`` steps; the end with the last."""
    return {start + i * every: ([[t]], i == len(text) - 1) for i, t in enumerate(text)}


@pytest.mark.parametrize("quirks", [False, True])
def test_text_all_at_once_matches_reference(model, quirks):
    chunks = [[t] for t in TEXT]
    want, want_all, want_len = reference(model, chunks, quirks)
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=1024, official_quirks=quirks)
    got, state = run_engine(engine, {0: (chunks, True)}, sample_fn=greedy_then_eos(model.spec, 6))
    assert got["b"] == want and len(want) > 40
    assert state.tokens == want_all and want_all.count(model.spec.fill) >= 3  # the fills, in place
    assert engine.cache.lengths[state.slot] == want_len  # the same positions fed (quirk: one re-fed)
    assert engine.num_running() == 0 and engine.scheduler.num_free_slots == 2


@pytest.mark.parametrize("quirks", [False, True])
@pytest.mark.parametrize("every", [1, 7])
def test_text_in_fragments_over_time_matches_reference(model, quirks, every):
    """every=7: the request parks waiting for text many times (a text id per 7 steps is slower
    than 15 speech tokens per 5 ids); every=1: text outruns the speech."""
    want, want_all, _ = reference(model, [[t] for t in TEXT], quirks)
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=1024, official_quirks=quirks)
    got, state = run_engine(engine, one_id_per_step(TEXT, every=every), sample_fn=greedy_then_eos(model.spec, 6))
    assert got["b"] == want and state.tokens == want_all


def test_many_id_chunks_are_consumed_as_the_reference_consumes_them(model):
    chunks = [TEXT[:9], TEXT[9:11], [], TEXT[11:]]
    want, want_all, _ = reference(model, chunks, False)
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=1024)
    feeds = {0: ([chunks[0]], False), 3: ([chunks[1], chunks[2]], False), 40: ([chunks[3]], True)}
    got, state = run_engine(engine, feeds, sample_fn=greedy_then_eos(model.spec, 6))
    assert got["b"] == want and state.tokens == want_all


@pytest.mark.parametrize("quirks, static, ahead", [(False, False, False), (True, False, False),
                                                   (False, True, False), (False, True, True)])
def test_batched_beside_a_normal_request(model, quirks, static, ahead):
    """static: the padded decode step of the CUDA graphs (run eagerly here); the bistream row's
    id is chosen from its logits, the in-step sampler serves the normal row. ahead: the engine
    runs ahead (``run_ahead``) while the bistream request is parked waiting for text and steps
    synchronously while it feeds, so both kinds of step alternate."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, model.spec.llm_input_size, generator=g)
    normal_ref = decode_all(model, x, DecodeState(min_len=50, max_len=50, params=SamplingParams(method="greedy")),
                            official_quirks=quirks)
    want, want_all, _ = reference(model, [[t] for t in TEXT], quirks)
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=1024, official_quirks=quirks, static_decode=static,
                       run_ahead=ahead)
    carries = spy_launches(engine) if ahead else []
    got, state = run_engine(engine, one_id_per_step(TEXT, start=2, every=7), normal=("n", x, 50),
                            sample_fn=greedy_then_eos(model.spec, 6))
    assert got["n"] == normal_ref
    assert got["b"] == want and state.tokens == want_all
    if ahead:  # some steps ran ahead with the bistream request in the engine, the normal row fed on the device
        assert sum(c >= 0 for carry in carries for c in carry) >= 5
        assert engine._in_flight is None and engine.scheduler.num_free_slots == 3


def test_seeded_ras_matches_reference(model):
    """The default bistream sampler (RAS with the request's own generator) as bistream_decode runs it."""
    params = SamplingParams.from_spec(model.spec, seed=1234)
    chunks = [[t] for t in TEXT]
    want, want_all, _ = reference(model, chunks, False, params=params)
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=1024)
    got, state = run_engine(engine, one_id_per_step(TEXT, every=2), params=params)
    assert got["b"] == want and state.tokens == want_all and len(want) > 0


def test_a_parked_request_keeps_its_slot_and_takes_no_work(model):
    speech = model.spec.speech_token_size
    engine = LLMEngine(model, max_batch_size=2, max_seq_len=1024)
    engine.add_bistream_request("b", prompt_text(model), PROMPT_SPEECH, sample_fn=lambda logp, st: int(logp[:speech].argmax()))
    assert engine.has_unfinished()  # waiting for admission
    assert engine.step() == []  # admitted; no text has arrived (the prompt is fed with the first): parked
    slot = engine.scheduler.slot_of("b")
    assert slot is not None and engine.num_parked() == 1 and engine.num_running() == 1
    assert not engine.has_unfinished() and engine.cache.lengths[slot] == 0
    # 4 ids + 6 prompt text ids pair both prompt groups (20 speech tokens): 10 tokens, then the forced fill
    engine.feed_text("b", [[t] for t in TEXT[:4]])
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert len(events) == 10 and engine.num_parked() == 1 and not any(e.finished for e in events)
    held = engine.cache.lengths[slot]
    assert engine.step() == [] and engine.cache.lengths[slot] == held  # parked: nothing fed
    assert engine.abort("b") and engine.scheduler.num_free_slots == 2 and engine.num_parked() == 0
    assert engine.feed_text("b", [[1]]) is False


def test_quirk_mode_fails_the_request_on_a_forbidden_control_id(model):
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=1024, official_quirks=True)
    bad = model.spec.speech_token_size + 1  # CV2's unused id / CV3's eos before the text ended
    engine.add_bistream_request("b", prompt_text(model), [], sample_fn=lambda logp, st: bad)
    engine.feed_text("b", [[t] for t in TEXT], end=True)
    events = engine.step()
    assert [(e.tokens, e.finished, e.finish_reason) for e in events] == [([], True, FINISH_PROTOCOL)]
    assert not engine.has_unfinished() and engine.scheduler.num_free_slots == 1


def test_slot_full_finishes_with_length_and_bad_input_is_refused(model):
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=80)
    engine.add_bistream_request("b", prompt_text(model), PROMPT_SPEECH, sample_fn=lambda logp, st: 5)
    engine.feed_text("b", [[t] for t in TEXT] * 4)  # never ends, never fills: the slot runs out
    events = []
    while engine.has_unfinished():
        events += engine.step()
    assert events[-1].finished and events[-1].finish_reason == "length"
    assert engine.cache.lengths[0] <= 80
    with pytest.raises(InvalidInputError):
        engine.add_bistream_request("long", prompt_text(model), list(range(100)))
    if model.spec.family == "cosyvoice3":
        with pytest.raises(InvalidInputError, match="endofprompt"):
            engine.add_bistream_request("cv3", [1, 2], [])
    engine.add_bistream_request("e", prompt_text(model), [])
    engine.feed_text("e", [], end=True)
    with pytest.raises(InvalidInputError):
        engine.feed_text("e", [[1]])


@pytest.mark.parametrize("static", [False, True])
def test_a_bistream_row_with_nonfinite_logits_fails_alone(model, static, monkeypatch):
    """NaN logits in the bistream row of a decode step end that request with NONFINITE_LOGITS; the
    normal request beside it decodes on as alone. The static step reads the mark from its one
    copy to the host: no second reduction and sync for its bistream rows (the eager path keeps it)."""
    from cosyvoice_runtime.llm import token_choice
    from cosyvoice_runtime.llm.engine import NONFINITE_LOGITS

    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, model.spec.llm_input_size, generator=g)
    normal_ref = decode_all(model, x, DecodeState(min_len=30, max_len=30, params=SamplingParams(method="greedy")))
    checked = []
    rows_check = token_choice.nonfinite_rows
    monkeypatch.setattr(token_choice, "nonfinite_rows", lambda logits: checked.append(len(logits)) or rows_check(logits))
    logits_of, calls = model.logits, []

    def poisoned(hidden):
        out = logits_of(hidden)
        calls.append(out.shape[0])
        if out.shape[0] == 2 and len(calls) > 12 and not any(c == -1 for c in calls):
            out = out.clone()
            out[1, 3] = float("nan")  # the bistream row: decode rows are the normal ones, then bistream
            calls.append(-1)
        return out

    monkeypatch.setattr(model, "logits", poisoned)
    engine = LLMEngine(model, max_batch_size=3, max_seq_len=1024, static_decode=static)
    padded, forward_padded = [], engine._forward_padded
    monkeypatch.setattr(engine, "_forward_padded", lambda *a: padded.append(1) or forward_padded(*a))
    engine.add_bistream_request("b", prompt_text(model), PROMPT_SPEECH, sample_fn=greedy_then_eos(model.spec, 6))
    engine.add_request("n", x, 30, 30, SamplingParams(method="greedy"))
    assert engine.feed_text("b", [[t] for t in TEXT], True)
    tokens, reasons = {"b": [], "n": []}, {}
    for _ in range(500):
        if len(reasons) == 2:
            break
        for ev in engine.step():
            tokens[ev.request_id].extend(ev.tokens)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
    assert -1 in calls and reasons["b"] == NONFINITE_LOGITS and reasons["n"] != NONFINITE_LOGITS
    assert tokens["n"] == normal_ref
    # The static path checks only the eager forwards' bistream rows (prompt groups, fills); the
    # eager path checks every decode step's bistream rows too.
    assert len(checked) == len(padded) if static else len(checked) > len(padded) + 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_engine_running_ahead_beside_a_bistream_request(model):
    """On CUDA graphs (float32), where run-ahead steps really are queued before the step before is
    read: they alternate with steps that wait for the bistream row, and both requests' tokens
    equal the graphed engine's without run-ahead."""
    gpu_model = copy.deepcopy(model).cuda()  # the fixture's model stays on the CPU for the other tests
    x = torch.randn(9, model.spec.llm_input_size, generator=torch.Generator().manual_seed(3)).cuda()
    out, fed = [], 0
    for ahead in (False, True):
        engine = LLMEngine(gpu_model, max_batch_size=3, max_seq_len=512, use_cuda_graphs=True, run_ahead=ahead)
        engine.capture_graphs()
        carries = spy_launches(engine) if ahead else []
        got, state = run_engine(engine, one_id_per_step(TEXT, start=2, every=7), normal=("n", x, 50),
                                sample_fn=greedy_then_eos(model.spec, 6))
        out.append((got, state.tokens))
        fed = sum(c >= 0 for carry in carries for c in carry)
    assert out[0] == out[1] and len(out[0][0]["b"]) > 40
    assert fed >= 5



def test_each_speech_token_reports_the_text_the_model_had_read(model):
    """TokenEvent.text_read: the request's own text ids fed before each emitted token (the 5:15
    interleave; timestamps are made from it). The prompt's 20 speech tokens pair with 2 groups of
    5 text ids: the 6 prompt ids and 4 of the request's; the first 10 generated tokens complete the
    second group; each fill then reads 5 more; the final stage reads the rest."""
    engine = LLMEngine(model, max_batch_size=1, max_seq_len=1024)
    engine.add_bistream_request("b", prompt_text(model), PROMPT_SPEECH, sample_fn=greedy_then_eos(model.spec, 6))
    assert engine.feed_text("b", [[t] for t in TEXT], True)
    tokens, read = [], []
    while engine.has_unfinished():
        for ev in engine.step():
            tokens += ev.tokens
            read += ev.text_read
    n_text, n_speech = model.spec.mix_ratio
    prompt_ids = len(prompt_text(model)) - (2 if model.spec.family == "cosyvoice3" else 0)  # CV3: 2 fed first
    first = -(-len(PROMPT_SPEECH) // n_speech) * n_text - prompt_ids
    assert len(read) == len(tokens) > 40 and read == sorted(read)
    assert read[0] == first and read[-1] == len(TEXT)
    assert sorted(set(read)) == sorted({*range(first, len(TEXT) + 1, n_text), len(TEXT)})
