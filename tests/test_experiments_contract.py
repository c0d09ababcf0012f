"""The contract's values: public names, contexts, TensorAccess semantics, the failure message."""

import dataclasses
import pickle
import sys

import numpy as np
import pytest

import ember.experiments as ex
from ember.errors import EmberError
from ember.experiments import (
    ExecutionContext,
    ExecutionPhase,
    ExperimentError,
    ExperimentFailure,
    GenerationContext,
    LayerContext,
    ModelContext,
    ModelFamily,
    TensorAccess,
    TensorDType,
    TracingState,
)

MODEL = ModelContext(ModelFamily.LLAMA, "tiny", "llama", 3, 4)


def test_public_names() -> None:
    for name in [
        "Experiment", "ExperimentError", "ExperimentFailure", "ModelContext", "ExecutionContext",
        "LayerContext", "GenerationContext", "ModelFamily", "ExecutionPhase", "TracingState",
        "TensorDType", "TensorAccess", "ExperimentRunner", "DISABLED_HOOKS", "DisabledHooks",
        "ExperimentResult", "ActivationStats", "ZeroLayerOutput", "BUILTIN_EXPERIMENTS",
        "Readout", "StudyItem", "Evaluation", "ItemResult",  # v0.2
    ]:
        assert hasattr(ex, name), name
    assert [m.name for m in ModelFamily] == [
        "LLAMA", "QWEN3", "GEMMA3", "GEMMA4", "QWEN3MOE", "QWEN2", "OLMO2", "GRANITE", "SMOLLM3", "GEMMA2",
        "PHI3", "MISTRAL3", "GPT_OSS",
    ]
    assert [m.name for m in ExecutionPhase] == ["PREFILL", "DECODE"]
    assert [m.name for m in TracingState] == ["DISABLED", "ENABLED"]
    assert [m.name for m in TensorDType] == ["F32"]
    assert set(ex.BUILTIN_EXPERIMENTS) == {"activation_stats", "zero_layer_output", "logit_lens",
                                           "activation_patching", "head_patching", "ablation", "steering",
                                           "direct_logit_attribution", "expert_usage", "expert_ablation",
                                           "path_patching",
                                           "attention_patterns"}


def test_contract_does_not_import_matplotlib() -> None:
    import subprocess

    code = "import sys, ember.experiments; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("cls", [ModelContext, ExecutionContext, LayerContext, GenerationContext])
def test_contexts_are_frozen_slotted_dataclasses(cls: type) -> None:
    params = cls.__dataclass_params__
    assert params.frozen
    assert "__slots__" in cls.__dict__
    assert not hasattr(cls, "__dict__") or "__dict__" not in cls.__slots__


def test_context_fields_and_immutability() -> None:
    # v0.1's fields, then v0.2's readout (a default, left out of equality), then the heads per layer (0:
    # unknown, as in a context built by hand)
    assert [f.name for f in dataclasses.fields(ModelContext)] == [
        "family", "model_id", "architecture", "layer_count", "hidden_size", "readout", "expert_count",
        "experts_per_token", "head_count"]
    assert ModelContext.from_config(MODEL, "x").readout is None
    assert MODEL.head_count == 0
    assert dataclasses.replace(MODEL, readout=object()) == MODEL
    # v0.1's fields, then v0.3's batch layout (None for one sequence)
    assert [f.name for f in dataclasses.fields(ExecutionContext)] == [
        "model", "phase", "start_position", "input_token_count", "tracing", "batch"]
    assert [f.name for f in dataclasses.fields(LayerContext)] == ["execution", "layer_index"]
    assert [f.name for f in dataclasses.fields(GenerationContext)] == [
        "model", "prompt_token_count", "generated_token_count", "decode_evaluation_count", "tracing"]
    ctx = ExecutionContext(MODEL, ExecutionPhase.PREFILL, 0, 5, TracingState.DISABLED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.start_position = 3  # type: ignore[misc]
    with pytest.raises((AttributeError, TypeError)):
        ctx.extra = 1  # type: ignore[attr-defined]


def test_positions() -> None:
    prefill = ExecutionContext(MODEL, ExecutionPhase.PREFILL, 0, 5, TracingState.DISABLED)
    assert prefill.sequence_length == 5
    assert prefill.token_position() is None
    decode = ExecutionContext(MODEL, ExecutionPhase.DECODE, 7, 1, TracingState.ENABLED)
    assert decode.sequence_length == 8
    assert decode.token_position() == 7
    single_prefill = ExecutionContext(MODEL, ExecutionPhase.PREFILL, 0, 1, TracingState.DISABLED)
    assert single_prefill.token_position() == 0


def test_model_context_from_config() -> None:
    class Config:
        family = ModelFamily.QWEN3
        architecture = "qwen3"
        layer_count = 28
        hidden_size = 1024

    ctx = ModelContext.from_config(Config(), model_id="qwen3-0.6b")
    assert ctx == ModelContext(ModelFamily.QWEN3, "qwen3-0.6b", "qwen3", 28, 1024)


def test_tensor_access_reads_without_copy_and_read_only() -> None:
    buffer = np.arange(6, dtype=np.float32).reshape(2, 3)
    access = TensorAccess(buffer)
    assert access.shape == (2, 3)
    assert access.dtype is TensorDType.F32
    view = access.values()
    assert np.shares_memory(view, buffer)
    assert not view.flags.writeable
    with pytest.raises(ValueError):
        view[0, 0] = 42.0
    with pytest.raises(ValueError):
        view.flags.writeable = True
    assert buffer[0, 0] == 0.0
    buffer[1, 2] = 9.0  # the engine's later write is visible: it is a view
    assert view[1, 2] == 9.0


def test_tensor_access_mutation_goes_to_engine_buffer() -> None:
    buffer = np.ones((2, 3), np.float32)
    access = TensorAccess(buffer)
    access.values_mut()[0] *= 0.5
    assert buffer[0].tolist() == [0.5, 0.5, 0.5]
    assert buffer[1].tolist() == [1.0, 1.0, 1.0]
    access.zero()
    assert not buffer.any()
    # a view cannot reshape or resize the engine's array
    mutable = access.values_mut()
    mutable.shape = (3, 2)
    assert buffer.shape == (2, 3)
    with pytest.raises(ValueError):
        mutable.resize((10, 10))


def test_tensor_access_expires() -> None:
    buffer = np.ones((1, 4), np.float32)
    access = TensorAccess(buffer)
    access.release()
    for use in (lambda: access.values(), lambda: access.values_mut(), access.zero,
                lambda: access.shape, lambda: access.dtype):
        with pytest.raises(ExperimentError, match="after its hook returned"):
            use()
    assert buffer.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert "expired" in repr(access)


@pytest.mark.parametrize("array", [
    np.zeros((2, 3), np.float64),
    np.zeros(3, np.float32),
    np.zeros((3, 4), np.float32)[:, ::2],
])
def test_tensor_access_rejects_other_layouts(array: np.ndarray) -> None:
    with pytest.raises(TypeError):
        TensorAccess(array)


def test_failure_message_and_fields() -> None:
    failure = ExperimentFailure("my-experiment", "after_attention", "expected a finite activation",
                                phase=ExecutionPhase.DECODE, layer=7)
    assert str(failure) == (
        "experiment 'my-experiment' failed in after_attention (phase=decode, layer=7): "
        "expected a finite activation")
    assert isinstance(failure, EmberError)
    assert (failure.experiment, failure.hook, failure.phase, failure.layer, failure.message) == (
        "my-experiment", "after_attention", ExecutionPhase.DECODE, 7, "expected a finite activation")
    assert failure.generation is None
    logits = ExperimentFailure("x", "after_logits", "bad", phase=ExecutionPhase.PREFILL)
    assert str(logits) == "experiment 'x' failed in after_logits (phase=prefill): bad"
    loaded = ExperimentFailure("x", "on_model_loaded", "bad")
    assert str(loaded) == "experiment 'x' failed in on_model_loaded: bad"
    copy = pickle.loads(pickle.dumps(failure))
    assert str(copy) == str(failure) and copy.layer == 7
    assert issubclass(ExperimentError, EmberError)
