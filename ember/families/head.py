"""The end of every family's evaluation: final norm, LM head, and their two hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ember.families.inside import head_contributions
from ember.ops import gather_rows, rms_norm


def final_norm_and_logits(hidden: np.ndarray, output_norm: np.ndarray, eps: float, rows: Any, hooks: Any,
                          lm_head: Callable[[np.ndarray, np.ndarray], np.ndarray], vocab_size: int,
                          all_logits: bool) -> np.ndarray:
    """z = RMSNorm(h[last]) → before_logits; logits = lm_head(z) → after_logits.

    `rows` (`ember.rows`): one sequence, whose last row's logits are returned ([1, V], a workspace
    view), or a batch, each of whose sequences' last row's logits are ([sequences, V], new, in stack
    order). With all_logits, those of every row ([rows, V], new), the hooked ones included.
    A batch whose caller reads only some logits (`rows.columns`, set only where no hook listens at
    after_logits) gets those vocabulary entries' alone ([sequences, len(columns)]) and no after_logits.
    `lm_head(normed, out, columns=None)` is the family's head including its post-processing (softcap).
    """
    count = hidden.shape[0]
    ws = rows.ws
    last = rows.last_rows()
    if last is None:  # one sequence: its last row, in the workspace's one-row buffers
        last_normed = rms_norm(hidden[count - 1:], output_norm, eps, ws.final_normed, ws.final_row_scratch)
        out = ws.logits
    else:
        normed = np.empty((len(last), hidden.shape[1]), np.float32)
        last_normed = rms_norm(hidden[last], output_norm, eps, normed, np.empty((len(last), 1), np.float32))
        out = np.empty((len(last), vocab_size), np.float32)
    hooks.before_logits(last_normed)
    if rows.columns is not None and not all_logits:
        return lm_head(last_normed, np.empty((len(last), len(rows.columns)), np.float32), rows.columns)
    logits = lm_head(last_normed, out)
    hooks.after_logits(logits)
    if not all_logits:
        return logits
    normed = rms_norm(hidden, output_norm, eps, ws.normed, ws.row_scratch)
    every = np.empty((count, vocab_size), np.float32)
    if last is None:  # all rows but the last as one product, as `readout_logits` splits them
        if count > 1:
            lm_head(normed[:count - 1], every[:count - 1])
        every[count - 1] = logits[0]
    else:
        lm_head(normed, every)
        every[last] = logits
    return every


def readout_logits(hidden: np.ndarray, output_norm: np.ndarray, eps: float,
                   lm_head: Callable[[np.ndarray, np.ndarray], np.ndarray], out: np.ndarray) -> np.ndarray:
    """The same final norm and LM head over any rows [N, H] into `out` [N, V] (a logit lens; contract
    v0.2 `Readout`). Reads weights only; the rows are split as `final_norm_and_logits(all_logits=True)`
    splits them (all but the last as one batch, the last alone), so the last layer's output rows give
    the evaluation's own logits exactly."""
    rows = hidden.shape[0]
    normed = rms_norm(hidden, output_norm, eps, np.empty_like(hidden), np.empty((rows, 1), np.float32))
    if rows > 1:
        lm_head(normed[:rows - 1], out[:rows - 1])
    lm_head(normed[rows - 1:], out[rows - 1:])
    return out


def logit_difference(vectors: np.ndarray, output_norm: np.ndarray, output: Any, answer: int, foil: int,
                     scale: float | np.ndarray) -> np.ndarray:
    """Direct logit attribution of residual-shaped rows v [N, H] at a fixed norm scale s:
    (U[answer] − U[foil]) · (output_norm ⊙ v / s), float64 [N]. `output` is the LM head's matrix U [V, H]
    (only its two rows are decoded). Linear in v: the rows of a decomposition of the residual add up to
    the decomposition of its logit difference; for the residual itself with its own scale (√(mean(h²) +
    eps), what the norm divides by) it is the logit difference before any softcap."""
    rows = np.empty((2, len(output_norm)), np.float32)
    gather_rows(output, np.array([answer, foil], np.int64), rows)
    direction = (rows[0].astype(np.float64) - rows[1]) * output_norm
    return np.asarray(vectors, dtype=np.float64) @ direction / scale


class Readouts:
    """A forward pass's read-only readouts (contract v0.2 and the attribution readouts), written once for
    every family: the final norm and LM head over any rows, each head's contribution to a layer's
    `after_attention`, and direct logit attribution at a fixed final-norm scale. The forward pass has
    `config` (head_count, rms_norm_eps), `weights` (output_norm, output, layers[i].attn_output and, where
    the family norms the attention output before the residual add, layers[i].post_attention_norm) and
    `lm_head(normed, out)`."""

    def readout(self, hidden_rows: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Final norm + LM head (with the family's post-processing) over any residual rows."""
        return readout_logits(hidden_rows, self.weights.output_norm, self.config.rms_norm_eps, self.lm_head,
                              out)

    def head_contributions(self, layer: int, heads: np.ndarray) -> np.ndarray:
        """Each head's share of layer `layer`'s `after_attention` [heads, T, H] from its `attention_heads`
        rows: its slice through Wo, then (Gemma, OLMo 2) the post-attention norm at the scale of the whole
        output (`ember.families.inside.head_contributions`)."""
        weights = self.weights.layers[layer]
        return head_contributions(heads, self.config.head_count, weights.attn_output,
                                  getattr(weights, "post_attention_norm", None), self.config.rms_norm_eps)

    def logit_difference(self, vectors: np.ndarray, answer: int, foil: int, scale: float | np.ndarray
                         ) -> np.ndarray:
        """Direct logit attribution of residual rows at a fixed final-norm scale (`logit_difference`)."""
        return logit_difference(vectors, self.weights.output_norm, self.weights.output, answer, foil, scale)
