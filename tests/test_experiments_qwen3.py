"""The hook contract on the qwen3 family (QK-norm, NEOX rope): a tiny random Qwen3 written as GGUF the
way llama.cpp's converter does (tests/reference), loaded by ember. Checks the call sequence and the
family-independent meaning of the intervention boundaries."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from reference.gguf_writer import write_gguf  # noqa: E402
from reference.tiny_models import tiny_qwen3  # noqa: E402

import ember  # noqa: E402
from ember.experiments import Experiment, ModelFamily, TensorAccess, ZeroLayerOutput  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.slow]

PROMPT = [40, 71, 100, 33, 259, 120, 87]
LAYER_HOOKS = ("before_layer", "after_attention", "after_mlp", "after_layer")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = write_gguf(tiny_qwen3(), tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf")
    return ember.load_model(path)


class Capture(Experiment):
    name = "capture"

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int | None, int, int, np.ndarray]] = []
        self.model: Any = None

    def on_model_loaded(self, ctx): self.model = ctx

    def _keep(self, hook: str, ctx: Any, tensor: TensorAccess) -> None:
        execution = getattr(ctx, "execution", ctx)
        self.seen.append((hook, execution.phase.value, getattr(ctx, "layer_index", None),
                          execution.start_position, execution.input_token_count, tensor.values().copy()))

    def before_layer(self, ctx, hidden): self._keep("before_layer", ctx, hidden)
    def after_attention(self, ctx, attention_output): self._keep("after_attention", ctx, attention_output)
    def after_mlp(self, ctx, mlp_output): self._keep("after_mlp", ctx, mlp_output)
    def after_layer(self, ctx, hidden): self._keep("after_layer", ctx, hidden)
    def before_logits(self, ctx, hidden): self._keep("before_logits", ctx, hidden)
    def after_logits(self, ctx, logits): self._keep("after_logits", ctx, logits)

    def logits(self) -> list[np.ndarray]:
        return [entry[5] for entry in self.seen if entry[0] == "after_logits"]


def test_qwen3_call_sequence(qwen3: Any) -> None:
    capture = Capture()
    qwen3.generate(PROMPT, max_new_tokens=3, stop_at_eog=False, experiments=[capture])
    config = qwen3.config
    assert capture.model.family is ModelFamily.QWEN3 and capture.model.architecture == "qwen3"
    expected = []
    for phase, start, count in [("prefill", 0, 7), ("decode", 7, 1), ("decode", 8, 1)]:
        for layer in range(config.layer_count):
            shape = (count, config.hidden_size)
            expected += [(hook, phase, layer, start, count, shape) for hook in LAYER_HOOKS]
        expected.append(("before_logits", phase, None, start, count, (1, config.hidden_size)))
        expected.append(("after_logits", phase, None, start, count, (1, config.vocab_size)))
    assert [entry[:5] + (entry[5].shape,) for entry in capture.seen] == expected


def test_qwen3_zero_attention_equals_zeroed_o_projection(qwen3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    hooked = Capture()
    tokens = qwen3.generate(PROMPT, max_new_tokens=4, stop_at_eog=False,
                            experiments=[ZeroLayerOutput(layer=1, target="attention"), hooked]).token_ids
    weights = qwen3._forward.weights.layers[1]
    monkeypatch.setattr(weights, "attn_output", np.zeros(weights.attn_output.shape, np.float32))
    reference = Capture()
    reference_tokens = qwen3.generate(PROMPT, max_new_tokens=4, stop_at_eog=False,
                                      experiments=[reference]).token_ids
    monkeypatch.undo()
    assert tokens == reference_tokens
    for a, b in zip(hooked.logits(), reference.logits(), strict=True):
        assert a.tobytes() == b.tobytes()


def test_qwen3_zero_both_passes_residual_through(qwen3: Any) -> None:
    capture = Capture()
    qwen3.generate(PROMPT, max_new_tokens=2, stop_at_eog=False,
                   experiments=[ZeroLayerOutput(layer=2), capture])
    by_key = {(e[0], e[1], e[2]): e[5] for e in capture.seen}
    for phase in ("prefill", "decode"):
        assert np.array_equal(by_key[("after_layer", phase, 2)], by_key[("before_layer", phase, 2)])
        assert not np.array_equal(by_key[("after_layer", phase, 1)], by_key[("before_layer", phase, 1)])
