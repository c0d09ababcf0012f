"""Aggregates over items: mean, standard error and the 95% percentile bootstrap interval."""

from __future__ import annotations

import math

import numpy as np

from ember.studies.aggregate import aggregate_columns, aggregate_matrix


def test_mean_and_standard_error_are_the_textbook_ones():
    values = [0.2, 0.4, 0.9, 0.1, 0.5]
    agg = aggregate_columns({("x", 0): values})[("x", 0)]
    assert agg.n == 5
    assert math.isclose(agg.mean, np.mean(values))
    assert math.isclose(agg.se, np.std(values, ddof=1) / math.sqrt(5))


def test_bootstrap_interval_is_seeded_and_shrinks_with_more_items():
    rng = np.random.default_rng(0)
    small = rng.normal(1.0, 1.0, size=20)
    large = rng.normal(1.0, 1.0, size=400)
    a = aggregate_columns({("x", 0): small})[("x", 0)]
    b = aggregate_columns({("x", 0): small})[("x", 0)]
    c = aggregate_columns({("x", 0): large})[("x", 0)]
    assert (a.ci_low, a.ci_high) == (b.ci_low, b.ci_high)
    assert a.ci_low < a.mean < a.ci_high
    assert (c.ci_high - c.ci_low) < (a.ci_high - a.ci_low)
    # the percentile interval of the mean is close to mean ± 1.96 se for a normal sample
    assert abs((c.ci_high - c.ci_low) - 2 * 1.96 * c.se) < 0.2 * (c.ci_high - c.ci_low)


def test_bootstrap_coverage_on_many_samples():
    """Over 200 samples of 30 from N(0, 1), the 95% interval holds the true mean about 95% of the time."""
    rng = np.random.default_rng(3)
    samples = rng.normal(0.0, 1.0, size=(30, 200))
    aggregates = aggregate_matrix(samples, resamples=1000)
    covered = sum(a.ci_low <= 0.0 <= a.ci_high for a in aggregates) / len(aggregates)
    assert 0.88 <= covered <= 0.99


def test_missing_values_and_single_item():
    aggs = aggregate_columns({("x", 0): [1.0, math.nan, 3.0], ("y", 2): [math.nan, math.nan, 5.0]})
    assert aggs[("x", 0)].n == 2 and aggs[("x", 0)].mean == 2.0
    single = aggs[("y", 2)]
    assert single.n == 1 and single.mean == 5.0 and single.se == 0.0
    assert single.ci_low == single.ci_high == 5.0
