"""The runner and adapters, driven directly by a toy forward pass over NumPy buffers (no engine)."""

from typing import Any

import numpy as np
import pytest

from ember.errors import ConfigError
from ember.experiments import (
    DISABLED_HOOKS,
    DisabledHooks,
    ExecutionPhase,
    Experiment,
    ExperimentError,
    ExperimentFailure,
    ExperimentResult,
    ExperimentRunner,
    Metric,
    ModelContext,
    ModelFamily,
    TensorAccess,
    TracingState,
)

LAYERS, HIDDEN, VOCAB = 3, 4, 5
MODEL = ModelContext(ModelFamily.LLAMA, "toy", "llama", LAYERS, HIDDEN)
TENSOR_HOOKS = [
    "before_layer", "after_attention", "after_mlp", "after_layer", "before_logits", "after_logits",
]


def toy_forward(hooks: Any, phase: ExecutionPhase, start: int, token_count: int) -> np.ndarray:
    """A forward pass shaped like the engine's: residual stream, two contributions per layer."""
    hooks.begin_evaluation(phase, start, token_count)
    hidden = np.tile(np.arange(start, start + token_count, dtype=np.float32)[:, None], (1, HIDDEN))
    attention_output = np.empty_like(hidden)
    mlp_output = np.empty_like(hidden)
    for i in range(LAYERS):
        hooks.before_layer(i, hidden)
        np.multiply(hidden, 0.5, out=attention_output)
        attention_output += 1.0
        hooks.after_attention(i, attention_output)
        hidden += attention_output
        np.multiply(hidden, 0.25, out=mlp_output)
        hooks.after_mlp(i, mlp_output)
        hidden += mlp_output
        hooks.after_layer(i, hidden)
    last = hidden[-1:].copy()
    hooks.before_logits(last)
    logits = last[:, :1] * np.arange(1, VOCAB + 1, dtype=np.float32)  # [1, VOCAB]
    hooks.after_logits(logits)
    return logits


def toy_generate(
    experiments: list[Any], prompt_tokens: int = 3, decode_steps: int = 2,
    tracing: TracingState = TracingState.DISABLED,
) -> tuple[ExperimentRunner, list[np.ndarray]]:
    """The engine's integration, as model.py does it."""
    runner = ExperimentRunner(experiments, MODEL, tracing)
    runner.on_model_loaded()
    runner.before_prefill(0, prompt_tokens)
    outputs = [toy_forward(runner.hooks, ExecutionPhase.PREFILL, 0, prompt_tokens)]
    for step in range(decode_steps):
        outputs.append(toy_forward(runner.hooks, ExecutionPhase.DECODE, prompt_tokens + step, 1))
    runner.on_generation_complete(prompt_tokens, decode_steps + 1, decode_steps)
    return runner, outputs


class Recorder(Experiment):
    """Records every call: (experiment, hook, phase, layer, start, count, token_position, shape)."""

    def __init__(self, name: str, log: list[tuple], fail_at: tuple | None = None,
                 error: Exception | None = None) -> None:
        self.name = name
        self.log = log
        self.fail_at = fail_at
        self.error = error or ExperimentError("expected a finite activation")

    def _note(self, hook: str, ctx: Any, tensor: TensorAccess | None = None) -> None:
        execution = getattr(ctx, "execution", ctx)
        phase = getattr(execution, "phase", None)
        entry = (
            self.name, hook, phase.value if phase else None, getattr(ctx, "layer_index", None),
            getattr(execution, "start_position", None), getattr(execution, "input_token_count", None),
            execution.token_position() if phase else None, tensor.shape if tensor else None,
        )
        self.log.append(entry)
        if self.fail_at == (hook, entry[2], entry[3]):
            raise self.error

    def on_model_loaded(self, ctx): self._note("on_model_loaded", ctx)
    def before_prefill(self, ctx): self._note("before_prefill", ctx)
    def before_layer(self, ctx, hidden): self._note("before_layer", ctx, hidden)
    def after_attention(self, ctx, attention_output): self._note("after_attention", ctx, attention_output)
    def after_mlp(self, ctx, mlp_output): self._note("after_mlp", ctx, mlp_output)
    def after_layer(self, ctx, hidden): self._note("after_layer", ctx, hidden)
    def before_logits(self, ctx, hidden): self._note("before_logits", ctx, hidden)
    def after_logits(self, ctx, logits): self._note("after_logits", ctx, logits)
    def on_generation_complete(self, ctx): self._note("on_generation_complete", ctx)

    def results(self) -> ExperimentResult:
        own = sum(1 for entry in self.log if entry[0] == self.name)
        return ExperimentResult(metrics=[Metric("calls", float(own))])


def expected_sequence(name: str, prompt_tokens: int, decode_steps: int) -> list[tuple]:
    sequence = [(name, "on_model_loaded", None, None, None, None, None, None),
                (name, "before_prefill", "prefill", None, 0, prompt_tokens,
                 0 if prompt_tokens == 1 else None, None)]
    evaluations = [("prefill", 0, prompt_tokens)]
    evaluations += [("decode", prompt_tokens + s, 1) for s in range(decode_steps)]
    for phase, start, count in evaluations:
        position = start if count == 1 else None
        for layer in range(LAYERS):
            for hook in TENSOR_HOOKS[:4]:
                sequence.append((name, hook, phase, layer, start, count, position, (count, HIDDEN)))
        sequence.append((name, "before_logits", phase, None, start, count, position, (1, HIDDEN)))
        sequence.append((name, "after_logits", phase, None, start, count, position, (1, VOCAB)))
    sequence.append((name, "on_generation_complete", None, None, None, None, None, None))
    return sequence


def test_call_sequence_single_experiment() -> None:
    log: list[tuple] = []
    toy_generate([Recorder("rec", log)], prompt_tokens=3, decode_steps=2)
    assert log == expected_sequence("rec", 3, 2)


def test_experiments_run_in_list_order_at_each_hook() -> None:
    log: list[tuple] = []
    toy_generate([Recorder("first", log), Recorder("second", log)], prompt_tokens=2, decode_steps=1)
    firsts = expected_sequence("first", 2, 1)
    seconds = expected_sequence("second", 2, 1)
    interleaved = [entry for pair in zip(firsts, seconds, strict=True) for entry in pair]
    assert log == interleaved


def test_generation_context_and_tracing() -> None:
    seen: dict[str, Any] = {}

    class Spy(Experiment):
        name = "spy"

        def before_layer(self, ctx, hidden):
            seen.setdefault("tracing", ctx.execution.tracing)
            seen.setdefault("model", ctx.execution.model)

        def on_generation_complete(self, ctx):
            seen["complete"] = ctx

    toy_generate([Spy()], prompt_tokens=4, decode_steps=3, tracing=TracingState.ENABLED)
    assert seen["tracing"] is TracingState.ENABLED
    assert seen["model"] is MODEL
    done = seen["complete"]
    assert (done.prompt_token_count, done.generated_token_count, done.decode_evaluation_count) == (4, 4, 3)
    assert done.model is MODEL and done.tracing is TracingState.ENABLED


def test_observation_changes_nothing_and_writes_flow_downstream() -> None:
    _, observed = toy_generate([Recorder("rec", [])])

    class NoHooks(Experiment):
        name = "nothing"

    _, baseline = toy_generate([NoHooks()])
    for a, b in zip(baseline, observed, strict=True):
        np.testing.assert_array_equal(a, b)

    class ZeroFirstAttention(Experiment):
        name = "zero"

        def after_attention(self, ctx, attention_output):
            if ctx.layer_index == 0:
                attention_output.zero()

    _, zeroed = toy_generate([ZeroFirstAttention()])
    # layer 0: attention adds nothing, then hidden *= 1.25 at each mlp; recompute by hand for prefill
    hidden = np.tile(np.arange(3, dtype=np.float32)[:, None], (1, HIDDEN))
    for layer in range(LAYERS):
        if layer > 0:
            hidden = hidden + (hidden * 0.5 + 1.0)
        hidden = hidden + hidden * 0.25
    expected = hidden[-1:, :1] * np.arange(1, VOCAB + 1)
    np.testing.assert_allclose(zeroed[0], expected, rtol=1e-6)
    assert not np.allclose(zeroed[0], baseline[0])


def test_failure_stops_everything() -> None:
    log: list[tuple] = []
    first = Recorder("my-experiment", log, fail_at=("after_attention", "decode", 1))
    second = Recorder("second", log)
    runner = ExperimentRunner([first, second], MODEL, TracingState.DISABLED)
    runner.on_model_loaded()
    runner.before_prefill(0, 3)
    toy_forward(runner.hooks, ExecutionPhase.PREFILL, 0, 3)
    with pytest.raises(ExperimentFailure) as caught:
        toy_forward(runner.hooks, ExecutionPhase.DECODE, 3, 1)
    failure = caught.value
    assert str(failure) == ("experiment 'my-experiment' failed in after_attention "
                            "(phase=decode, layer=1): expected a finite activation")
    assert (failure.experiment, failure.hook, failure.phase, failure.layer) == (
        "my-experiment", "after_attention", ExecutionPhase.DECODE, 1)
    assert failure.message == "expected a finite activation"
    assert isinstance(failure.__cause__, ExperimentError)
    assert runner.failure is failure
    # the last call was the failing one: the second experiment never saw decode layer 1 after_attention
    assert log[-1][:4] == ("my-experiment", "after_attention", "decode", 1)
    assert log[-2][:4] == ("second", "before_layer", "decode", 1)
    count = len(log)
    # nothing runs any more, for any experiment
    with pytest.raises(ExperimentFailure) as again:
        runner.hooks.after_mlp(1, np.zeros((1, HIDDEN), np.float32))
    assert again.value is failure
    with pytest.raises(ExperimentFailure):
        runner.hooks.begin_evaluation(ExecutionPhase.DECODE, 5, 1)
    with pytest.raises(ExperimentFailure):
        runner.on_generation_complete(3, 2, 2)
    assert len(log) == count
    assert all(entry[1] != "on_generation_complete" for entry in log)
    # partial results are still available
    results = runner.results()
    assert set(results) == {"my-experiment", "second"}
    assert results["second"].metrics[0].value == float(sum(1 for e in log if e[0] == "second"))


def test_other_exceptions_are_wrapped_with_cause() -> None:
    log: list[tuple] = []
    broken = Recorder("broken", log, fail_at=("after_logits", "prefill", None),
                      error=ZeroDivisionError("oops"))
    with pytest.raises(ExperimentFailure) as caught:
        toy_generate([broken])
    assert str(caught.value) == (
        "experiment 'broken' failed in after_logits (phase=prefill): ZeroDivisionError: oops")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert caught.value.layer is None


@pytest.mark.parametrize("hook, phase, where", [
    ("on_model_loaded", None, "on_model_loaded"),
    ("before_prefill", "prefill", "before_prefill (phase=prefill)"),
    ("on_generation_complete", None, "on_generation_complete"),
    ("before_logits", "decode", "before_logits (phase=decode)"),
    ("before_layer", "prefill", "before_layer (phase=prefill, layer=2)"),
])
def test_failure_message_per_hook(hook: str, phase: str | None, where: str) -> None:
    text = f"experiment 'x' failed in {where}: expected a finite activation"
    layer = 2 if hook == "before_layer" else None
    with pytest.raises(ExperimentFailure) as caught:
        toy_generate([Recorder("x", [], fail_at=(hook, phase, layer))], decode_steps=1)
    assert str(caught.value) == text


def test_keeping_a_tensor_access_fails_the_experiment() -> None:
    class Hoarder(Experiment):
        name = "hoarder"
        kept: TensorAccess | None = None

        def before_layer(self, ctx, hidden):
            if self.kept is not None:
                self.kept.values()
            self.kept = hidden

    hoarder = Hoarder()
    with pytest.raises(ExperimentFailure) as caught:
        toy_generate([hoarder])
    assert caught.value.hook == "before_layer" and caught.value.layer == 1
    assert "after its hook returned" in str(caught.value)


def test_each_experiment_gets_its_own_access() -> None:
    accesses: list[TensorAccess] = []

    class Grab(Experiment):
        def __init__(self, name):
            self.name = name

        def after_logits(self, ctx, logits):
            accesses.append(logits)
            logits.values()  # usable during its own call

    toy_generate([Grab("a"), Grab("b")], decode_steps=0)
    assert len(accesses) == 2 and accesses[0] is not accesses[1]
    with pytest.raises(ExperimentError):
        accesses[1].values()


def test_duck_typed_experiment_and_unimplemented_hooks_skipped() -> None:
    calls: list[str] = []

    class Plain:
        name = "plain"

        def after_mlp(self, ctx, mlp_output):
            calls.append(f"{ctx.execution.phase.value}:{ctx.layer_index}")

    runner, _ = toy_generate([Plain()], decode_steps=1)
    assert calls == ["prefill:0", "prefill:1", "prefill:2", "decode:0", "decode:1", "decode:2"]
    assert runner.results()["plain"].is_empty()
    assert runner.hooks.evaluation_count == {ExecutionPhase.PREFILL: 1, ExecutionPhase.DECODE: 1}


def test_names_are_checked() -> None:
    class Nameless(Experiment):
        pass

    with pytest.raises(ConfigError, match="no name"):
        ExperimentRunner([Nameless()], MODEL, TracingState.DISABLED)
    with pytest.raises(ConfigError, match="two experiments are named 'rec'"):
        ExperimentRunner([Recorder("rec", []), Recorder("rec", [])], MODEL, TracingState.DISABLED)


def test_results_errors() -> None:
    class BadResults(Experiment):
        name = "bad"

        def results(self):
            raise RuntimeError("no results today")

    runner = ExperimentRunner([BadResults()], MODEL, TracingState.DISABLED)
    with pytest.raises(ExperimentFailure, match="failed in results: RuntimeError: no results today"):
        runner.results()

    failing = Recorder("rec", [], fail_at=("on_model_loaded", None, None))
    runner = ExperimentRunner([failing, BadResults()], MODEL, TracingState.DISABLED)
    with pytest.raises(ExperimentFailure):
        runner.on_model_loaded()
    results = runner.results()  # after a failure: what each has, an empty result for the broken one
    assert results["bad"].is_empty() and results["rec"].metrics[0].value == 1.0


def test_keyboard_interrupt_is_not_wrapped() -> None:
    class Interrupt(Experiment):
        name = "interrupt"

        def before_layer(self, ctx, hidden):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        toy_generate([Interrupt()])


def test_disabled_hooks_do_nothing() -> None:
    assert isinstance(DISABLED_HOOKS, DisabledHooks)
    assert DisabledHooks.__slots__ == ()
    buffer = np.ones((2, HIDDEN), np.float32)
    logits = toy_forward(DISABLED_HOOKS, ExecutionPhase.PREFILL, 0, 2)
    runner, outputs = toy_generate([Recorder("rec", [])], prompt_tokens=2, decode_steps=0)
    np.testing.assert_array_equal(logits, outputs[0])
    DISABLED_HOOKS.after_attention(0, buffer)
    assert buffer.tolist() == np.ones((2, HIDDEN)).tolist()
