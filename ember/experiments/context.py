"""Contexts, small enums and TensorAccess of the experiment hook contract.

Contexts are light immutable values: they show an experiment where it is (which model, which phase,
which positions, which layer) and nothing else. No token buffers, weights, caches or full GGUF
metadata are reachable from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from ember.experiments.failure import ExperimentError
from ember.phases import ExecutionPhase, ModelFamily  # the engine's, shared (ember.phases)


class TracingState(Enum):
    DISABLED = "disabled"
    ENABLED = "enabled"


class TensorDType(Enum):
    F32 = "f32"


@dataclass(frozen=True, slots=True)
class ModelContext:
    """What an experiment may know about the loaded model."""

    family: ModelFamily
    model_id: str | None
    architecture: str
    layer_count: int
    hidden_size: int
    # v0.2: the model's final norm and unembedding as a read-only function (ember.experiments.readout);
    # None where the engine offers none (a context built by hand).
    readout: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def from_config(cls, config: Any, model_id: str | None = None, readout: Any = None) -> ModelContext:
        """Build from a `ModelConfig` (anything with family, architecture, layer_count, hidden_size)."""
        return cls(
            family=ModelFamily(config.family),
            model_id=model_id,
            architecture=str(config.architecture),
            layer_count=int(config.layer_count),
            hidden_size=int(config.hidden_size),
            readout=readout,
        )


@dataclass(frozen=True, slots=True)
class ExecutionContext:
    """One evaluation of the model: a prefill over the prompt, or one decode step."""

    model: ModelContext
    phase: ExecutionPhase
    start_position: int
    input_token_count: int
    tracing: TracingState

    @property
    def sequence_length(self) -> int:
        """Length of the sequence once this evaluation's tokens are in: start_position + input_token_count."""
        return self.start_position + self.input_token_count

    def token_position(self) -> int | None:
        """The absolute position of the token, only when the evaluation holds exactly one token."""
        return self.start_position if self.input_token_count == 1 else None


@dataclass(frozen=True, slots=True)
class LayerContext:
    """An evaluation plus the 0-based index of the layer whose boundary is being hooked."""

    execution: ExecutionContext
    layer_index: int


@dataclass(frozen=True, slots=True)
class GenerationContext:
    """Reported once, when a generation completed successfully."""

    model: ModelContext
    prompt_token_count: int
    generated_token_count: int
    decode_evaluation_count: int
    tracing: TracingState


_EXPIRED = (
    "this TensorAccess was used after its hook returned; the activation belongs to the engine and is "
    "reused, so copy what you need inside the hook (e.g. tensor.values().copy())"
)


class TensorAccess:
    """A narrow view of one activation the engine owns: 2-D, C-contiguous float32 `[rows, columns]`.

    `values()` is read-only (writing through it raises ValueError), `values_mut()` writes into the
    engine's own memory and `zero()` clears it. No copy is ever made. The access works only while its
    hook runs; afterwards every method raises `ExperimentError`. Arrays obtained from `values()` or
    `values_mut()` are views of the engine's buffers and must not be kept either: copy them.
    """

    __slots__ = ("_array", "_live")

    def __init__(self, array: np.ndarray) -> None:
        if array.dtype != np.float32 or array.ndim != 2 or not array.flags.c_contiguous:
            raise TypeError(
                "TensorAccess needs a C-contiguous 2-D float32 array, got "
                f"dtype={array.dtype}, shape={array.shape}, c_contiguous={array.flags.c_contiguous}"
            )
        self._array = array
        self._live = True

    def _checked(self) -> np.ndarray:
        if not self._live:
            raise ExperimentError(_EXPIRED)
        return self._array

    def release(self) -> None:
        """End the access (the runner calls this when the hook returns)."""
        self._live = False

    @property
    def shape(self) -> tuple[int, int]:
        return self._checked().shape  # type: ignore[return-value]

    @property
    def dtype(self) -> TensorDType:
        self._checked()
        return TensorDType.F32

    def values(self) -> np.ndarray:
        """A read-only view of the activation (observation); it cannot be made writeable again."""
        return np.asarray(memoryview(self._checked()).toreadonly())

    def values_mut(self) -> np.ndarray:
        """A writable view of the same memory (intervention): writes change everything downstream."""
        return self._checked().view()

    def zero(self) -> None:
        """Replace every value with 0.0 in place."""
        self._checked().fill(0.0)

    def __repr__(self) -> str:
        if not self._live:
            return "TensorAccess(<expired>)"
        rows, columns = self._array.shape
        return f"TensorAccess(shape=({rows}, {columns}), dtype=f32)"
