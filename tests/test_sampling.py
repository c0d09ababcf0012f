import numpy as np
import pytest

from ember.errors import ConfigError
from ember.sampling import Sampler, SamplingSettings

LOGITS = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05], dtype=np.float32))


def draw(settings: SamplingSettings, n: int = 4000) -> np.ndarray:
    sampler = Sampler(settings)
    return np.bincount([sampler(LOGITS) for _ in range(n)], minlength=len(LOGITS)) / n


def test_greedy_takes_the_argmax():
    assert Sampler(SamplingSettings())(np.array([0.1, 3.0, 2.9])) == 1


def test_same_seed_same_tokens_and_other_seed_differs():
    settings = SamplingSettings(temperature=1.0, seed=7)
    first = [Sampler(settings)(LOGITS) for _ in range(1)]
    a = Sampler(settings)
    b = Sampler(settings)
    c = Sampler(SamplingSettings(temperature=1.0, seed=8))
    seq_a = [a(LOGITS) for _ in range(50)]
    assert seq_a == [b(LOGITS) for _ in range(50)]
    assert seq_a != [c(LOGITS) for _ in range(50)]
    assert first[0] == seq_a[0]


def test_temperature_one_follows_the_distribution():
    frequencies = draw(SamplingSettings(temperature=1.0, seed=1))
    np.testing.assert_allclose(frequencies, [0.5, 0.2, 0.15, 0.1, 0.05], atol=0.03)


def test_top_k_keeps_only_the_k_best():
    frequencies = draw(SamplingSettings(temperature=1.0, top_k=2, seed=2))
    assert frequencies[2:].sum() == 0
    np.testing.assert_allclose(frequencies[:2], [0.5 / 0.7, 0.2 / 0.7], atol=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # cumulative 0.5, 0.7, 0.85: p=0.7 keeps the first two tokens, p=0.71 the first three
    assert draw(SamplingSettings(temperature=1.0, top_p=0.7, seed=3))[2:].sum() == 0
    assert draw(SamplingSettings(temperature=1.0, top_p=0.71, seed=3))[2] > 0


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    frequencies = draw(SamplingSettings(temperature=1.0, min_p=0.25, seed=4))  # keeps p ≥ 0.125
    assert frequencies[3:].sum() == 0 and frequencies[2] > 0


def test_low_temperature_sharpens():
    frequencies = draw(SamplingSettings(temperature=0.1, seed=5), n=500)
    assert frequencies[0] > 0.99


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_k": -1}, {"top_p": 0}, {"top_p": 1.5},
                                    {"min_p": 1.0}])
def test_impossible_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        SamplingSettings(**kwargs)
