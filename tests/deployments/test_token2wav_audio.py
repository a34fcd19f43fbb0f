"""The replica's token2wav audio (deployments.runtime_adapter.RuntimeToken2Wav): a batch comes back to
the host in one copy and is split into each row's own float32 samples."""
from __future__ import annotations

import copy
import dataclasses

import numpy as np
import torch

from cosyvoice_runtime.model import load_model
from deployments.runtime_adapter import RuntimeToken2Wav, _host_audio
from tests.deployments.test_flow_stats import _voice, cpu_token2wav_plan
from tests.runtime.parity.common import parity_dir


def test_a_batch_comes_back_as_each_rows_own_samples():
    base = load_model(parity_dir() / "cosyvoice2" / "model")
    runtimes = [RuntimeToken2Wav(dataclasses.replace(base, flow=copy.deepcopy(base.flow)), cpu_token2wav_plan())
                for _ in range(2)]
    voices = [_voice(30, 80), _voice(24, 81)]
    tokens = [torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 23)]
    jobs = [[rt.next_job(rt.new_stream(v, stream=True, speed=1.0, seed=i), t, llm_done=True)
             for i, (v, t) in enumerate(zip(voices, tokens))] for rt in runtimes]
    got = runtimes[0].run_batch(jobs[0])
    want = [a.float().numpy() for a in runtimes[1].t2w.run_batch(jobs[1])]
    assert len({w.size for w in want}) == 2  # rows of different lengths: the split is what is tested
    for g, w in zip(got, want):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


def test_empty_and_bfloat16_rows_keep_their_place():
    rows = [torch.arange(3, dtype=torch.bfloat16), torch.zeros(0), torch.tensor([[0.5, -1.0]])]
    out = _host_audio(rows)
    assert [a.tolist() for a in out] == [[0.0, 1.0, 2.0], [], [0.5, -1.0]]
    assert all(a.dtype == np.float32 for a in out) and _host_audio([]) == []
