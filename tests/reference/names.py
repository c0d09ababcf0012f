"""HF tensor names → GGUF names, as llama.cpp's converter maps them: through gguf-py's TensorNameMap."""

from __future__ import annotations

from functools import cache

import gguf

_ARCHITECTURES = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "gemma4": gguf.MODEL_ARCH.GEMMA4,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "olmo2": gguf.MODEL_ARCH.OLMO2,
    "granite": gguf.MODEL_ARCH.GRANITE,
    "smollm3": gguf.MODEL_ARCH.SMOLLM3,
    "gemma2": gguf.MODEL_ARCH.GEMMA2,
    "phi3": gguf.MODEL_ARCH.PHI3,
}


@cache
def _name_map(architecture: str, layer_count: int) -> gguf.TensorNameMap:
    return gguf.get_tensor_name_map(_ARCHITECTURES[architecture], layer_count)


def gguf_tensor_name(architecture: str, layer_count: int, hf_name: str) -> str:
    name = _name_map(architecture, layer_count).get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise ValueError(f"no GGUF name for HF tensor {hf_name!r} ({architecture})")
    if hf_name.endswith(".layer_scalar"):
        name += ".weight"  # a suffix-less HF buffer; Gemma 4's converter writes it as a weight
    return name
