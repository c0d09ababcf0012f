"""The Gemma 4 GGUF files the tests write load in llama.cpp unchanged, and llama.cpp's logits agree with
ember's (issue 6, point 6).

llama.cpp (llama-cpp-python 0.3.36) evaluates the prompt as one batch, then one token at a time past the
sliding window; ember does the same. llama.cpp keeps an F16 KV cache and uses its fp16 GELU table (and
quantizes activations for Q8_0 weights), so the check is cosine similarity and argmax agreement rather
than a tight tolerance (docs/families.md §0.4).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from reference.gemma4_gguf import Gemma4Spec, random_state, tiny_gemma4_vocab, write_gguf

from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase
from ember.families.gemma4 import build_config, build_forward
from ember.gguf_file import GGUFFile
from ember.weights import WeightStore

llama_cpp = pytest.importorskip("llama_cpp")

pytestmark = [pytest.mark.slow]

PROMPT = [2, 280, 281, 282, 283, 290, 291, 292, 293, 294]
DECODE = [285, 286, 287, 300, 301, 302, 303, 304]
CONTEXT = 64


def ember_logits(path) -> np.ndarray:
    """Logits of every position: the prompt's rows from the prefill, then one row per decode step."""
    gguf = GGUFFile.open(path)
    forward = build_forward(build_config(gguf), WeightStore(gguf), CONTEXT)
    cache = forward.new_cache(CONTEXT)
    rows = [forward.forward(np.array(PROMPT), 0, cache, forward.new_workspace(len(PROMPT), CONTEXT),
                            DISABLED_HOOKS, ExecutionPhase.PREFILL, all_logits=True)]
    workspace = forward.new_workspace(1, CONTEXT)
    for step, token in enumerate(DECODE):
        rows.append(forward.forward(np.array([token]), len(PROMPT) + step, cache, workspace, DISABLED_HOOKS,
                                    ExecutionPhase.DECODE).copy())
    return np.concatenate(rows)


def llama_cpp_logits(path) -> np.ndarray:
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=CONTEXT, n_batch=CONTEXT, logits_all=True,
                          n_threads=2, verbose=False)
    try:
        llm.eval(PROMPT)
        for token in DECODE:
            llm.eval([token])
        return np.array(llm.scores[: len(PROMPT) + len(DECODE)], dtype=np.float32)
    finally:
        llm.close()


@pytest.mark.parametrize("qtype, variant, min_cosine", [
    (GGMLQuantizationType.F32, {}, 0.9999),
    (GGMLQuantizationType.F32, {"attention_k_eq_v": True, "num_global_key_value_heads": 1}, 0.9999),
    (GGMLQuantizationType.Q8_0, {}, 0.999),
    (GGMLQuantizationType.F16, {"attention_k_eq_v": True, "num_global_key_value_heads": 1,
                                "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                                "use_double_wide_mlp": False, "tie_word_embeddings": False}, 0.9999),
    # the 26B-A4B layout with its mixture of experts (8 experts, top 2) beside the dense FFN
    (GGMLQuantizationType.F32, {"attention_k_eq_v": True, "num_global_key_value_heads": 1,
                                "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
                                "use_double_wide_mlp": False, "enable_moe_block": True}, 0.9999),
], ids=["f32", "f32-k_eq_v", "q8_0", "f16-dense-untied", "f32-moe"])
def test_llama_cpp_loads_the_file_and_agrees(tmp_path, qtype, variant, min_cosine) -> None:
    spec = Gemma4Spec(vocab_size=len(tiny_gemma4_vocab().tokens), **variant)
    path = write_gguf(tmp_path / "tiny.gguf", spec, random_state(spec, seed=11), qtype=qtype)
    ours = ember_logits(path)
    theirs = llama_cpp_logits(path)
    assert ours.shape == theirs.shape == (len(PROMPT) + len(DECODE), spec.vocab_size)
    cosine = np.sum(ours * theirs, axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    agreement = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    print(f"\n{qtype.name} {variant}: min cosine {cosine.min():.7f}, argmax agreement {agreement:.2f}, "
          f"max |diff| {np.abs(ours - theirs).max():.2e} (max |logit| {np.abs(theirs).max():.1f})")
    assert cosine.min() > min_cosine
    assert agreement == 1.0
