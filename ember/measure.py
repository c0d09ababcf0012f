"""Measuring ember itself: load, prefill and decode figures and peak RSS (`ember benchmark`).

Load is timed in this process (the weight cache as it is: warm after the first run). Prefill is timed
from the first prompt token to the last position's logits (`Generation.timings.prefill_seconds`), decode
per step (one token in, next greedy token out), both greedy and without stopping at end-of-generation
tokens, after one short warm-up generation. Figures are medians over `repeats`.
"""

from __future__ import annotations

import platform
import resource
import statistics
import sys
import time
from typing import Any

# A fixed English text; its token ids, repeated and cut, are the benchmark prompt.
PROMPT_TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He counted the steps "
    "out of habit, one hundred and twelve of them, and at the top he wiped the salt from the great "
    "glass lens before lighting the lamp. Ships passed far out on the grey water, and he wrote their "
    "names in a worn leather book: the colour of their sails, the hour they went by, and the direction "
    "of the wind. "
)


def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def prompt_ids(tokenizer: Any, count: int) -> list[int]:
    """`count` token ids of PROMPT_TEXT repeated, after BOS when the model adds one."""
    body = tokenizer.encode(PROMPT_TEXT, add_bos=False)
    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    while len(ids) < count:
        ids.extend(body)
    return ids[:count]


def measure_generation(model: Any, ids: list[int], new_tokens: int, repeats: int,
                       tracer: Any = None, advance: Any = None) -> dict[str, Any]:
    """Median prefill and decode figures of `repeats` greedy generations of `new_tokens` after `ids`."""
    model.generate(ids[: min(8, len(ids))], max_new_tokens=2, stop_at_eog=False)  # warm-up
    prefill, decode, steps = [], [], 0
    for _ in range(repeats):
        generation = model.generate(ids, max_new_tokens=new_tokens, stop_at_eog=False, tracer=tracer)
        t = generation.timings
        prefill.append(t.prefill_seconds)
        if t.decode_evaluations:
            decode.append(t.decode_seconds / t.decode_evaluations)
            steps = t.decode_evaluations
        if advance is not None:
            advance(1)
    result: dict[str, Any] = {
        "prefill_seconds": statistics.median(prefill),
        "prefill_tokens_per_second": len(ids) / statistics.median(prefill),
        "prefill_seconds_all": prefill,
    }
    if decode:
        result.update({"decode_seconds_per_token": statistics.median(decode),
                       "decode_tokens_per_second": 1.0 / statistics.median(decode),
                       "decode_steps": steps, "decode_seconds_per_token_all": decode})
    return result


def benchmark(source: str, *, context_length: int | None = None, threads: int | None = None,
              prompt_tokens: int = 64, new_tokens: int = 32, repeats: int = 3, progress: bool = True,
              tracer: Any = None, weights: str = "quantized") -> dict[str, Any]:
    """Load `source` and measure it; a JSON-ready dict of settings, results and machine facts."""
    import numpy as np

    import ember
    from ember.errors import ConfigError
    from ember.model import load_model
    from ember.progress import Progress

    if prompt_tokens < 1 or new_tokens < 2 or repeats < 1:
        raise ConfigError("benchmark needs prompt_tokens ≥ 1, new_tokens ≥ 2 and repeats ≥ 1")
    rss_before = peak_rss_bytes()
    started = time.perf_counter()
    with Progress.status(f"loading {source}", enabled=progress):
        model = load_model(source, context_length=context_length or max(2048, prompt_tokens + new_tokens),
                           threads=threads, weights=weights, tracer=tracer)
    load_seconds = time.perf_counter() - started
    rss_loaded = peak_rss_bytes()
    ids = prompt_ids(model.tokenizer, prompt_tokens)
    model.check_fits(len(ids), new_tokens)
    with Progress("measuring", total=repeats, enabled=progress) as advance:
        figures = measure_generation(model, ids, new_tokens, repeats, tracer, advance)
    results = {"load_seconds": load_seconds, **figures, "peak_rss_bytes": peak_rss_bytes(),
               "peak_rss_after_load_bytes": rss_loaded, "peak_rss_before_load_bytes": rss_before}
    return {
        "model": {"name": model.source.name, "path": str(model.source.path),
                  "architecture": model.config.architecture, "layer_count": model.config.layer_count},
        "settings": {"prompt_tokens": len(ids), "new_tokens": new_tokens, "repeats": repeats,
                     "threads": model.threads, "context_length": model.context_length,
                     "weights": model.weights, "tracing": tracer is not None},
        "results": results,
        "machine": {"python": platform.python_version(), "numpy": np.__version__,
                    "platform": platform.platform(), "ember": ember.__version__},
    }
