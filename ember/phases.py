"""The engine's two words the hook contract shares with it: which family a model is, which phase an
evaluation is in.

They live below both: the engine (`ember.config`, `ember.families`, `ember.tracing`) names them without
importing `ember.experiments`, and the contract re-exports them (`ember.experiments.ModelFamily` and
`ExecutionPhase` are these same classes).
"""

from __future__ import annotations

from enum import Enum


class ModelFamily(Enum):
    LLAMA = "llama"
    QWEN3 = "qwen3"
    GEMMA3 = "gemma3"
    GEMMA4 = "gemma4"
    QWEN3MOE = "qwen3moe"  # Qwen3 attention, mixture-of-experts MLP
    QWEN2 = "qwen2"
    OLMO2 = "olmo2"
    GRANITE = "granite"
    SMOLLM3 = "smollm3"
    GEMMA2 = "gemma2"
    PHI3 = "phi3"
    MISTRAL3 = "mistral3"  # Ministral 3: YaRN and the attention temperature by position
    GPT_OSS = "gpt-oss"  # mixture of experts with attention sinks


class ExecutionPhase(Enum):
    PREFILL = "prefill"
    DECODE = "decode"
