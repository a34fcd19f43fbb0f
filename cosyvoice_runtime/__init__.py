"""CosyVoice2 / CosyVoice3 inference runtime: pure PyTorch, no serving imports.

Heavy or optional backends (onnxruntime, tensorrt) are imported inside the functions that
need them, so importing this package stays cheap for CPU-only replicas.
"""
from cosyvoice_runtime.config import ModelSpec
from cosyvoice_runtime.errors import CosyVoiceError, InvalidInputError, ModelLoadError, VoiceNotFoundError

__all__ = ["CosyVoiceError", "InvalidInputError", "ModelLoadError", "ModelSpec", "VoiceNotFoundError"]
