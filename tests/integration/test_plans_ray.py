"""The CUDA replica's default plan on the CPU, end to end on real local Ray (issue 42, ask 7).

Two applications serve the same tiny model and voice: ``tiny`` runs a CPU replica's default plan
(whole token2wav batches by ``@serve.batch``, the flow recomputed, one thread), ``tinycuda`` the
CUDA replica's default plan less what needs a GPU (token2wav pass by pass deadline-first, the
incremental flow, two stage threads; tests/deployments/plans.py). Over HTTP, the same request with
the same seed gets the same audio from both within the incremental flow's float noise (the
in-process version of this, both families: tests/deployments/test_plans_on_cpu.py). The other
tiny-model tests that run on both plans: tests/integration/test_tiny_model_ray.py.
"""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.deployments.plans import AUDIO_TOL, cuda_default_plan, without_gpu

pytestmark = pytest.mark.ray

PCM_TOL = int(AUDIO_TOL * 32768) + 1  # the float bound in 16-bit steps, plus one for the rounding


def _pcm(url: str, text: str, seed: int, stream: bool) -> np.ndarray:
    with httpx.stream("POST", f"{url}/v1/audio/speech", timeout=120,
                      json={"model": "tts-1", "input": text, "voice": "tiny", "response_format": "pcm",
                            "stream": stream, "seed": seed}) as r:
        assert r.status_code == 200, r.read()
        return np.frombuffer(b"".join(r.iter_raw()), "<i2")


def test_each_app_runs_its_plan(tiny_app, tiny_cuda_plan_app):
    cpu = tiny_app["synth"].health.remote().result(timeout_s=30).detail["plan"]
    cuda = tiny_cuda_plan_app["synth"].health.remote().result(timeout_s=30).detail["plan"]
    assert (cpu["token2wav"]["scheduler"], cpu["token2wav"]["cv2"]["streamed"], cpu["overlap_stages"]) \
        == ("batch", "recompute", False)
    assert cuda == {**without_gpu(cuda_default_plan()).as_dict(), "mode_source": cuda["mode_source"]}


@pytest.mark.parametrize("stream", [True, False])
def test_both_plans_speak_the_same_audio(tiny_app, tiny_cuda_plan_app, stream):
    text = "Hello world, the same words through both plans."
    cpu = _pcm(tiny_app["url"], text, seed=7, stream=stream)
    cuda = _pcm(tiny_cuda_plan_app["url"], text, seed=7, stream=stream)
    assert cpu.size == cuda.size > 24000  # more than a second of audio
    assert int(np.abs(cpu.astype(np.int32) - cuda.astype(np.int32)).max()) <= PCM_TOL
    stats = tiny_cuda_plan_app["synth"].stats.remote().result(timeout_s=30)
    assert stats["token2wav_scheduler"] == "steps" and stats["flow_passes_total"] > 0
    assert stats["failed_requests_total"] == 0
