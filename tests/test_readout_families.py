"""The contract's readout (v0.2) on every family: the last layer's output rows through `Readout.logits`
are the model's own logits bit for bit (Gemma 4: with its streamed LM head and final softcap)."""

from __future__ import annotations

import numpy as np
import pytest

from ember.experiments import Experiment


class LastLayer(Experiment):
    name = "last_layer"
    may_write = False

    def __init__(self, layer: int) -> None:
        self.layer = layer
        self.rows: np.ndarray | None = None

    def after_layer(self, ctx, hidden):
        if ctx.layer_index == self.layer and ctx.execution.phase.value == "prefill":
            self.rows = hidden.values().copy()


def check(model, ids: list[int]) -> None:
    seen = LastLayer(model.config.layer_count - 1)
    model.generate(ids, max_new_tokens=1, experiments=[seen])
    assert np.array_equal(model.model_context.readout.logits(seen.rows), model.logits(ids))


def test_gemma4_readout(tmp_path):
    from test_gemma4_engine import PROMPT, tiny_file

    import ember

    _, path = tiny_file(tmp_path)
    check(ember.load_model(path, context_length=64), PROMPT)


def test_gemma3_readout(tmp_path):
    pytest.importorskip("torch")
    from test_gemma3_tiny import tiny_gemma3, write_gemma3_gguf

    import ember

    path = write_gemma3_gguf(tiny_gemma3("default"), tmp_path / "tiny.gguf", "default")
    check(ember.load_model(path), [2, 10, 11, 12, 13, 14, 15])


@pytest.mark.parametrize("family", ["qwen2", "olmo2", "granite", "smollm3"])
def test_llama_variant_readout(family, tmp_path):
    """Granite's: with its logit scale (the LM head divides by it in both places)."""
    pytest.importorskip("torch")
    from reference import tiny_models
    from reference.gguf_writer import write_gguf

    import ember

    path = write_gguf(getattr(tiny_models, f"tiny_{family}")(), tmp_path / f"{family}.gguf")
    check(ember.load_model(path), [1, 40, 71, 100, 33, 259, 120])


def test_gemma2_readout(tmp_path):
    """With its final softcap (3: the logits are bent, so a readout without it would differ)."""
    pytest.importorskip("torch")
    from test_gemma2_tiny import PROMPT, tiny_gemma2, write_gemma2_gguf

    import ember

    check(ember.load_model(write_gemma2_gguf(tiny_gemma2(), tmp_path / "tiny.gguf")), PROMPT)


def test_phi3_readout(tmp_path):
    """Fused qkv and gate_up, partial rotary with LongRoPE."""
    pytest.importorskip("torch")
    from test_phi3_tiny import PROMPT, tiny_phi3, write_phi3_gguf

    import ember

    check(ember.load_model(write_phi3_gguf(tiny_phi3(), tmp_path / "tiny.gguf")), PROMPT)
