"""The end of every family's evaluation: final norm, LM head, and their two hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ember.ops import rms_norm


def final_norm_and_logits(hidden: np.ndarray, output_norm: np.ndarray, eps: float, ws: Any, hooks: Any,
                          lm_head: Callable[[np.ndarray, np.ndarray], np.ndarray], vocab_size: int,
                          all_logits: bool) -> np.ndarray:
    """z = RMSNorm(h[last]) → before_logits; logits = lm_head(z) → after_logits.

    Returns the last row's logits ([1, V], a workspace view), or with all_logits those of every row
    ([T, V], new). `ws` provides normed/row_scratch (T rows), final_normed/final_row_scratch and logits
    (one row); `lm_head(normed, out)` is the family's head including its post-processing (softcap).
    """
    rows = hidden.shape[0]
    if all_logits:
        normed = rms_norm(hidden, output_norm, eps, ws.normed, ws.row_scratch)
        last_normed = normed[rows - 1:]
    else:
        last_normed = rms_norm(hidden[rows - 1:], output_norm, eps, ws.final_normed, ws.final_row_scratch)
    hooks.before_logits(last_normed)
    logits = lm_head(last_normed, ws.logits)
    hooks.after_logits(logits)
    if not all_logits:
        return logits
    every = np.empty((rows, vocab_size), np.float32)
    if rows > 1:
        lm_head(normed[:rows - 1], every[:rows - 1])
    every[rows - 1] = logits[0]
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
