"""`Readout` (contract v0.2): the model's own output side, offered read-only to experiments.

`ctx.model.readout` (any context's `ModelContext`) maps residual-stream rows through the model's final
norm and its LM head, with the family's post-processing (Gemma's final softcap), exactly as the end of an
evaluation does: a logit lens. It reads weights and writes only into the array it returns; nothing of
the engine's state (activations, KV cache, workspace) changes. Weights themselves stay unreachable.

The rows are evaluated as the engine evaluates a prefill's logits (every row but the last as one
batch, the last row alone), so the rows of the last layer's output give the model's own logits bit for
bit.

Attribution (issue 27), read-only too:

* `head_contributions(layer, heads)`: each head's contribution to the residual, from a layer's
  `attention_heads` rows: head h's columns alone through the output projection (its slice of Wo's
  columns). On llama/qwen3 they add up to `after_attention` (the projection's output). Gemma 3 and 4 norm
  the projection's output o before the residual add (post-attention RMSNorm, not linear): there a head's
  contribution is o_h ⊙ w / rms(o), its share at the scale of the whole output of the same row, so that
  the heads add up to `after_attention` there too. That scale depends on every head: changing one head
  changes the others' contributions, and a head's contribution is not what the layer would add with
  that head alone.
* `logit_difference(v, answer, foil, scale)`: direct logit attribution, (U[answer] − U[foil]) ·
  (w ⊙ v / scale) for residual-shaped rows v, with U the LM head, w the final norm's weight as the engine
  multiplies by it (Gemma's files store 1 + w already) and a fixed `scale`, normally `final_scale` of the
  clean run's last residual row. The final norm divides by the residual's own RMS, so the exact logits
  are not linear in the residual; at the fixed scale they are, and the attributions of the parts of a
  residual add up to the attribution of the residual, which with its own scale is its logit difference
  exactly (up to float rounding). Gemma 4 (and Gemma 3 files with a final softcap) then caps the logits:
  c·tanh(l/c) is not linear either, so attribution stops before the softcap (compare with pre-softcap
  logit differences, c·atanh(l/c)).
* `carried(layer)`: what a vector added to the residual in layer `layer` is multiplied by before the
  final norm (Gemma 4's per-layer output scales, from that layer on; 1 elsewhere): attribute
  `carried(layer) · v`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


class Readout:
    """Final norm + unembedding of the loaded model, as a function of hidden rows."""

    __slots__ = ("_project", "_piece", "_heads", "_difference", "_carried", "vocab_size", "hidden_size",
                 "layer_count", "head_count", "eps")

    def __init__(self, project: Callable[[np.ndarray, np.ndarray], np.ndarray], vocab_size: int,
                 hidden_size: int, piece: Callable[[int], str], *,
                 heads: Callable[[int, np.ndarray], np.ndarray] | None = None,
                 difference: Callable[[np.ndarray, int, int, Any], np.ndarray] | None = None,
                 carried: Callable[[int], float] | None = None,
                 layer_count: int = 0, head_count: int = 0, eps: float = 0.0) -> None:
        self._project = project
        self._piece = piece
        self._heads = heads
        self._difference = difference
        self._carried = carried
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.layer_count = int(layer_count)
        self.head_count = int(head_count)
        self.eps = float(eps)  # the final norm's

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """Logits `[N, vocab]` (a new float32 array) of hidden rows `[N, hidden]` (or one row `[hidden]`)."""
        rows = self._rows(rows)
        out = np.empty((rows.shape[0], self.vocab_size), np.float32)
        return self._project(rows, out)

    def log_probs(self, rows: np.ndarray) -> np.ndarray:
        """Log-softmax of `logits(rows)` over the vocabulary, float64 `[N, vocab]`."""
        return log_softmax(self.logits(rows))

    def head_contributions(self, layer: int, heads: np.ndarray) -> np.ndarray:
        """Each head's contribution to layer `layer`'s `after_attention`, float32 `[head_count, N, hidden]`
        (a new array), from that layer's `attention_heads` rows `[N, head_count × head_dim]` (module
        docstring: what it means where a norm follows the output projection)."""
        if self._heads is None:
            raise ValueError("this engine offers no head contributions")
        if not 0 <= layer < self.layer_count:
            raise ValueError(f"layer {layer} is outside the model: valid layers are "
                             f"0..{self.layer_count - 1}")
        heads = np.array(heads, dtype=np.float32, order="C", copy=True, ndmin=2)
        if heads.ndim != 2 or heads.shape[0] == 0 or heads.shape[1] % self.head_count:
            raise ValueError(f"head contributions need attention_heads rows "
                             f"[N, {self.head_count} × head_dim], got shape {heads.shape}")
        return self._heads(layer, heads)

    def final_scale(self, rows: np.ndarray) -> np.ndarray:
        """The final norm's scale of residual rows `[N, hidden]`: √(mean(h²) + eps), float64 `[N]`."""
        rows = self._rows(rows)
        return np.sqrt(np.mean(rows.astype(np.float64) ** 2, axis=-1) + self.eps)

    def logit_difference(self, vectors: np.ndarray, answer: int, foil: int,
                         scale: float | np.ndarray) -> np.ndarray:
        """Direct logit attribution of residual-shaped rows `[N, hidden]` to logit(answer) − logit(foil)
        at the fixed final-norm scale `scale` (a number, or one per row), float64 `[N]`."""
        if self._difference is None:
            raise ValueError("this engine offers no logit attribution")
        bad = [t for t in (answer, foil) if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad} are outside the vocabulary (0..{self.vocab_size - 1})")
        scale = np.asarray(scale, dtype=np.float64)
        if not np.all(scale > 0):
            raise ValueError(f"the norm scale must be positive, got {scale}")
        return self._difference(self._rows(vectors), int(answer), int(foil), scale)

    def carried(self, layer: int) -> float:
        """The factor a vector added to the residual in layer `layer` is multiplied by before the final
        norm (Gemma 4's layer output scales; 1.0 for the other families)."""
        return 1.0 if self._carried is None else float(self._carried(layer))

    def _rows(self, rows: np.ndarray) -> np.ndarray:
        rows = np.array(rows, dtype=np.float32, order="C", copy=True, ndmin=2)
        if rows.ndim != 2 or rows.shape[1] != self.hidden_size or rows.shape[0] == 0:
            raise ValueError(f"readout needs rows of width {self.hidden_size}, got shape {rows.shape}")
        return rows

    def token_text(self, ids: Iterable[int]) -> list[str]:
        """Each token's own text (its vocabulary piece, special tokens shown)."""
        return [self._piece(int(i)) for i in ids]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis: logits minus `log_normalizer`."""
    return np.asarray(logits, dtype=np.float64) - log_normalizer(logits)[..., None]


def log_normalizer(logits: np.ndarray) -> np.ndarray:
    """log Σ exp(logits) over the last axis, float64 (shape without it): `log_softmax` is logits minus it,
    for a reader of a few log-probabilities that need not form them all."""
    shifted = np.array(logits, dtype=np.float64)  # a copy, worked on in place
    top = shifted.max(axis=-1, keepdims=True)
    shifted -= top
    return top[..., 0] + np.log(np.exp(shifted, out=shifted).sum(axis=-1))
