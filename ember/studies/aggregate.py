"""Per-item values to aggregates: mean, standard error and a 95% percentile bootstrap interval.

Items are the unit of resampling: one bootstrap draw picks n items with replacement and every column
(each metric at each step) is averaged over the same draw. A value an item does not have is NaN and
left out of that column's mean. The draws are seeded, so a rerun gives the same interval.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
LEVEL = 0.95
# Bootstrap means are formed in chunks of columns so that the [draws, columns] means stay near this many
# values (64 MB of float64).
_CHUNK_VALUES = 8_000_000


@dataclass(frozen=True, slots=True)
class Aggregate:
    n: int           # items that have a value
    mean: float
    se: float        # standard error of the mean (sample std / sqrt(n)); 0 with one item
    ci_low: float    # 95% percentile bootstrap interval of the mean
    ci_high: float

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "mean": self.mean, "se": self.se, "ci_low": self.ci_low, "ci_high": self.ci_high}


def aggregate_columns(columns: Mapping[tuple[str, int], Sequence[float]], *, resamples: int = RESAMPLES,
                      level: float = LEVEL, seed: int = 0) -> dict[tuple[str, int], Aggregate]:
    """{(name, step): per-item values (NaN = missing)} -> {(name, step): Aggregate}.

    Every sequence has one value per item, in the same item order."""
    keys = list(columns)
    if not keys:
        return {}
    values = np.array([np.asarray(columns[k], dtype=np.float64) for k in keys]).T  # [items, columns]
    return dict(zip(keys, aggregate_matrix(values, resamples=resamples, level=level, seed=seed), strict=True))


def aggregate_matrix(values: np.ndarray, *, resamples: int = RESAMPLES, level: float = LEVEL,
                     seed: int = 0) -> list[Aggregate]:
    """Aggregates of each column of `values` [items, columns] (NaN = missing)."""
    items, width = values.shape
    present = ~np.isnan(values)
    counts = present.sum(axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns and draws: NaN, said below
        means = np.nanmean(values, axis=0)
        stds = np.nanstd(values, axis=0, ddof=1) if items > 1 else np.zeros(width)
        low = np.full(width, np.nan)
        high = np.full(width, np.nan)
        if items > 0:
            draws = np.random.default_rng(seed).integers(0, items, size=(resamples, items))
            # A draw's mean of a column is (times each item was drawn) . (its values) / (draws with a
            # value): one matrix product for all draws and columns instead of gathering a
            # [draws, items, columns] array (2000 x 24 x 130: 50 ms against 0.4 s, 2-core machine).
            times = np.bincount((np.arange(resamples)[:, None] * items + draws).ravel(),
                                minlength=resamples * items).reshape(resamples, items).astype(np.float64)
            filled = np.where(present, values, 0.0)
            chunk = max(1, _CHUNK_VALUES // max(1, resamples))
            tails = [(1.0 - level) / 2.0, 1.0 - (1.0 - level) / 2.0]
            for start in range(0, width, chunk):
                part = slice(start, start + chunk)
                resampled = (times @ filled[:, part]) / (times @ present[:, part])  # [resamples, columns]
                quantile = np.nanquantile if np.isnan(resampled).any() else np.quantile
                low[part], high[part] = quantile(resampled, tails, axis=0)
    out = []
    for j in range(width):
        n = int(counts[j])
        se = float(stds[j] / math.sqrt(n)) if n > 1 and np.isfinite(stds[j]) else 0.0
        out.append(Aggregate(n, float(means[j]), se, float(low[j]), float(high[j])))
    return out
