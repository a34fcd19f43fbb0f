"""Speech-token LLM: Qwen2 backbone, KV cache, sampling, reference decoding and the batched engine."""
from cosyvoice_runtime.llm.engine import LLMEngine
from cosyvoice_runtime.llm.generate import DecodeState, decode, decode_all
from cosyvoice_runtime.llm.inputs import LMInput, build_lm_input
from cosyvoice_runtime.llm.kv_cache import KVCache
from cosyvoice_runtime.llm.model import SpeechLM, build_llm
from cosyvoice_runtime.llm.sampling import SamplingParams

__all__ = [
    "DecodeState", "KVCache", "LLMEngine", "LMInput", "SamplingParams", "SpeechLM",
    "build_llm", "build_lm_input", "decode", "decode_all",
]
