"""What a synthesizer replica reports to the load policy: the streams it is serving, not busy time."""
from __future__ import annotations

import asyncio

import numpy as np

from deployments.protocol import PreparedRequest, TextPiece, VoicePrompt
from deployments.synthesizer import Synthesizer
from deployments.synthesizer_config import SynthesizerConfig
from tests.deployments import fakes


def _req(rid: str) -> PreparedRequest:
    prompt = VoicePrompt(family="cosyvoice2", text_tokens=np.arange(3, dtype=np.int32),
                         speech_tokens=np.arange(10, dtype=np.int32), mel=np.zeros((20, 80), np.float32),
                         embedding=np.ones(192, np.float32))
    return PreparedRequest(request_id=rid, pieces=[TextPiece("x", np.arange(200, dtype=np.int32))], prompt=prompt,
                           llm_prompt_text_ids=np.zeros(0, np.int32), llm_use_prompt_speech=True, stream=True)


def test_streams_in_flight_count_open_streams_and_return_to_zero():
    cfg = SynthesizerConfig(max_running=4, max_ongoing_requests=4, warmup=False, token2wav={"max_batch_size": 2})
    s = Synthesizer(cfg, runtime_factory=fakes.fake_synthesis_runtime)

    s.outside_serve()  # no @serve.batch outside a replica

    async def main():
        seen = [s.record_autoscaling_stats()["streams_in_flight"]]
        streams = [s.synthesize(_req(f"r{i}")) for i in range(3)]
        for gen in streams:  # each stream has produced audio and is still open
            await gen.__anext__()
            seen.append(s.record_autoscaling_stats()["streams_in_flight"])
        for gen in streams:
            await gen.aclose()
        seen.append(s.record_autoscaling_stats()["streams_in_flight"])
        return seen

    assert asyncio.run(main()) == [0.0, 1.0, 2.0, 3.0, 0.0]
    stats = s.record_autoscaling_stats()
    assert set(stats) >= {"streams_in_flight", "gpu_utilization_pct"}
