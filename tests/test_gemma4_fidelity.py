"""Gemma 4 against transformers: a tiny random Gemma4ForCausalLM written to GGUF as llama.cpp's converter
writes it, run by ember and by HF (float32, eager) over a prefill and decode steps that cross the
sliding window; every boundary of every layer and the logits must agree within 1e-4 relative.

The tiny model (tests/reference/gemma4_gguf.py `Gemma4Spec`): 7 layers s F s F s s F with the last 3
sharing KV (layer 2 sliding and layer 3 full just before them, the order llama.cpp's reuse rule needs),
PLE on, double-wide FFN on the shared layers, softcap 30, window 6 < prompt 10, random norm weights and
layer scalars, 309-token vocabulary; one variant with attention_k_eq_v (no attn_v on full layers, one KV
head there, so head_count_kv is a per-layer array).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.gemma4_gguf import (
    Gemma4Spec,
    dequantized_state,
    random_state,
    tiny_gemma4_vocab,
    write_gguf,
)

from ember.experiments.context import ExecutionPhase
from ember.families.gemma4 import build_config, build_forward
from ember.gguf_file import GGUFFile
from ember.weights import WeightStore

pytestmark = [pytest.mark.reference]

TOLERANCE = 1e-4
PROMPT = [2, 280, 281, 282, 283, 290, 291, 292, 293, 294]  # 10 tokens, window 6
DECODE = [285, 286, 287, 300, 301, 302, 303, 304]  # positions 10…17
BOUNDARIES = ("before_layer", "after_attention", "after_mlp", "after_layer")


class Recorder:
    """A hooks adapter that keeps a copy of every boundary value, per evaluation."""

    def __init__(self) -> None:
        self.evaluations: list[dict] = []

    def begin_evaluation(self, phase, start_position, token_count) -> None:
        self.evaluations.append({"start": start_position, **{b: [] for b in BOUNDARIES}})

    def _keep(self, boundary: str, value: np.ndarray) -> None:
        assert value.dtype == np.float32 and value.ndim == 2 and value.flags.c_contiguous
        self.evaluations[-1][boundary].append(value.copy())

    listening = frozenset()  # none of the on-demand stages inside attention (ember.stages.listened)

    def before_layer(self, i, hidden) -> None:
        self._keep("before_layer", hidden)

    def attention_heads(self, i, heads) -> None:
        pass

    def after_attention(self, i, value) -> None:
        self._keep("after_attention", value)

    def after_mlp(self, i, value) -> None:
        self._keep("after_mlp", value)

    def after_layer(self, i, hidden) -> None:
        self._keep("after_layer", hidden)

    def before_logits(self, hidden) -> None:
        self.evaluations[-1]["final_norm"] = hidden.copy()

    def after_logits(self, logits) -> None:
        self.evaluations[-1]["logits"] = logits.copy()


def run_ember(path, prompt: list[int], decode: list[int], context: int = 64) -> list[dict]:
    gguf = GGUFFile.open(path)
    config = build_config(gguf)
    forward = build_forward(config, WeightStore(gguf), context)
    cache = forward.new_cache(context)
    recorder = Recorder()
    forward.forward(np.array(prompt), 0, cache, forward.new_workspace(len(prompt), context), recorder,
                    ExecutionPhase.PREFILL)
    workspace = forward.new_workspace(1, context)
    for step, token in enumerate(decode):
        forward.forward(np.array([token]), len(prompt) + step, cache, workspace, recorder,
                        ExecutionPhase.DECODE)
    return recorder.evaluations


def relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours - reference)) / max(np.max(np.abs(reference)), 1e-30))


def compare(ours: list[dict], theirs) -> dict[str, float]:
    """Worst relative error per boundary over every evaluation and layer; asserts each is within tolerance."""
    worst: dict[str, float] = {}
    assert len(ours) == len(theirs)
    for evaluation, reference in zip(ours, theirs, strict=True):
        assert evaluation["start"] == reference.start_position
        for boundary in BOUNDARIES:
            for layer, (value, expected) in enumerate(zip(evaluation[boundary], getattr(reference, boundary),
                                                          strict=True)):
                error = relative_error(value, expected)
                worst[boundary] = max(worst.get(boundary, 0.0), error)
                assert error < TOLERANCE, (boundary, layer, reference.start_position, error)
        # ember exposes the last row at the logits boundaries
        for key, expected in (("final_norm", reference.final_norm[-1:]), ("logits", reference.logits[-1:])):
            error = relative_error(evaluation[key], expected)
            worst[key] = max(worst.get(key, 0.0), error)
            assert error < TOLERANCE, (key, reference.start_position, error)
    return worst


K_EQ_V = {"attention_k_eq_v": True, "num_global_key_value_heads": 1}
CASES = {  # name: (spec changes, file type)
    "base": ({}, GGMLQuantizationType.F32),
    "k_eq_v": (K_EQ_V, GGMLQuantizationType.F32),
    # a Q8_0 file (every table quantized, the LM head streamed from Q8_0 rows): HF gets exactly the
    # dequantized weights, so the tolerance stays the same
    "k_eq_v-q8_0": (K_EQ_V, GGMLQuantizationType.Q8_0),
    # the 31B-style dense layout: no PLE, no KV sharing, k_eq_v, and an untied LM head (`output.weight`)
    "dense-untied": ({**K_EQ_V, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                      "use_double_wide_mlp": False, "tie_word_embeddings": False}, GGMLQuantizationType.F32),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    from reference.gemma4_reference import build_hf, capture

    changes, qtype = CASES[request.param]
    spec = Gemma4Spec(vocab_size=len(tiny_gemma4_vocab().tokens), **changes)
    state = random_state(spec, seed=7)
    path = write_gguf(tmp_path_factory.mktemp("gemma4") / f"{request.param}.gguf", spec, state, qtype=qtype)
    if qtype != GGMLQuantizationType.F32:
        state = dequantized_state(path, spec)
    model = build_hf(spec, state)
    return request.param, spec, model, path, capture(model, PROMPT, DECODE)


def test_every_boundary_matches_transformers(case) -> None:
    name, spec, model, path, reference = case
    worst = compare(run_ember(path, PROMPT, DECODE), reference)
    figures = ", ".join(f"{k} {v:.2e}" for k, v in worst.items())
    print(f"\n{name}: worst relative error per boundary: {figures}")


def test_the_window_and_sharing_matter(case) -> None:
    """Guards against a vacuous pass: the reference itself changes when the window or softcap is ignored."""
    name, spec, model, path, reference = case
    # HF's decode logits equal its own full-sequence prefill (the cache path is sound) ...
    import torch

    with torch.no_grad():
        full = model(input_ids=torch.tensor([PROMPT + DECODE])).logits[0].numpy()
    last = len(PROMPT) + len(DECODE) - 1
    assert relative_error(reference[-1].logits[-1], full[last]) < TOLERANCE
    # ... and a model without the window gives different logits past it.
    from reference.gemma4_reference import build_hf, hf_state

    wide = build_hf(dataclasses.replace(spec, sliding_window=64), hf_state(model))
    with torch.no_grad():
        unwindowed = wide(input_ids=torch.tensor([PROMPT + DECODE])).logits[0].numpy()
    assert relative_error(unwindowed[last], full[last]) > 1e-3


def test_shared_layers_hold_no_cache(case) -> None:
    name, spec, model, path, reference = case
    if not spec.num_kv_shared_layers:
        pytest.skip("no KV sharing in this case")
    gguf = GGUFFile.open(path)
    config = build_config(gguf)
    forward = build_forward(config, WeightStore(gguf), 32)
    cache = forward.new_cache(32)
    assert len(cache.layers) == spec.first_shared_layer
    assert config.kv_source == tuple(range(spec.first_shared_layer)) + (2, 2, 3)
    for i in range(spec.first_shared_layer, spec.num_hidden_layers):
        assert f"blk.{i}.attn_k.weight" not in gguf.tensors
        assert f"blk.{i}.attn_v.weight" not in gguf.tensors
