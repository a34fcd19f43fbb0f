"""The incremental CosyVoice2 flow batched and stepped (:class:`IncrementalStepper`): rows of several
requests, each at its own ODE step with its own cached and new lengths, padded to a bucket, give
each row what it gets alone; Token2Wav's step-by-step API runs incremental and recomputed rows
(one kind per pass) to the recompute's audio; a failed finish leaves the cache as it was.

Tolerances: float32 on the CPU; a row in a batch differs from the row alone by GEMM rounding only
(measured <= ~2e-6 on the mel), 1e-5 here; audio 5e-4, the bound batched jobs have against
unbatched ones (tests/runtime/test_token2wav.py), as the random-weight vocoder amplifies the mel's.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cosyvoice_runtime.flow.flow import FlowItem, build_flow
from cosyvoice_runtime.flow.flow_cache import FlowCache, PromptPrefixes
from cosyvoice_runtime.flow.graph_setup import enable_flow_graphs
from cosyvoice_runtime.flow.incremental import pass_bias
from cosyvoice_runtime.graph_capture import missed_total
from cosyvoice_runtime.model import load_model
from cosyvoice_runtime.stream_schedule import pick_rows
from cosyvoice_runtime.tiny_model import TINY_DIMS, write_config_dir
from cosyvoice_runtime.token2wav import Token2Wav
from cosyvoice_runtime.voice_prompt import VoicePrompt
from tests.runtime.parity.common import parity_dir


@functools.lru_cache(maxsize=1)
def _cv2():
    return load_model(parity_dir() / "cosyvoice2" / "model")


def _prompt(n_prompt: int, seed: int) -> VoicePrompt:
    g = torch.Generator().manual_seed(seed)
    return VoicePrompt(family="cosyvoice2", text_tokens=np.zeros(0, np.int32),
                       speech_tokens=torch.randint(0, 6561, (n_prompt,), generator=g, dtype=torch.int32).numpy(),
                       mel=torch.randn(2 * n_prompt, 80, generator=g).numpy(), embedding=torch.randn(192, generator=g).numpy())


def _item(prompt: VoicePrompt, tokens: list[int], finalize: bool) -> FlowItem:
    return FlowItem(torch.tensor([tokens], dtype=torch.int32), torch.from_numpy(prompt.speech_tokens)[None],
                    torch.from_numpy(prompt.mel)[None], torch.from_numpy(prompt.embedding)[None], streaming=True,
                    finalize=finalize)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(100 + seed)).tolist()


def _padded_flow(max_batch: int = 4, max_frames: int = 512):
    """A copy of the tiny flow with the graphs' padded buckets, run eagerly (CPU)."""
    flow = copy.deepcopy(_cv2().flow)
    enable_flow_graphs(flow, max_batch=max_batch, max_frames=max_frames, use_graphs=False, incremental=True)
    return flow


def test_pass_bias_masks_padding_and_later_chunks():
    """Row 0: 50 cached frames (of 64 slots), 60 new (of 64): a query sees every cached frame and the
    new ones before its 50-frame chunk ends; padded keys never; a padded query its first new frame only.
    Row 1: nothing cached, 3 new."""
    bias = pass_bias(torch.tensor([50, 0]), torch.tensor([60, 3]), cached=64, new=64, chunk=50, dtype=torch.float32)
    allowed = bias == 0
    assert allowed.shape == (4, 64, 128) and torch.equal(allowed[:2], allowed[2:])  # both CFG halves
    row = allowed[0]
    assert row[:60, :50].all() and not row[:60, 50:64].any()  # cached valid / cached padding
    # query 0 (frame 50) is in chunk [50, 100): new keys 0..49; query 50 (frame 100) sees new 0..59 (all valid)
    assert row[0, 64:].tolist() == [True] * 50 + [False] * 14
    assert row[50, 64:].tolist() == [True] * 60 + [False] * 4
    assert not row[60:, :64].any() and row[60:, 64].all() and not row[60:, 65:].any()  # padded queries
    row1 = allowed[1]
    assert not row1[:, :64].any() and row1[:3, 64:67].all() and not row1[:3, 67:].any()
    assert row1[3:, 64].all() and not row1[3:, 65:].any()


def _caches_after(flow, jobs: list[tuple[VoicePrompt, list[int], int]]) -> list[FlowCache]:
    """A cache per request, advanced by one non-final job each (its tokens up to ``end`` + look-ahead)."""
    la = flow.spec.pre_lookahead_len
    caches = [FlowCache() for _ in jobs]
    for (prompt, tokens, end), cache in zip(jobs, caches):
        if end:
            row = flow.start_incremental_rows([_item(prompt, tokens[:end + la], False)], [cache], [None])[0]
            flow.incremental.solve([row])
            row.commit()
    return caches


def test_rows_at_different_steps_and_lengths_share_padded_passes():
    """Three requests (cached 0 / 100 / 150 frames; a first, a middle and a final job) solved alone
    at their exact sizes, and together in padded buckets with staggered starts: same mel, same
    caches afterwards."""
    cv2 = _cv2()
    la = cv2.spec.flow.pre_lookahead_len
    reqs = [(_prompt(20, 1), _tokens(120, 1), 0), (_prompt(25, 2), _tokens(150, 2), 25),
            (_prompt(30, 3), _tokens(90, 3), 45)]
    nxt = [(_item(p, t[:60 + la], False)) for p, t, _ in reqs[:2]] + [_item(reqs[2][0], reqs[2][1], True)]
    exact, padded = copy.deepcopy(cv2.flow), _padded_flow()
    caches_a = _caches_after(exact, reqs)
    caches_b = _caches_after(exact, reqs)  # the same states for the padded run (built the same way)
    assert [c.frames for c in caches_a] == [0, 100, 150]

    alone = [exact.start_incremental_rows([it], [c], [None])[0] for it, c in zip(nxt, caches_a)]
    for row in alone:
        exact.incremental.solve([row])
    rows = padded.start_incremental_rows(nxt, caches_b, [0, 1, 2])
    assert [r.keep for r in rows] == [150, 50, 0] and [r.start for r in rows] == [0, 100, 150]
    steps = cv2.spec.flow.n_timesteps
    padded.incremental.advance([rows[2]])
    padded.incremental.advance([rows[2], rows[1]])
    while live := [r for r in rows if r.step < steps]:
        padded.incremental.advance(live)
    assert padded.incremental.eager_calls == padded.incremental.passes and padded.incremental.num_graphs >= 2
    for a, b, ca, cb in zip(alone, rows, caches_a, caches_b):
        assert a.frames == b.frames and torch.allclose(a.x, b.x, atol=1e-5), float((a.x - b.x).abs().max())
        a.commit()
        b.commit()
        assert ca.frames == cb.frames
        for s in range(steps):
            assert torch.allclose(ca.convs[s], cb.convs[s], atol=1e-5)
            assert torch.allclose(ca.attn[s][:, :, :ca.frames], cb.attn[s][:, :, :cb.frames], atol=1e-5)


def _reference_audio(t2w: Token2Wav, prompt, tokens, seed):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    state = t2w.new_stream(prompt, stream=True, generator=generator)
    out = []
    while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
        out.append(t2w.run(job))
    return torch.cat(out)


def test_stepped_token2wav_mixes_incremental_and_recomputed_rows():
    """Four streams and one unstreamed request through start_solves / advance / finish, passes
    picked by random deadlines (one kind per pass): every request's audio equals the recompute's
    run alone, and the incremental streams solved each frame once."""
    cv2 = _cv2()
    flow = _padded_flow()
    t2w = Token2Wav(cv2.spec, flow, cv2.hift, min_first_hop=10, cv2_flow="incremental")
    ref_t2w = Token2Wav(cv2.spec, copy.deepcopy(cv2.flow), cv2.hift, min_first_hop=10)
    specs = [(20, 130, True), (25, 60, True), (33, 170, True), (15, 40, False), (22, 95, True)]
    prompts = [_prompt(p, 10 + i) for i, (p, _, _) in enumerate(specs)]
    toks = [_tokens(n, 10 + i) for i, (_, n, _) in enumerate(specs)]
    states = [t2w.new_stream(p, stream=s, generator=torch.Generator().manual_seed(i))
              for i, (p, (_, _, s)) in enumerate(zip(prompts, specs))]
    audio: list[list[torch.Tensor]] = [[] for _ in specs]
    index = {id(st): i for i, st in enumerate(states)}
    rng = random.Random(5)
    rows, kinds_seen = [], set()
    while True:
        busy = {id(r.tag.state) for r in rows}
        jobs = [j for st, tk in zip(states, toks)
                if id(st) not in busy and (j := t2w.next_job(st, tk, llm_done=True)) is not None]
        rows += t2w.start_solves(jobs)
        if not rows:
            break
        deadline = {id(r): rng.random() for r in rows}
        batch = pick_rows(rows, deadline, 0.0, 0.3, 3, 4.0)
        kinds_seen.add(tuple(sorted({r.kind for r in batch})))
        t2w.advance(batch)
        done = [r for r in rows if r.step == t2w.n_steps]
        rows = [r for r in rows if r.step < t2w.n_steps]
        for row, a in zip(done, t2w.finish(done)):
            audio[index[id(row.tag.state)]].append(a)
    assert kinds_seen >= {("incremental",), ("recompute",)} and all(len(k) == 1 for k in kinds_seen)
    for i, (p, tk, (_, n, streamed)) in enumerate(zip(prompts, toks, specs)):
        if streamed:
            ref = _reference_audio(ref_t2w, p, tk, i)
            assert states[i].flow_frames == 2 * (specs[i][0] + n)  # every frame solved once
        else:
            ref_state = ref_t2w.new_stream(p, stream=False, generator=torch.Generator().manual_seed(i))
            ref = ref_t2w.run(ref_t2w.next_job(ref_state, tk, llm_done=True))
        got = torch.cat(audio[i])
        assert got.shape == ref.shape and torch.allclose(got, ref, atol=5e-4), (i, float((got - ref).abs().max()))
        assert states[i].flow_cache is None and states[i].finished


class _CountCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _counting(f, calls: list[int]):
    def counted(*args):
        with _CountCalls() as mode:
            f(*args)
        calls.append(mode.calls)
    return counted


def _host_calls_per_pass(n_rows: int) -> int:
    """Dispatcher calls of one pass's _load + _store (the host work around the graph) over
    ``n_rows`` second-chunk rows (cached frames, new frames, a kept part)."""
    flow, cv2 = _padded_flow(max_batch=8), _cv2()
    t2w = Token2Wav(cv2.spec, flow, cv2.hift, min_first_hop=10, cv2_flow="incremental")
    states = [t2w.new_stream(_prompt(20 + i, i), stream=True, generator=torch.Generator().manual_seed(i))
              for i in range(n_rows)]
    toks = [_tokens(120, i) for i in range(n_rows)]
    calls: list[int] = []
    for _ in range(2):  # the first chunk, then the measured second one
        rows = t2w.start_solves([t2w.next_job(st, tk, llm_done=False) for st, tk in zip(states, toks)])
        calls.clear()
        with pytest.MonkeyPatch.context() as m:
            for name in ("_load", "_store"):
                m.setattr(flow.incremental, name, _counting(getattr(flow.incremental, name), calls))
            t2w.advance(rows)
        for _ in range(t2w.n_steps - 1):
            t2w.advance(rows)
        t2w.finish(rows)
    assert all(r.kind == "incremental" and r.start > 0 and r.keep > 0 for r in rows)
    return sum(calls)


def test_a_pass_makes_a_few_dispatcher_calls_per_row_not_one_per_field():
    """_load/_store run on the token2wav driver thread once per pass, their Python under the GIL;
    a statement per row and field made ~53 dispatcher calls per row (~850 for 16 rows, where the
    pass itself is one graph replay). Each field is one call for all rows now; per row only views and the
    convolution histories' clones remain (16.75 calls per row here, 2026-12-05)."""
    per_row = (_host_calls_per_pass(6) - _host_calls_per_pass(2)) / 4
    assert per_row <= 20, per_row


class _Cats(TorchDispatchMode):
    """Records the output shape of every concatenation."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.default:
            self.shapes.append(tuple(out.shape))
        return out


def test_a_pass_attends_over_the_cached_frames_where_they_lie():
    """Each block's keys and values come from the cached frames' normed inputs followed by the new
    ones: one buffer per bucket holds both, so no block concatenates them (a copy of every cached
    frame, per block and pass, 56 of them in a CosyVoice2 pass; at 16 rows over 1,024 cached frames
    ~34 MB each in bf16)."""
    cv2 = _cv2()
    flow = _padded_flow()
    reqs = [(_prompt(25, 2), _tokens(150, 2), 25)]
    la = cv2.spec.flow.pre_lookahead_len
    caches = _caches_after(flow, reqs)
    (row,) = flow.start_incremental_rows([_item(p, t[:60 + la], False) for p, t, _ in reqs], caches, [0])
    assert row.start == 100
    bucket = flow.incremental.bucket_of(1, row.frames, row.start)
    with _Cats() as cats:
        flow.incremental.advance([row])
    keys = 2 * bucket[0], bucket[2] + bucket[1]  # CFG rows, cached + new frames of the bucket
    assert cats.shapes and not [s for s in cats.shapes if len(s) == 3 and s[:2] == keys], cats.shapes


def test_a_pass_refuses_mixed_kinds_and_two_rows_of_one_request():
    cv2 = _cv2()
    t2w = Token2Wav(cv2.spec, _padded_flow(), cv2.hift, cv2_flow="incremental")
    streamed = t2w.new_stream(_prompt(20, 1), stream=True)
    whole = t2w.new_stream(_prompt(20, 2), stream=False)
    tokens = _tokens(80, 1)
    rows = t2w.start_solves([t2w.next_job(streamed, tokens, llm_done=False), t2w.next_job(whole, tokens, True)])
    assert [r.kind for r in rows] == ["incremental", "recompute"]
    with pytest.raises(ValueError, match="one kind"):
        t2w.advance(rows)
    with pytest.raises(ValueError, match="one row per cache"):
        t2w.flow.incremental.advance([rows[0], rows[0]])
    with pytest.raises(ValueError, match="at most one row per request"):
        t2w.start_solves([t2w.next_job(streamed, tokens, False)] * 2)


def test_a_failed_finish_leaves_the_cache_and_a_retry_gives_the_same_audio(monkeypatch):
    """The vocoder fails once while a stream's second chunk finishes: its cache is put back (frames,
    convolution history), and finishing the same rows again gives the audio of a run without failure."""
    cv2 = _cv2()
    prompt, tokens = _prompt(20, 4), _tokens(120, 4)

    def chunks(fail_on_call: int | None):
        t2w = Token2Wav(cv2.spec, _padded_flow(), cv2.hift, cv2_flow="incremental")
        state = t2w.new_stream(prompt, stream=True, generator=torch.Generator().manual_seed(3))
        out = []
        while (job := t2w.next_job(state, tokens, llm_done=True)) is not None:
            rows = t2w.start_solves([job])
            t2w.flow.incremental.solve(rows)
            if state.calls == fail_on_call:
                before = (state.flow_cache.frames, list(state.flow_cache.convs), state.token_offset)
                with monkeypatch.context() as m:
                    m.setattr(t2w, "_vocode_many", lambda *a: (_ for _ in ()).throw(RuntimeError("vocoder fault")))
                    with pytest.raises(RuntimeError, match="vocoder fault"):
                        t2w.finish(rows)
                after = (state.flow_cache.frames, state.flow_cache.convs, state.token_offset)
                assert after[0] == before[0] and after[2] == before[2]
                assert all(a is b for a, b in zip(after[1], before[1])) and len(after[1]) == len(before[1])
            out += t2w.finish(rows)
        return out

    clean, retried = chunks(None), chunks(1)
    assert len(clean) == len(retried) >= 3
    for a, b in zip(clean, retried):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["cosyvoice2", "cosyvoice3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_passes_equal_the_eager_padded_ones(family, dtype, tmp_path, monkeypatch):
    """CUDA: each bucket's graph replay gives the eager padded pass's x and convolution history.
    Random tiny weights from the project's writer: the GPU machine has no parity fixtures."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions in float32
    torch.manual_seed(0)
    tiny = build_flow(write_config_dir(tmp_path, family, TINY_DIMS[family]).flow).eval()
    reqs = [(_prompt(20, 1), _tokens(120, 1), 0), (_prompt(25, 2), _tokens(150, 2), 25)]
    reqs = [(dataclasses.replace(p, family=family), t, e) for p, t, e in reqs]
    la = tiny.spec.pre_lookahead_len
    out = {}
    # eager padded; graphed; graphed for batches of one only (the passes of both rows run at their
    # exact size, eagerly: graph misses, the replica's tts_cuda_graph_misses_total)
    for graphs, max_batch in ((False, 4), (True, 4), (True, 1)):
        flow = copy.deepcopy(tiny).to("cuda", dtype)
        enable_flow_graphs(flow, max_batch=max_batch, max_frames=512, use_graphs=graphs, incremental=True)
        caches = _caches_after(flow, reqs)
        rows = flow.start_incremental_rows([_item(p, t[:70 + la], False) for p, t, _ in reqs], caches, [0, 1])
        inc = flow.incremental
        replays, eager, missed = inc.replays, inc.eager_calls, missed_total()  # the caches' solves ran before
        inc.advance([rows[1]])
        inc.solve(rows)
        replays, eager, missed = inc.replays - replays, inc.eager_calls - eager, missed_total() - missed
        n = tiny.spec.n_timesteps
        if graphs and max_batch == 4:
            assert (replays, eager, missed) == (n + 1, 0, 0)
        elif graphs:  # the passes of one row replay (the first and the last), the two-row ones miss
            assert (replays, eager, missed) == (2, n - 1, n - 1)
        else:  # graphs off: eager by design, not a miss
            assert (replays, eager, missed) == (0, n + 1, 0)
        out[graphs, max_batch] = [(r.x.float().cpu(), r.new_convs[-1].float().cpu()) for r in rows]
    # Graphed against eager over the same buckets: the same kernels. The batches-of-one arm runs
    # its two-row passes at their exact shape, not padded: other reductions, so in bfloat16 up to
    # about an ulp of the values apart (on the CPU, 2026-12-05: 3.1e-2 at |x| ~ 4.5, one bf16 ulp
    # there; float32 2e-6). On the H100 three variants failed with one bf16 tolerance for both and
    # cuDNN's TF32 convolutions in float32 (the time limit cut the text: that is the likely cause).
    for other in ((True, 4), (True, 1)):
        for (xa, ha), (xb, hb) in zip(out[False, 4], out[other]):
            scale = max(xa.abs().max().item(), ha.abs().max().item(), 1.0)
            if dtype == torch.float32:
                tol = 1e-4
            else:
                tol = 2e-2 if other == (True, 4) else 2 * torch.finfo(torch.bfloat16).eps * scale
            gaps = ((xa - xb).abs().max().item(), (ha - hb).abs().max().item())
            assert max(gaps) <= tol, (other, gaps, tol)


def test_a_voices_prompt_prefix_is_solved_once_for_all_its_requests():
    """float64 flow: the first request of a voice records its prompt prefix (the whole attention
    chunks of the prompt taken as a non-final job); later requests with that voice start their first
    job after it, solve fewer frames, and stream the recompute's samples bit for bit; a short
    answer whose first job is its last, and another voice, too."""
    cv2 = _cv2()
    flow64 = copy.deepcopy(cv2.flow).double()
    inc = Token2Wav(cv2.spec, flow64, cv2.hift, min_first_hop=10, cv2_flow="incremental", prompt_cache_bytes=1 << 30)
    ref = Token2Wav(cv2.spec, copy.deepcopy(flow64), cv2.hift, min_first_hop=10)
    voice, other = _prompt(43, 20), _prompt(31, 21)
    prefix = flow64.prompt_prefix_frames(43)
    assert prefix == 50  # 2 x (43 - 3) = 80 frames: one whole 50-frame chunk
    runs = [(voice, 120, 0), (voice, 90, prefix), (voice, 9, prefix), (other, 60, 0), (other, 12, 50)]
    for i, (prompt, n, first_start) in enumerate(runs):
        tokens = _tokens(n, 30 + i)
        state = inc.new_stream(prompt, stream=True, generator=torch.Generator().manual_seed(i))
        chunks, starts = [], []
        while (job := inc.next_job(state, tokens, llm_done=True)) is not None:
            rows = inc.start_solves([job])
            starts.append(rows[0].start)
            inc.flow.incremental.solve(rows)
            chunks += inc.finish(rows)
        assert starts[0] == first_start, i
        total = 2 * (prompt.n_tokens + n)
        assert state.flow_frames == total - first_start, i  # every frame past the prefix solved once
        want = _reference_audio(ref, prompt, tokens, i)
        got = torch.cat(chunks)
        assert got.shape == want.shape and torch.equal(got, want), (i, float((got - want).abs().max()))
    assert len(inc.prompt_prefixes) == 2 and inc.prompt_prefixes.hits == 3 and inc.prompt_prefixes.misses == 2


def test_a_new_voices_prefix_solved_alone_first_gives_the_same_stream():
    """float64 flow: a stream of a voice with no kept prefix gets a prefix job (Token2Wav.prefix_job),
    solved in one pass with another stream's chunk (a pass mixes the two incremental rows); its
    first job then starts after the prefix, and the stream is the recompute's bit for bit. A
    stream of a kept voice, a prompt without a whole attention chunk and an unstreamed request
    get no prefix job; hits and misses count streams, not lookups."""
    cv2 = _cv2()
    flow64 = copy.deepcopy(cv2.flow).double()
    inc = Token2Wav(cv2.spec, flow64, cv2.hift, min_first_hop=10, cv2_flow="incremental", prompt_cache_bytes=1 << 30)
    ref = Token2Wav(cv2.spec, copy.deepcopy(flow64), cv2.hift, min_first_hop=10)
    voice, known, short = _prompt(43, 22), _prompt(31, 23), _prompt(20, 24)  # short: 2 x 17 < 50 frames
    warm = inc.new_stream(known, stream=True)
    assert inc.prefix_job(warm) is not None
    assert inc.prefix_job(warm) is None  # looked up once per stream
    (row,) = inc.start_solves([inc.prefix_job(inc.new_stream(known, stream=True))])
    inc.flow.incremental.solve([row])
    assert [a.numel() for a in inc.finish([row])] == [0]
    assert (inc.prompt_prefixes.primed, inc.prompt_prefixes.hits, inc.prompt_prefixes.misses) == (1, 0, 2)

    cold = inc.new_stream(voice, stream=True, generator=torch.Generator().manual_seed(5))
    other = inc.new_stream(known, stream=True, generator=torch.Generator().manual_seed(6))
    assert inc.prefix_job(other) is None  # kept: a hit
    job = inc.prefix_job(cold)
    tokens = {id(cold): _tokens(70, 40), id(other): _tokens(50, 41)}
    first = inc.next_job(other, tokens[id(other)], llm_done=True)
    prefix_row, other_row = inc.start_solves([job, first])
    assert (prefix_row.start, prefix_row.frames, prefix_row.keep) == (0, 50, 50)
    assert other_row.start == flow64.prompt_prefix_frames(31)  # the kept prefix
    inc.flow.incremental.solve([prefix_row, other_row])
    empty, audio = inc.finish([prefix_row, other_row])
    assert empty.numel() == 0 and cold.flow_cache is None and cold.token_offset == 0
    chunks = {id(cold): [], id(other): [audio]}
    starts = []
    for state in (cold, other):
        while (job := inc.next_job(state, tokens[id(state)], llm_done=True)) is not None:
            rows = inc.start_solves([job])
            starts.append(rows[0].start)
            inc.flow.incremental.solve(rows)
            chunks[id(state)] += inc.finish(rows)
    assert starts[0] == 50  # the cold stream's first job after its primed prefix
    for state, prompt, seed in ((cold, voice, 5), (other, known, 6)):
        want = _reference_audio(ref, prompt, tokens[id(state)], seed)
        got = torch.cat(chunks[id(state)])
        assert got.shape == want.shape and torch.equal(got, want), float((got - want).abs().max())
    assert (inc.prompt_prefixes.primed, inc.prompt_prefixes.hits, inc.prompt_prefixes.misses) == (2, 1, 3)
    assert inc.prefix_job(inc.new_stream(short, stream=True)) is None
    assert inc.prefix_job(inc.new_stream(voice, stream=False)) is None


def test_prompt_prefixes_keep_the_recently_used_within_their_bytes():
    def cache(frames: int) -> FlowCache:
        return FlowCache(frames=frames, attn=[torch.zeros(1, 2, frames, 4)], convs=[torch.zeros(2, 3, 2)])

    size = cache(10).nbytes()
    prefixes = PromptPrefixes(max_bytes=2 * size)
    prefixes.put(b"a", cache(10))
    prefixes.put(b"b", cache(10))
    assert prefixes.get(b"a") is not None  # a is now the most recent: b goes first
    prefixes.put(b"c", cache(10))
    assert prefixes.get(b"b") is None and prefixes.get(b"a") is not None and prefixes.get(b"c") is not None
    prefixes.put(b"big", cache(100))  # larger than the whole budget: not kept, nothing evicted for it
    assert prefixes.get(b"big") is None and len(prefixes) == 2 and prefixes.nbytes() <= 2 * size
    shared = prefixes.get(b"a").shared()
    shared.reserve(15, 1, SimpleNamespace(n_blocks=1, dim=4), torch.zeros(1))
    assert shared.attn[0] is not prefixes.get(b"a").attn[0]  # growing a request's cache copies the prefix


@functools.lru_cache(maxsize=1)
def _cv3():
    return load_model(parity_dir() / "cosyvoice3" / "model")


def test_cosyvoice3_dit_streams_the_recomputes_samples_incrementally():
    """CosyVoice3's DiT (causal k=31 position embedding, rotary angles by absolute frame): with a
    float64 flow, three streams (two of one voice: the second starts after the voice's prompt
    prefix) through the padded, stepped incremental passes give the recompute's samples bit for bit."""
    cv3 = _cv3()
    flow64 = copy.deepcopy(cv3.flow).double()
    enable_flow_graphs(flow64, max_batch=4, max_frames=512, use_graphs=False, incremental=True)
    inc = Token2Wav(cv3.spec, flow64, cv3.hift, min_first_hop=10, cv3_flow="incremental", cv3_vocoder="incremental",
                    prompt_cache_bytes=1 << 30)
    ref = Token2Wav(cv3.spec, copy.deepcopy(cv3.flow).double(), cv3.hift, min_first_hop=10, cv3_vocoder="incremental")
    assert inc.flow_mode == "incremental" and ref.flow_mode == "recompute"
    vocab = cv3.spec.flow.vocab_size

    def prompt(n: int, seed: int) -> VoicePrompt:
        g = torch.Generator().manual_seed(seed)
        return VoicePrompt(family="cosyvoice3", text_tokens=np.zeros(0, np.int32),
                           speech_tokens=torch.randint(0, vocab, (n,), generator=g, dtype=torch.int32).numpy(),
                           mel=torch.randn(2 * n, 80, generator=g).numpy(),
                           embedding=torch.randn(cv3.spec.flow.spk_embed_dim, generator=g).numpy())

    voice, other = prompt(30, 40), prompt(47, 41)
    runs = [(voice, 150), (other, 110), (voice, 70)]
    toks = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(50 + i)).tolist()
            for i, (_, n) in enumerate(runs)]
    states = [inc.new_stream(p, stream=True) for p, _ in runs[:2]]
    audio: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def drive(streams: dict[int, object]) -> None:
        """The streams' jobs as rows, passes over all live rows with staggered joins."""
        rows, rng = [], random.Random(9)
        while True:
            busy = {id(r.tag.state) for r in rows}
            jobs = [(i, j) for i, st in streams.items()
                    if id(st) not in busy and (j := inc.next_job(st, toks[i], llm_done=True)) is not None]
            for (i, _), row in zip(jobs, inc.start_solves([j for _, j in jobs])):
                row.tag_index = i
                rows.append(row)
            if not rows:
                return
            inc.advance(rng.sample(rows, rng.randint(1, len(rows))))
            done = [r for r in rows if r.step == inc.n_steps]
            rows = [r for r in rows if r.step < inc.n_steps]
            for row in done:  # vocoded one at a time: a vocoder batch would add float32 GEMM rounding
                audio[row.tag_index] += inc.finish([row])

    drive({0: states[0], 1: states[1]})
    third = inc.new_stream(voice, stream=True)
    drive({2: third})
    assert inc.prompt_prefixes.hits == 1 and inc.prompt_prefixes.misses == 2
    assert third.flow_frames == 2 * (30 + 70) - flow64.prompt_prefix_frames(30)
    # a new voice whose prefix is solved by a job of its own first (Token2Wav.prefix_job), padded
    fresh = prompt(52, 42)
    runs.append((fresh, 60))
    toks.append(torch.randint(0, vocab, (60,), generator=torch.Generator().manual_seed(53)).tolist())
    fourth = inc.new_stream(fresh, stream=True)
    (row,) = inc.start_solves([inc.prefix_job(fourth)])
    inc.flow.incremental.solve([row])
    assert [a.numel() for a in inc.finish([row])] == [0] and inc.prompt_prefixes.primed == 1
    audio[3] = []
    drive({3: fourth})
    assert fourth.flow_frames == 2 * (52 + 60) - flow64.prompt_prefix_frames(52) > 0
    assert inc.prompt_prefixes.hits == 1 and inc.prompt_prefixes.misses == 3
    for i, (p, _) in enumerate(runs):
        want = _reference_audio(ref, p, toks[i], None)
        got = torch.cat(audio[i])
        assert got.shape == want.shape and torch.equal(got, want), (i, float((got - want).abs().max()))


def test_streams_past_the_flow_cache_budget_are_recomputed_with_the_same_audio():
    """A budget of 800 cached frames: both streams' first jobs fit (256 frames each), the final job
    of the first grows its cache to 512, and the second stream's growth would pass the budget: it
    drops its cache and is recomputed (its rows are SolveRow from then on), both stream the recompute's audio, and once
    the first stream is done and its cache gone, a new stream is incremental again."""
    cv2 = _cv2()
    flow = _padded_flow()
    ref = Token2Wav(cv2.spec, copy.deepcopy(cv2.flow), cv2.hift, min_first_hop=10)
    frame_bytes = flow.incremental_stepper().frame_bytes
    t2w = Token2Wav(cv2.spec, flow, cv2.hift, min_first_hop=10, cv2_flow="incremental",
                    flow_cache_bytes=800 * frame_bytes)
    prompts, toks = [_prompt(20, 60), _prompt(24, 61), _prompt(22, 62)], [_tokens(n, 60 + n) for n in (160, 140, 90)]

    def run(indices: list[int]) -> dict[int, tuple[torch.Tensor, list[str]]]:
        states = {i: t2w.new_stream(prompts[i], stream=True, generator=torch.Generator().manual_seed(i))
                  for i in indices}
        out = {i: ([], []) for i in indices}
        while jobs := [(i, j) for i, st in states.items() if (j := t2w.next_job(st, toks[i], llm_done=True))]:
            rows = t2w.start_solves([j for _, j in jobs])
            for kind in ("incremental", "recompute"):
                part = [r for r in rows if r.kind == kind]
                while part and part[0].step < t2w.n_steps:
                    t2w.advance(part)
            for (i, _), row in zip(jobs, rows):
                out[i][0].extend(t2w.finish([row]))
                out[i][1].append(row.kind)
        return {i: (torch.cat(a), kinds) for i, (a, kinds) in out.items()}

    first = run([0, 1])
    kinds = [first[i][1] for i in (0, 1)]
    for k in kinds:  # incremental until the budget is hit, recomputed from then on, never back
        assert k[0] == "incremental" and k == sorted(k), k
    assert sorted("recompute" in k for k in kinds) == [False, True] and t2w.flow_fallbacks == 1
    assert 768 * frame_bytes <= t2w.peak_cache_bytes <= 800 * frame_bytes  # 256 + 512 frames held at most
    assert set(run([2])[2][1]) == {"incremental"}  # the earlier caches are gone with their streams
    for i, (audio, _) in first.items():
        want = _reference_audio(ref, prompts[i], toks[i], i)
        assert audio.shape == want.shape and torch.allclose(audio, want, atol=5e-4), i



def test_bad_incremental_jobs_are_refused():
    """A recomputed-only job (no chunk masks), a cache already past the job's end, and marks or
    keeps outside the new frames are errors, not silent wrong audio."""
    from cosyvoice_runtime.errors import InvalidInputError

    cv2 = _cv2()
    flow = copy.deepcopy(cv2.flow)
    prompt, tokens = _prompt(20, 80), _tokens(60, 80)
    whole = _item(prompt, tokens, True)
    whole.streaming = False
    with pytest.raises(InvalidInputError, match="streamed jobs with chunk masks"):
        flow.start_incremental_rows([whole], [FlowCache()], [None])
    past = FlowCache(frames=10_000)
    with pytest.raises(InvalidInputError, match="flow cache holds 10000 frames"):
        flow.start_incremental_rows([_item(prompt, tokens, True)], [past], [None])
    stepper = flow.incremental_stepper()
    z = torch.zeros(80, 30)
    for keep, mark in ((31, 0), (0, 31), (-1, 0)):
        with pytest.raises(ValueError, match="keeps and marks"):
            stepper.new_row(z, z, torch.zeros(80), FlowCache(), keep=keep, mark=mark)
    row = flow.start_incremental_rows([_item(prompt, tokens, True)], [FlowCache()], [None])[0]
    stepper.solve([row])
    with pytest.raises(ValueError, match="finished row"):
        stepper.advance([row])


def test_a_row_past_the_flow_buckets_is_marked_oversize():
    """Token2Wav.start_solves marks the rows no bucket holds (cached frames past the padded
    stepper's max_cached): the stepped driver runs them apart (stream_schedule.pick_rows)."""
    cv2 = _cv2()
    t2w = Token2Wav(cv2.spec, _padded_flow(max_frames=256), cv2.hift, min_first_hop=10, cv2_flow="incremental")
    short, long = t2w.new_stream(_prompt(20, 1), stream=True), t2w.new_stream(_prompt(150, 2), stream=True)
    tokens = [_tokens(120, 1), _tokens(120, 2)]
    first = t2w.start_solves([t2w.next_job(st, tk, llm_done=True) for st, tk in zip((short, long), tokens)])
    assert [r.oversize for r in first] == [False, False]  # nothing cached yet: the prompt is new frames
    t2w.flow.incremental.solve(first)
    t2w.finish(first)
    rows = t2w.start_solves([t2w.next_job(st, tk, llm_done=True) for st, tk in zip((short, long), tokens)])
    inc = t2w.flow.incremental
    assert [r.start > inc.max_cached for r in rows] == [False, True]  # the long prompt's frames are cached now
    assert [inc.bucket_of(1, r.frames, r.start) is None for r in rows] == [False, True]
    assert [r.oversize for r in rows] == [False, True]
    unpadded = Token2Wav(cv2.spec, copy.deepcopy(cv2.flow), cv2.hift, cv2_flow="incremental")  # no buckets: all alike
    st = unpadded.new_stream(_prompt(150, 2), stream=True)
    assert [r.oversize for r in unpadded.start_solves([unpadded.next_job(st, _tokens(60, 2), llm_done=True)])] == [False]
