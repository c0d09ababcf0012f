"""Loaded models of this process, kept between the jobs it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ember.cores import ThreadChoice, announce

# Loaded models of this process, by (resolved file, context length, weight mode): the jobs of a sweep
# run by the basic launcher (or by one joblib worker) load each model once.
_MODELS: dict[tuple[str, int | None, str], Any] = {}


def cached_model(model_file: Any, context_length: int | None, choice: ThreadChoice,
                 weights: str = "quantized") -> tuple[Any, bool]:
    """(model, cache hit). The engine's own thread count follows this job's (`choice`)."""
    from ember.model import load_model

    threads = choice.threads
    key = (str(Path(model_file.path).resolve()), context_length, weights)
    model = _MODELS.get(key)
    announce(choice)
    if model is not None:
        model.threads, model.threads_reason = threads, choice.reason
        return model, True
    from ember.progress import Progress

    with Progress.status(f"loading {Path(model_file.path).name}"):
        model = load_model(model_file, context_length=context_length, threads=threads, weights=weights)
    model.threads_reason = choice.reason
    _MODELS[key] = model
    return model, False


def cached(model_file: Any, context_length: int | None, weights: str = "quantized") -> Any:
    """The model already loaded for this file, context length and weight mode, or None."""
    return _MODELS.get((str(Path(model_file.path).resolve()), context_length, weights))


def clear() -> None:
    """Forget every loaded model (tests; memory)."""
    _MODELS.clear()
