"""HiFT vocoders (CV2 ``HiFTGenerator``, CV3 ``CausalHiFTGenerator``) and their streaming glue."""
from cosyvoice_runtime.hift.generator import CausalHiFTGenerator, HiFTGenerator, build_hift
from cosyvoice_runtime.hift.noise import NoiseBuffers, official_noise_buffers, replay_noise_buffers
from cosyvoice_runtime.hift.streaming import VocoderCall, VocoderStream, speed_resample, vocode_batch, vocode_chunk

__all__ = [
    "CausalHiFTGenerator",
    "HiFTGenerator",
    "NoiseBuffers",
    "VocoderCall",
    "VocoderStream",
    "build_hift",
    "official_noise_buffers",
    "replay_noise_buffers",
    "speed_resample",
    "vocode_batch",
    "vocode_chunk",
]
