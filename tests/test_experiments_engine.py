"""The hook contract on the real engine (SmolLM2-135M, llama family): call sequence, failure path,
interventions computed independently, bit-identical observation, and the disabled path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from allocations import step_allocations, typical

import ember.experiments.context as context_module
from ember.experiments import (
    DISABLED_HOOKS,
    ActivationStats,
    ExecutionPhase,
    Experiment,
    ExperimentError,
    ExperimentFailure,
    ExperimentRunner,
    TensorAccess,
    TracingState,
    ZeroLayerOutput,
)
from ember.experiments.adapters import ActiveHooks
from ember.phases import ModelFamily
from ember.stages import layer_names

PROMPT = "The capital of France is"
LAYER_HOOKS = ("before_layer", "after_attention", "after_mlp", "after_layer")


@pytest.fixture(scope="module")
def model(smollm2: Any) -> Any:
    return smollm2


@pytest.fixture(scope="module")
def prompt_ids(model: Any) -> list[int]:
    return model.tokenize(PROMPT)


class Recorder(Experiment):
    """Records (hook, phase, layer, start, count, token_position, shape) of every call."""

    def __init__(self, name: str = "recorder", fail_at: tuple | None = None) -> None:
        self.name = name
        self.fail_at = fail_at
        self.log: list[tuple] = []
        self.completed: Any = None

    def _note(self, hook: str, ctx: Any, tensor: TensorAccess) -> None:
        execution = getattr(ctx, "execution", ctx)
        entry = (hook, execution.phase.value, getattr(ctx, "layer_index", None), execution.start_position,
                 execution.input_token_count, execution.token_position(), tensor.shape)
        self.log.append(entry)
        if self.fail_at == entry[:3]:
            raise ExperimentError("expected a finite activation")

    def on_model_loaded(self, ctx): self.log.append(("on_model_loaded", ctx))
    def before_prefill(self, ctx): self.log.append(("before_prefill", ctx))
    def before_layer(self, ctx, hidden): self._note("before_layer", ctx, hidden)
    def after_attention(self, ctx, attention_output): self._note("after_attention", ctx, attention_output)
    def after_mlp(self, ctx, mlp_output): self._note("after_mlp", ctx, mlp_output)
    def after_layer(self, ctx, hidden): self._note("after_layer", ctx, hidden)
    def before_logits(self, ctx, hidden): self._note("before_logits", ctx, hidden)
    def after_logits(self, ctx, logits): self._note("after_logits", ctx, logits)
    def on_generation_complete(self, ctx): self.completed = ctx


class Capture(Experiment):
    """Observation only: copies what it is shown at the chosen hooks (all evaluations)."""

    def __init__(self, hooks: tuple[str, ...] = ("after_logits",), name: str = "capture") -> None:
        self.name = name
        self.wanted = set(hooks)
        self.seen: list[tuple[str, str, int | None, np.ndarray]] = []

    def _keep(self, hook: str, ctx: Any, tensor: TensorAccess) -> None:
        if hook in self.wanted:
            execution = getattr(ctx, "execution", ctx)
            self.seen.append((hook, execution.phase.value, getattr(ctx, "layer_index", None),
                              tensor.values().copy()))

    def before_layer(self, ctx, hidden): self._keep("before_layer", ctx, hidden)
    def after_attention(self, ctx, attention_output): self._keep("after_attention", ctx, attention_output)
    def after_mlp(self, ctx, mlp_output): self._keep("after_mlp", ctx, mlp_output)
    def after_layer(self, ctx, hidden): self._keep("after_layer", ctx, hidden)
    def before_logits(self, ctx, hidden): self._keep("before_logits", ctx, hidden)
    def after_logits(self, ctx, logits): self._keep("after_logits", ctx, logits)

    def logits(self) -> list[np.ndarray]:
        return [array for hook, _, _, array in self.seen if hook == "after_logits"]


def expected_log(config: Any, prompt_tokens: int, decode_steps: int) -> list[tuple]:
    hidden, vocab = config.hidden_size, config.vocab_size
    log = []
    evaluations = [("prefill", 0, prompt_tokens)]
    evaluations += [("decode", prompt_tokens + step, 1) for step in range(decode_steps)]
    for phase, start, count in evaluations:
        position = start if count == 1 else None
        for layer in range(config.layer_count):
            for hook in LAYER_HOOKS:
                log.append((hook, phase, layer, start, count, position, (count, hidden)))
        log.append(("before_logits", phase, None, start, count, position, (1, hidden)))
        log.append(("after_logits", phase, None, start, count, position, (1, vocab)))
    return log


def test_call_sequence_prefill_and_decodes(model: Any, prompt_ids: list[int]) -> None:
    recorder = Recorder()
    generation = model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False, experiments=[recorder],
                                tracing=TracingState.ENABLED)
    assert len(generation.token_ids) == 4 and generation.complete
    config = model.config
    loaded, prefill = recorder.log[0], recorder.log[1]
    assert loaded[0] == "on_model_loaded"
    assert (loaded[1].family, loaded[1].architecture) == (config.family, "llama")
    assert (loaded[1].layer_count, loaded[1].hidden_size) == (30, 576)
    assert prefill[0] == "before_prefill"
    assert (prefill[1].phase, prefill[1].start_position, prefill[1].input_token_count) == (
        ExecutionPhase.PREFILL, 0, len(prompt_ids))
    assert prefill[1].tracing is TracingState.ENABLED
    assert recorder.log[2:] == expected_log(config, len(prompt_ids), 3)
    done = recorder.completed
    assert (done.prompt_token_count, done.generated_token_count, done.decode_evaluation_count) == (
        len(prompt_ids), 4, 3)
    assert "recorder" in generation.experiment_results


def test_failure_stops_generation(model: Any, prompt_ids: list[int]) -> None:
    failing = Recorder("my-experiment", fail_at=("after_attention", "decode", 7))
    later = Recorder("later")
    with pytest.raises(ExperimentFailure) as caught:
        model.generate(prompt_ids, max_new_tokens=5, stop_at_eog=False, experiments=[failing, later])
    failure = caught.value
    assert str(failure) == ("experiment 'my-experiment' failed in after_attention (phase=decode, layer=7): "
                            "expected a finite activation")
    generation = failure.generation
    assert generation is not None and not generation.complete and generation.stop_reason == "failure"
    assert len(generation.token_ids) == 1  # the token the prefill produced; the first decode failed
    assert generation.prompt_token_ids == prompt_ids
    assert set(generation.experiment_results) == {"my-experiment", "later"}
    expected = expected_log(model.config, len(prompt_ids), 1)
    cut = expected.index(("after_attention", "decode", 7, len(prompt_ids), 1, len(prompt_ids),
                          (1, model.config.hidden_size)))
    assert failing.log[2:] == expected[:cut + 1]
    assert later.log[2:] == expected[:cut]  # the later experiment never saw the failing hook
    assert failing.completed is None and later.completed is None


def test_observation_is_bit_identical(model: Any, prompt_ids: list[int], monkeypatch: Any) -> None:
    """Same tokens and the same logits bits with no experiment and with observation-only ones."""
    def run(experiments: list) -> tuple[list[int], list[np.ndarray]]:
        captured: list[np.ndarray] = []
        forward = model._forward.forward

        def capturing(*args: Any, **kwargs: Any) -> np.ndarray:
            logits = forward(*args, **kwargs)
            captured.append(logits.copy())
            return logits

        monkeypatch.setattr(model._forward, "forward", capturing)
        try:
            generation = model.generate(prompt_ids, max_new_tokens=5, stop_at_eog=False, temperature=0.8,
                                        seed=3, experiments=experiments)
        finally:
            monkeypatch.undo()
        return generation.token_ids, captured

    plain_tokens, plain_logits = run([])
    stats = ActivationStats()
    capture = Capture(hooks=("before_layer", "after_attention", "after_mlp", "after_layer",
                             "before_logits", "after_logits"))
    observed_tokens, observed_logits = run([stats, capture])
    assert observed_tokens == plain_tokens
    assert len(observed_logits) == len(plain_logits) == 5
    for a, b in zip(plain_logits, observed_logits, strict=True):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(plain_logits, capture.logits(), strict=True):
        assert a.tobytes() == b.tobytes()
    rows = stats.rows()
    assert len(rows) == 2 * (len(layer_names(ModelFamily.LLAMA)) * 30 + 2)
    assert all(row["nonfinite"] == 0 for row in rows)


def test_recorded_boundaries_are_the_residual_arithmetic(model: Any, prompt_ids: list[int]) -> None:
    """after_layer = before_layer + attention output + MLP output; the next layer starts there."""
    capture = Capture(hooks=LAYER_HOOKS)
    model.generate(prompt_ids, max_new_tokens=2, stop_at_eog=False, experiments=[capture])
    by_key = {(hook, phase, layer): array for hook, phase, layer, array in capture.seen}
    for phase in ("prefill", "decode"):
        for layer in range(model.config.layer_count):
            entering = by_key[("before_layer", phase, layer)]
            total = entering + by_key[("after_attention", phase, layer)] + by_key[("after_mlp", phase, layer)]
            leaving = by_key[("after_layer", phase, layer)]
            np.testing.assert_allclose(leaving, total, rtol=1e-5, atol=1e-4)
            if layer + 1 < model.config.layer_count:
                assert np.array_equal(by_key[("before_layer", phase, layer + 1)], leaving)


@pytest.mark.parametrize("layer", [0, 11])
def test_zero_attention_equals_model_without_attention_output(
    model: Any, prompt_ids: list[int], layer: int, monkeypatch: Any
) -> None:
    """Zeroing after_attention at layer L == the same model with layer L's O projection set to zero,
    computed by the engine itself without experiments (bit-identical: 0·x sums to exactly 0)."""
    zeroing = ZeroLayerOutput(layer=layer, target="attention")
    capture = Capture()
    hooked = model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False,
                            experiments=[zeroing, capture])

    weights = model._forward.weights.layers[layer]
    monkeypatch.setattr(weights, "attn_output", np.zeros(weights.attn_output.shape, np.float32))
    reference_capture = Capture(name="reference")
    reference = model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False,
                               experiments=[reference_capture])
    monkeypatch.undo()

    assert hooked.token_ids == reference.token_ids
    for a, b in zip(capture.logits(), reference_capture.logits(), strict=True):
        assert a.tobytes() == b.tobytes()
    rows = hooked.experiment_results["zero_layer_output"].tables["zeroed"]
    assert rows == [{"phase": "prefill", "hook": "after_attention", "layer": layer, "evaluations": 1},
                    {"phase": "decode", "hook": "after_attention", "layer": layer, "evaluations": 3}]
    assert len(capture.logits()) == 4


def test_zero_both_passes_residual_through(model: Any, prompt_ids: list[int]) -> None:
    capture = Capture(hooks=("before_layer", "after_layer"))
    model.generate(prompt_ids, max_new_tokens=2, stop_at_eog=False,
                   experiments=[ZeroLayerOutput(layer=[3, 4]), capture])
    by_key = {(hook, phase, layer): array for hook, phase, layer, array in capture.seen}
    for phase in ("prefill", "decode"):
        for layer in (3, 4):
            leaving, entering = by_key[("after_layer", phase, layer)], by_key[("before_layer", phase, layer)]
            assert np.array_equal(leaving, entering)
        assert not np.array_equal(by_key[("after_layer", phase, 5)], by_key[("before_layer", phase, 5)])


def test_prefill_intervention_reaches_decode_through_the_cache(model: Any, prompt_ids: list[int]) -> None:
    """Zeroing only in prefill changes later decode steps, whose own hooks change nothing."""
    plain = Capture()
    model.generate(prompt_ids, max_new_tokens=3, stop_at_eog=False, experiments=[plain])
    prefill_only = Capture()
    model.generate(prompt_ids, max_new_tokens=3, stop_at_eog=False,
                   experiments=[ZeroLayerOutput(layer=2, phases="prefill"), prefill_only])
    assert not np.array_equal(plain.logits()[1], prefill_only.logits()[1])


def test_layer_out_of_range_fails_before_anything_runs(model: Any, prompt_ids: list[int]) -> None:
    recorder = Recorder()
    with pytest.raises(ExperimentFailure) as caught:
        model.generate(prompt_ids, max_new_tokens=2, experiments=[ZeroLayerOutput(layer=30), recorder])
    assert str(caught.value) == (
        "experiment 'zero_layer_output' failed in on_model_loaded: layer 30 is outside the model: "
        "smollm2-135m has 30 layers, valid layers are 0..29")
    assert recorder.log == []
    assert caught.value.generation.token_ids == []


def test_disabled_path_builds_no_runner_and_no_access(
    model: Any, prompt_ids: list[int], monkeypatch: Any
) -> None:
    built = {"runner": 0, "active": 0, "access": 0}
    hooks_seen: list[Any] = []

    def counting(kind: str, original: Any) -> Any:
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            built[kind] += 1
            original(self, *args, **kwargs)
        return init

    monkeypatch.setattr(ExperimentRunner, "__init__", counting("runner", ExperimentRunner.__init__))
    monkeypatch.setattr(ActiveHooks, "__init__", counting("active", ActiveHooks.__init__))
    monkeypatch.setattr(context_module.TensorAccess, "__init__",
                        counting("access", context_module.TensorAccess.__init__))
    forward = model._forward.forward

    def spying(token_ids: Any, start: int, cache: Any, ws: Any, hooks: Any, *args: Any, **kw: Any) -> Any:
        hooks_seen.append(hooks)
        return forward(token_ids, start, cache, ws, hooks, *args, **kw)

    monkeypatch.setattr(model._forward, "forward", spying)
    model.generate(prompt_ids, max_new_tokens=4, stop_at_eog=False)
    model.logits(prompt_ids)
    assert built == {"runner": 0, "active": 0, "access": 0}
    assert len(hooks_seen) == 5 and all(hooks is DISABLED_HOOKS for hooks in hooks_seen)
    # the counters do count: one experiment builds one runner and many accesses
    model.generate(prompt_ids, max_new_tokens=2, stop_at_eog=False, experiments=[Capture()])
    assert built["runner"] == 1 and built["active"] == 1
    assert built["access"] == 2 * (4 * model.config.layer_count + 2)


DECODE_STEPS = 9
LONG_CONTEXT = 320


def measure_decode_memory(model: Any, prompt_ids: list[int]) -> tuple[float, float]:
    """(bytes kept, transient peak) of the typical one of DECODE_STEPS decode steps after the prompt,
    with DISABLED_HOOKS, after warm-up, measured by tracemalloc (NumPy data blocks included; the median
    step, so another thread's allocation landing in one step does not count: tests/allocations.py)."""
    model.generate(prompt_ids, max_new_tokens=1)  # fills the cache with the prompt
    start = len(prompt_ids)
    token = prompt_ids[-1]
    for position in range(start, start + 3):  # warm-up
        model._decode(token, position, DISABLED_HOOKS)
    peaks, kept = step_allocations(lambda position: model._decode(token, position, DISABLED_HOOKS),
                                   range(start + 3, start + 3 + DECODE_STEPS))
    return typical(kept), typical(peaks)


@pytest.fixture(scope="module")
def decode_memory(model: Any, prompt_ids: list[int]) -> tuple[float, float]:
    return measure_decode_memory(model, prompt_ids)


def test_decode_memory_does_not_grow_per_token(model: Any, decode_memory: tuple[float, float]) -> None:
    row_bytes = model.config.hidden_size * 4
    growth, _ = decode_memory
    assert growth < row_bytes, f"a decode step keeps {growth} bytes alive (a [1, hidden] row: {row_bytes})"


def test_decode_allocates_no_activation_block(model: Any, decode_memory: tuple[float, float]) -> None:
    """With DISABLED_HOOKS, decode steps after warm-up allocate no activation block, not even for a
    moment: the traced peak stays below one [1, feed_forward] float32 row (the MLP's; the gate/up rows
    and the logits are larger still). Resolution: NumPy's own bookkeeping per ufunc call and the
    forward pass's views take ~2-4 KB at once, as much as a [1, hidden] row of this small model
    (576 floats), so a single [1, hidden] temporary is below what this check can see."""
    _, peak = decode_memory
    mlp_row_bytes = model.config.feed_forward_length * 4
    assert peak < mlp_row_bytes, f"decode allocated up to {peak} bytes at once (MLP row: {mlp_row_bytes})"


@pytest.mark.slow
def test_decode_allocates_nothing_that_grows_with_the_context(model: Any) -> None:
    """The same bound at a long context: nothing a decode step allocates may scale with the keys."""
    text_ids = model.tokenize(PROMPT * 80)
    _, peak = measure_decode_memory(model, text_ids[:LONG_CONTEXT])
    mlp_row_bytes = model.config.feed_forward_length * 4
    assert peak < mlp_row_bytes, (
        f"decode at {LONG_CONTEXT} keys allocated up to {peak} bytes at once (an MLP row is {mlp_row_bytes})")


def test_writing_through_values_fails_the_experiment(model: Any, prompt_ids: list[int]) -> None:
    class Sneaky(Experiment):
        name = "sneaky"

        def after_mlp(self, ctx, mlp_output):
            mlp_output.values()[0, 0] = 1.0

    with pytest.raises(ExperimentFailure) as caught:
        model.generate(prompt_ids, max_new_tokens=2, experiments=[Sneaky()])
    assert str(caught.value).startswith(
        "experiment 'sneaky' failed in after_mlp (phase=prefill, layer=0): ValueError: ")
    assert isinstance(caught.value.__cause__, ValueError)
    assert caught.value.generation.token_ids == []
