"""Choosing the next token from logits: greedy, or temperature with top-k, top-p and min-p filters.

The filters apply in llama.cpp's default order (top-k, top-p, min-p, then temperature); a seeded
NumPy generator makes the same settings give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ember.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ConfigError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be ≥ 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    def __init__(self, settings: SamplingSettings) -> None:
        self.settings = settings
        self.rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray) -> int:
        """Pick a token id from one row of logits [V]."""
        s = self.settings
        if s.greedy:
            return int(np.argmax(logits))
        candidates = np.arange(logits.shape[0])
        scores = logits.astype(np.float64)
        if s.top_k and s.top_k < scores.shape[0]:
            keep = np.argpartition(scores, -s.top_k)[-s.top_k:]
            candidates, scores = candidates[keep], scores[keep]
        order = np.argsort(-scores, kind="stable")
        candidates, scores = candidates[order], scores[order]
        probabilities = _softmax(scores)
        if s.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            cut = int(np.searchsorted(np.cumsum(probabilities), s.top_p)) + 1
            candidates, scores, probabilities = candidates[:cut], scores[:cut], probabilities[:cut]
        if s.min_p > 0.0:
            keep = probabilities >= s.min_p * probabilities[0]
            candidates, scores = candidates[keep], scores[keep]
        probabilities = _softmax(scores / s.temperature)
        return int(candidates[self.rng.choice(len(candidates), p=probabilities)])


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()
