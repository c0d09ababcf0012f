"""The hook contract's end-to-end tests on the real Gemma 3 270M (gemma3 family).

The model-independent tests of `test_experiments_engine.py` are imported and run here against Gemma 3
(the `model` fixture below replaces SmolLM2); the few that name SmolLM2's shape are restated for
Gemma 3. On Gemma the boundaries sit after the sandwich norms (the seed's Gemma column), so
`after_layer = before_layer + after_attention + after_mlp` still holds and zeroing `after_attention`
equals zeroing the O projection (the post-attention norm of zeros is zeros).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import test_experiments_engine as engine_tests
from allocations import step_allocations, typical

from ember.experiments import (
    ActivationStats,
    ExecutionPhase,
    ExperimentFailure,
    TracingState,
    ZeroLayerOutput,
)
from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ModelFamily
from ember.stages import layer_names

Capture, Recorder, expected_log = engine_tests.Capture, engine_tests.Recorder, engine_tests.expected_log

# Fixtures and model-independent tests of test_experiments_engine.py, collected here to run on Gemma 3.
SHARED = (
    "prompt_ids", "decode_memory",
    "test_failure_stops_generation",
    "test_recorded_boundaries_are_the_residual_arithmetic",
    "test_zero_attention_equals_model_without_attention_output",
    "test_zero_both_passes_residual_through",
    "test_prefill_intervention_reaches_decode_through_the_cache",
    "test_disabled_path_builds_no_runner_and_no_access",
    "test_decode_memory_does_not_grow_per_token",
    "test_writing_through_values_fails_the_experiment",
)
globals().update({name: getattr(engine_tests, name) for name in SHARED})

LAYERS, HIDDEN = 18, 640


@pytest.fixture(scope="module")
def model() -> Any:
    import ember

    return ember.load_model("gemma3-270m", context_length=1024)


def test_call_sequence_prefill_and_decodes_gemma3(model: Any, prompt_ids: list[int]) -> None:
    recorder = Recorder()
    generation = model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False, experiments=[recorder],
                                tracing=TracingState.ENABLED)
    assert len(generation.token_ids) == 4 and generation.complete
    loaded, prefill = recorder.log[0], recorder.log[1]
    assert loaded[0] == "on_model_loaded"
    assert (loaded[1].family, loaded[1].architecture) == (ModelFamily.GEMMA3, "gemma3")
    assert (loaded[1].layer_count, loaded[1].hidden_size) == (LAYERS, HIDDEN)
    assert (prefill[1].phase, prefill[1].start_position, prefill[1].input_token_count) == (
        ExecutionPhase.PREFILL, 0, len(prompt_ids))
    assert recorder.log[2:] == expected_log(model.config, len(prompt_ids), 3)
    done = recorder.completed
    assert (done.prompt_token_count, done.generated_token_count, done.decode_evaluation_count) == (
        len(prompt_ids), 4, 3)


def test_observation_changes_nothing_gemma3(model: Any, prompt_ids: list[int]) -> None:
    plain = model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False, temperature=0.8, seed=3)
    stats = ActivationStats()
    capture = Capture(hooks=("before_layer", "after_attention", "after_mlp", "after_layer"))
    observed = model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False, temperature=0.8, seed=3,
                              experiments=[stats, capture])
    assert observed.token_ids == plain.token_ids
    rows = stats.rows()
    assert len(rows) == 2 * (len(layer_names(ModelFamily.GEMMA3)) * LAYERS + 2)
    assert all(row["nonfinite"] == 0 for row in rows)


def test_layer_out_of_range_gemma3(model: Any, prompt_ids: list[int]) -> None:
    with pytest.raises(ExperimentFailure) as caught:
        model.generate(prompt_ids, max_new_tokens=2, experiments=[ZeroLayerOutput(layer=LAYERS)])
    assert str(caught.value) == (
        "experiment 'zero_layer_output' failed in on_model_loaded: layer 18 is outside the model: "
        "gemma3-270m has 18 layers, valid layers are 0..17")


def test_decode_across_the_window_allocates_no_activation_block(model: Any) -> None:
    """Decode steps 508…523 (the sliding rings wrap at 512): the typical step allocates less than one
    [1, feed_forward] GELU row (8 KB), not even for a moment, and keeps nothing; nothing grows as the
    rings wrap (the steps after the wrap allocate what the steps before it do)."""
    forward = model._forward
    cache = forward.new_cache(model.context_length)
    workspace = forward.new_workspace(1, model.context_length)
    prompt = np.arange(1000, 1505, dtype=np.int64)
    prefill_workspace = forward.new_workspace(len(prompt), model.context_length)
    forward.forward(prompt, 0, cache, prefill_workspace, DISABLED_HOOKS, ExecutionPhase.PREFILL)
    token = np.array([1000])
    for position in range(505, 508):  # warm-up
        forward.forward(token, position, cache, workspace, DISABLED_HOOKS, ExecutionPhase.DECODE)
    peaks, kept = step_allocations(
        lambda position: forward.forward(token, position, cache, workspace, DISABLED_HOOKS,
                                         ExecutionPhase.DECODE), range(508, 524))
    gelu_row = model.config.feed_forward_length * 4
    assert typical(peaks) < gelu_row, f"decode steps allocated {peaks} bytes at once (GELU row {gelu_row})"
    before_wrap, after_wrap = typical(peaks[:4]), typical(peaks[-8:])
    assert after_wrap <= before_wrap + 512, f"the peak grew across the window: {peaks}"
    # NumPy keeps ~100-byte entries in internal caches while the key count still grows (before 512)
    assert typical(kept) < 256, kept
