"""Architecture name → family: how to read its config and build its forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ember.config import ModelConfig
from ember.errors import UnsupportedArchitectureError
from ember.families import gemma2, gemma3, gemma4, gptoss, llama, olmo2, phi3, qwen3moe
from ember.gguf_file import GGUFFile
from ember.weights import WeightStore


@dataclass(frozen=True, slots=True)
class Family:
    build_config: Callable[[GGUFFile], ModelConfig]
    build_forward: Callable[[ModelConfig, WeightStore, int], Any]
    cache_specs: Callable[[Any], list[tuple[int, int, int]]]  # (kv heads, head dim, window) per cache layer


def _llama_forward(config: ModelConfig, store: WeightStore, context_length: int) -> llama.LlamaForward:
    return llama.LlamaForward(config, llama.load_weights(store, config), store, context_length)


FAMILIES: dict[str, Family] = {
    "llama": Family(llama.build_config, _llama_forward, llama.cache_specs),
    "qwen3": Family(llama.build_config, _llama_forward, llama.cache_specs),
    "qwen3moe": Family(qwen3moe.build_config, qwen3moe.build_forward, qwen3moe.cache_specs),
    "qwen2": Family(llama.build_config, _llama_forward, llama.cache_specs),
    "granite": Family(llama.build_config, _llama_forward, llama.cache_specs),
    "smollm3": Family(llama.build_config, _llama_forward, llama.cache_specs),
    "mistral3": Family(llama.build_config, _llama_forward, llama.cache_specs),
    "olmo2": Family(olmo2.build_config, olmo2.build_forward, olmo2.cache_specs),
    "gemma3": Family(gemma3.build_config, gemma3.build_forward, gemma3.cache_specs),
    "gemma4": Family(gemma4.build_config, gemma4.build_forward, gemma4.cache_specs),
    "gemma2": Family(gemma2.build_config, gemma2.build_forward, gemma2.cache_specs),
    "phi3": Family(phi3.build_config, phi3.build_forward, phi3.cache_specs),
    "gpt-oss": Family(gptoss.build_config, gptoss.build_forward, gptoss.cache_specs),
}


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """Build the config of a supported architecture, or say which ones are supported."""
    family = FAMILIES.get(gguf.architecture)
    if family is None:
        supported = ", ".join(sorted(FAMILIES))
        raise UnsupportedArchitectureError(
            f"{gguf.path}: architecture '{gguf.architecture}' is not supported (supported: {supported})"
        )
    return family.build_config(gguf)
