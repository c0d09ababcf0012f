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
    # a mixture of experts (the `router` stage): how many experts each layer has, how many a token takes
    expert_count: int = 0
    experts_per_token: int = 0
    # Query heads per layer (each layer's `attention_heads` has head h in columns h·head_dim…, head_dim =
    # its width / head_count); 0 where unknown (a context built by hand).
    head_count: int = 0

    @classmethod
    def from_config(cls, config: Any, model_id: str | None = None, readout: Any = None) -> ModelContext:
        """Build from a `ModelConfig` (anything with family, architecture, layer_count, hidden_size, and
        optionally head_count)."""
        return cls(
            family=ModelFamily(config.family),
            model_id=model_id,
            architecture=str(config.architecture),
            layer_count=int(config.layer_count),
            hidden_size=int(config.hidden_size),
            readout=readout,
            expert_count=int(getattr(config, "expert_count", 0)),
            experts_per_token=int(getattr(config, "expert_used_count", 0)),
            head_count=int(getattr(config, "head_count", 0)),
        )


@dataclass(frozen=True, slots=True)
class SequenceSpan:
    """Contract v0.3: one sequence of a batched evaluation, as a tensor hook sees it.

    `index`: the sequence's place in the batch as it was asked for; `rows`: its rows in the tensor
    (layer stages: one per evaluated position; model stages: its one last row); `start_position`: the
    position of its first row (positions before it were read from a saved evaluation); `first_layer`:
    the first layer evaluated for it (the layers before are the saved evaluation's); `tag`: the label the
    experiment gave the sequence when it asked for it."""

    index: int
    rows: slice
    start_position: int
    first_layer: int = 0
    tag: Any = None

    def position_row(self, position: int) -> int | None:
        """The tensor row holding absolute position `position`, or None where it is not evaluated."""
        row = self.rows.start + position - self.start_position
        return row if self.rows.start <= row < self.rows.stop and position >= self.start_position else None


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Contract v0.3: how a batched evaluation's sequences are stacked (plain numbers, no engine state).

    Sequences are stacked in order of their first layer, so that a layer stage's tensor holds the rows of
    the sequences evaluated from that layer on, from row 0: `spans(layer)` lists them."""

    indices: tuple[int, ...]        # the caller's index of each stacked sequence
    offsets: tuple[int, ...]        # first row of each stacked sequence, and the total
    starts: tuple[int, ...]
    first_layers: tuple[int, ...]
    tags: tuple[Any, ...]
    _spans: dict[Any, tuple[SequenceSpan, ...]] = field(default_factory=dict, compare=False, repr=False)

    def spans(self, layer: int | None) -> tuple[SequenceSpan, ...]:
        """The sequences in a stage's tensor: at layer `layer` (None: the model stages, one row each)."""
        known = self._spans.get(layer)
        if known is not None:
            return known
        if layer is None:
            result = tuple(SequenceSpan(index, slice(k, k + 1),
                                        self.starts[k] + self.offsets[k + 1] - self.offsets[k] - 1,
                                        self.first_layers[k], self.tags[k])
                           for k, index in enumerate(self.indices))
        else:
            # A sequence's rows are the same at every layer it is evaluated at: its span is made once and
            # each layer keeps those that have reached it (making them per layer took 4% of residual
            # patching's time, SmolLM2, 18 pairs, Zen 3 EPYC).
            every = self._spans.get("every")
            if every is None:
                every = self._spans["every"] = tuple(
                    SequenceSpan(index, slice(self.offsets[k], self.offsets[k + 1]), self.starts[k],
                                 self.first_layers[k], self.tags[k]) for k, index in enumerate(self.indices))
            result = tuple(span for span in every if span.first_layer <= layer)
        self._spans[layer] = result
        return result


@dataclass(frozen=True, slots=True)
class ExecutionContext:
    """One evaluation of the model: a prefill over the prompt, or one decode step, or (contract v0.3,
    experiments with `batched = True`) a batch of sequences evaluated together, `batch` saying which
    rows are which (then `start_position` is 0 and `input_token_count` counts every row)."""

    model: ModelContext
    phase: ExecutionPhase
    start_position: int
    input_token_count: int
    tracing: TracingState
    batch: BatchLayout | None = None

    @property
    def spans(self) -> tuple[SequenceSpan, ...]:
        """The sequences of this evaluation and their rows at a model stage (one row each): one span for
        a single sequence, so batch-aware code reads every evaluation alike (contract v0.3)."""
        return self.spans_at(None)

    def spans_at(self, layer: int | None) -> tuple[SequenceSpan, ...]:
        """The sequences and their rows at layer `layer`'s stages (None: the model stages)."""
        if self.batch is not None:
            return self.batch.spans(layer)
        if layer is None:
            return (SequenceSpan(0, slice(0, 1), self.start_position + self.input_token_count - 1),)
        return (SequenceSpan(0, slice(0, self.input_token_count), self.start_position),)

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

    @property
    def spans(self) -> tuple[SequenceSpan, ...]:
        """The sequences whose rows this layer's tensor holds (contract v0.3; one for a single sequence)."""
        return self.execution.spans_at(self.layer_index)


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
