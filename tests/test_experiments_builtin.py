"""The reference experiments, driven through the runner's adapter with NumPy buffers (no engine)."""

import math
import sys

import numpy as np
import pytest

from ember.errors import ConfigError
from ember.experiments import (
    BUILTIN_EXPERIMENTS,
    ActivationStats,
    ExecutionPhase,
    Experiment,
    ExperimentFailure,
    ExperimentRunner,
    ModelContext,
    ModelFamily,
    TracingState,
    ZeroLayerOutput,
)
from ember.stages import LAYER_NAMES

LAYERS, HIDDEN, VOCAB = 3, 8, 11
MODEL = ModelContext(ModelFamily.QWEN3, "toy", "qwen3", LAYERS, HIDDEN)
LAYER_HOOKS = ["before_layer", "after_attention", "after_mlp", "after_layer"]


def run_evaluation(runner: ExperimentRunner, phase: ExecutionPhase, start: int, rows: int,
                   rng: np.random.Generator, seen: dict | None = None) -> dict:
    """One evaluation with random activations; returns copies of what each hook received after the
    experiments ran, keyed by (phase, hook, layer)."""
    seen = {} if seen is None else seen
    hooks = runner.hooks
    hooks.begin_evaluation(phase, start, rows)
    for layer in range(LAYERS):
        for hook in LAYER_HOOKS:
            array = rng.standard_normal((rows, HIDDEN)).astype(np.float32) * (layer + 1)
            getattr(hooks, hook)(layer, array)
            seen.setdefault((phase.value, hook, layer), []).append(array.copy())
    for hook, width in (("before_logits", HIDDEN), ("after_logits", VOCAB)):
        array = rng.standard_normal((1, width)).astype(np.float32)
        getattr(hooks, hook)(array)
        seen.setdefault((phase.value, hook, None), []).append(array.copy())
    return seen


def start(experiments: list) -> ExperimentRunner:
    runner = ExperimentRunner(experiments, MODEL, TracingState.DISABLED)
    runner.on_model_loaded()
    runner.before_prefill(0, 5)
    return runner


def test_registry() -> None:
    assert BUILTIN_EXPERIMENTS["activation_stats"] is ActivationStats
    assert BUILTIN_EXPERIMENTS["zero_layer_output"] is ZeroLayerOutput
    assert set(BUILTIN_EXPERIMENTS) == {"activation_stats", "zero_layer_output", "logit_lens",
                                        "activation_patching", "head_patching", "ablation", "steering",
                                        "direct_logit_attribution", "expert_usage", "expert_ablation",
                                        "path_patching",
                                        "attention_patterns"}
    assert ActivationStats().name == "activation_stats"
    assert ZeroLayerOutput(layer=0).name == "zero_layer_output"


def test_activation_stats_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    stats = ActivationStats()
    runner = start([stats])
    seen = run_evaluation(runner, ExecutionPhase.PREFILL, 0, 5, rng)
    for step in range(3):
        run_evaluation(runner, ExecutionPhase.DECODE, 5 + step, 1, rng, seen)
    runner.on_generation_complete(5, 4, 3)
    result = runner.results()["activation_stats"]
    rows = result.tables["activation_stats"]
    assert len(rows) == 2 * (4 * LAYERS + 2)
    assert [row["phase"] for row in rows[:14]] == ["prefill"] * 14
    for row in rows:
        values = np.concatenate([a.ravel() for a in seen[(row["phase"], row["hook"], row["layer"])]])
        values = values.astype(np.float64)
        assert row["evaluations"] == (1 if row["phase"] == "prefill" else 3)
        assert row["count"] == values.size and row["nonfinite"] == 0
        assert row["mean"] == pytest.approx(values.mean(), abs=1e-5)
        assert row["std"] == pytest.approx(values.std(), rel=1e-4)
        assert row["rms"] == pytest.approx(math.sqrt((values**2).mean()), rel=1e-5)
        assert row["min"] == values.min() and row["max"] == values.max()
        assert row["max_abs"] == np.abs(values).max()
    # metrics: one per row and statistic, step = layer
    assert len(result.metrics) == len(rows) * 7
    decode_rms = [m for m in result.metrics if m.name == "decode/after_mlp/rms"]
    assert [m.step for m in decode_rms] == [0, 1, 2]
    # arrays: [layer stages, layers] per phase and statistic (NaN where a stage was not shown)
    assert result.arrays["prefill/rms"].shape == (len(LAYER_NAMES), LAYERS)
    row = next(r for r in rows if (r["phase"], r["hook"], r["layer"]) == ("decode", "after_attention", 2))
    assert result.arrays["decode/max"][LAYER_NAMES.index("after_attention"), 2] == row["max"]


def test_activation_stats_never_writes_and_counts_nonfinite() -> None:
    class Poison(Experiment):
        name = "poison"

        def after_mlp(self, ctx, mlp_output):
            if ctx.layer_index == 1:
                values = mlp_output.values_mut()
                values[0, 0] = np.nan
                values[0, 1] = np.inf
                values[0, 2] = -np.inf

    stats = ActivationStats(phases="decode")
    runner = start([Poison(), stats])
    rng = np.random.default_rng(1)
    run_evaluation(runner, ExecutionPhase.PREFILL, 0, 4, rng)
    seen = run_evaluation(runner, ExecutionPhase.DECODE, 4, 1, rng)
    rows = stats.rows()
    assert {row["phase"] for row in rows} == {"decode"}
    poisoned = next(r for r in rows if (r["hook"], r["layer"]) == ("after_mlp", 1))
    assert poisoned["nonfinite"] == 3 and poisoned["count"] == HIDDEN - 3
    finite = seen[("decode", "after_mlp", 1)][0].ravel()[3:].astype(np.float64)
    assert poisoned["mean"] == pytest.approx(finite.mean(), abs=1e-6)
    assert poisoned["max_abs"] == np.abs(finite).max()
    assert all(r["nonfinite"] == 0 for r in rows if r is not poisoned)


def test_activation_stats_is_observation_only() -> None:
    source = np.random.default_rng(2).standard_normal((3, HIDDEN)).astype(np.float32)
    buffer = source.copy()
    runner = start([ActivationStats()])
    runner.hooks.begin_evaluation(ExecutionPhase.PREFILL, 0, 3)
    for hook in LAYER_HOOKS:
        getattr(runner.hooks, hook)(0, buffer)
    assert np.array_equal(buffer, source)


def test_activation_stats_figure_is_lazy() -> None:
    stats = ActivationStats()
    runner = start([stats])
    run_evaluation(runner, ExecutionPhase.PREFILL, 0, 2, np.random.default_rng(3))
    result = runner.results()["activation_stats"]
    assert "rms_by_layer" in result.figure_builders
    figure = result.figures["rms_by_layer"]
    assert "matplotlib" in sys.modules
    assert len(figure.axes) == 1
    assert len(figure.axes[0].lines) == len(LAYER_NAMES)  # one per layer stage
    assert result.figures["rms_by_layer"] is figure


def test_partial_results_after_failure() -> None:
    class StopAtDecode(Experiment):
        name = "stop"

        def after_attention(self, ctx, attention_output):
            if ctx.execution.phase is ExecutionPhase.DECODE and ctx.layer_index == 1:
                raise ValueError("stop here")

    stats = ActivationStats()
    runner = start([stats, StopAtDecode()])
    rng = np.random.default_rng(4)
    run_evaluation(runner, ExecutionPhase.PREFILL, 0, 3, rng)
    with pytest.raises(ExperimentFailure):
        run_evaluation(runner, ExecutionPhase.DECODE, 3, 1, rng)
    rows = runner.results()["activation_stats"].tables["activation_stats"]
    decode = [(r["hook"], r["layer"]) for r in rows if r["phase"] == "decode"]
    # stats ran first at the failing hook, then nothing more ran
    assert decode == [("before_layer", 0), ("before_layer", 1), ("after_attention", 0),
                      ("after_attention", 1), ("after_mlp", 0), ("after_layer", 0)]


@pytest.mark.parametrize("kwargs, message", [
    ({"layer": 1, "target": "residual"}, "target 'residual' is not one of attention, mlp, both"),
    ({"layer": 1, "phases": "training"}, "'training' is not one of 'prefill', 'decode', 'both'"),
    ({"layer": "3"}, "layer '3' is not an integer"),
    ({"layer": []}, "`layer` is empty"),
    ({"layer": [1, True]}, "layer True is not an integer"),
])
def test_zero_layer_output_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ZeroLayerOutput(**kwargs)


def test_zero_layer_output_range_checked_on_model_loaded() -> None:
    runner = ExperimentRunner([ZeroLayerOutput(layer=[1, 3, -1])], MODEL, TracingState.DISABLED)
    with pytest.raises(ExperimentFailure) as caught:
        runner.on_model_loaded()
    assert str(caught.value) == (
        "experiment 'zero_layer_output' failed in on_model_loaded: layer -1, 3 is outside the model: "
        "toy has 3 layers, valid layers are 0..2")


@pytest.mark.parametrize("target, zeroed", [
    ("attention", {"after_attention"}), ("mlp", {"after_mlp"}), ("both", {"after_attention", "after_mlp"}),
])
def test_zero_layer_output_targets(target: str, zeroed: set) -> None:
    runner = start([ZeroLayerOutput(layer=[0, 2], target=target, phases="decode")])
    rng = np.random.default_rng(5)
    seen = run_evaluation(runner, ExecutionPhase.PREFILL, 0, 2, rng)
    run_evaluation(runner, ExecutionPhase.DECODE, 2, 1, rng, seen)
    for (phase, hook, layer), arrays in seen.items():
        expect_zero = phase == "decode" and hook in zeroed and layer in (0, 2)
        assert (not arrays[0].any()) == expect_zero, (phase, hook, layer)
    result = runner.results()["zero_layer_output"]
    assert result.metrics[0].value == 2 * len(zeroed)
    assert {(r["hook"], r["layer"]) for r in result.tables["zeroed"]} == {
        (hook, layer) for hook in zeroed for layer in (0, 2)}


def test_zero_both_passes_the_residual_through() -> None:
    """With target both, a LLaMA-shaped layer leaves the residual stream exactly as it entered."""
    runner = start([ZeroLayerOutput(layer=1)])
    hooks = runner.hooks
    hooks.begin_evaluation(ExecutionPhase.PREFILL, 0, 3)
    hidden = np.random.default_rng(6).standard_normal((3, HIDDEN)).astype(np.float32)
    entering = hidden.copy()
    hooks.before_layer(1, hidden)
    attention_output = np.ones_like(hidden)
    hooks.after_attention(1, attention_output)
    hidden += attention_output
    mlp_output = np.full_like(hidden, 3.0)
    hooks.after_mlp(1, mlp_output)
    hidden += mlp_output
    hooks.after_layer(1, hidden)
    assert np.array_equal(hidden, entering)


def test_activation_stats_decode_batch_without_logits_hooks() -> None:
    """Decode rows are batched per evaluation; a new evaluation's rows flush the previous ones even
    when no after_logits ends it, and results() flushes what is pending."""
    stats = ActivationStats(phases="decode")
    runner = start([stats])
    seen: dict = {}
    rng = np.random.default_rng(7)
    for step in range(3):
        runner.hooks.begin_evaluation(ExecutionPhase.DECODE, 5 + step, 1)
        for layer in range(LAYERS):
            array = rng.standard_normal((1, HIDDEN)).astype(np.float32)
            runner.hooks.after_mlp(layer, array)
            seen.setdefault(layer, []).append(array.astype(np.float64))
    rows = stats.rows()
    assert [(row["hook"], row["layer"], row["evaluations"]) for row in rows] == [
        ("after_mlp", layer, 3) for layer in range(LAYERS)]
    for row in rows:
        values = np.concatenate(seen[row["layer"]], axis=None)
        assert row["mean"] == pytest.approx(values.mean(), abs=1e-6)
        assert row["min"] == values.min() and row["max"] == values.max()
        assert row["rms"] == pytest.approx(math.sqrt((values**2).mean()), rel=1e-6)
