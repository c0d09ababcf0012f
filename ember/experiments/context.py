"""Contexts, small enums and TensorAccess of the experiment hook contract."""

from __future__ import annotations

from enum import Enum


class ModelFamily(Enum):
    LLAMA = "llama"
    QWEN3 = "qwen3"
    GEMMA4 = "gemma4"


class ExecutionPhase(Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class TracingState(Enum):
    DISABLED = "disabled"
    ENABLED = "enabled"


class TensorDType(Enum):
    F32 = "f32"
