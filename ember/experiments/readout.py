"""`Readout` (contract v0.2): the model's own output side, offered read-only to experiments.

`ctx.model.readout` (any context's `ModelContext`) maps residual-stream rows through the model's final
norm and its LM head, with the family's post-processing (Gemma's final softcap), exactly as the end of an
evaluation does: a logit lens. It reads weights and writes only into the array it returns; nothing of
the engine's state (activations, KV cache, workspace) changes. Weights themselves stay unreachable.

The rows are evaluated as the engine evaluates a prefill's logits (every row but the last as one
batch, the last row alone), so the rows of the last layer's output give the model's own logits bit for
bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np


class Readout:
    """Final norm + unembedding of the loaded model, as a function of hidden rows."""

    __slots__ = ("_project", "_piece", "vocab_size", "hidden_size")

    def __init__(self, project: Callable[[np.ndarray, np.ndarray], np.ndarray], vocab_size: int,
                 hidden_size: int, piece: Callable[[int], str]) -> None:
        self._project = project
        self._piece = piece
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """Logits `[N, vocab]` (a new float32 array) of hidden rows `[N, hidden]` (or one row `[hidden]`)."""
        rows = np.array(rows, dtype=np.float32, order="C", copy=True, ndmin=2)
        if rows.ndim != 2 or rows.shape[1] != self.hidden_size or rows.shape[0] == 0:
            raise ValueError(f"readout needs rows of width {self.hidden_size}, got shape {rows.shape}")
        out = np.empty((rows.shape[0], self.vocab_size), np.float32)
        return self._project(rows, out)

    def log_probs(self, rows: np.ndarray) -> np.ndarray:
        """Log-softmax of `logits(rows)` over the vocabulary, float64 `[N, vocab]`."""
        return log_softmax(self.logits(rows))

    def token_text(self, ids: Iterable[int]) -> list[str]:
        """Each token's own text (its vocabulary piece, special tokens shown)."""
        return [self._piece(int(i)) for i in ids]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
