"""The tiny Phi-3 files the tests write (tests/test_phi3_tiny.py) load in llama.cpp unchanged, and
llama.cpp's logits agree with ember's: fused qkv and gate_up, partial rotary, LongRoPE's factors (long:
a context past the original 8; short: an original context of 512, longer than any context here, even
padded) and the attention factor mean to ember what they mean to llama.cpp.

As tests/test_gemma2_llamacpp.py: a prefill, then one token at a time; llama.cpp keeps an F16 KV cache
(and quantizes activations for Q8_0 weights), so the check is cosine similarity and argmax agreement
rather than a tight tolerance (docs/families.md §0.4).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase
from ember.families.phi3 import build_config, build_forward
from ember.gguf_file import GGUFFile
from ember.weights import WeightStore

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_phi3_tiny import LONG, PROMPT, SHORT, tiny_phi3, write_phi3_gguf  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.reference]

DECODE = [285, 286, 287, 270, 271, 272, 273, 274]
CONTEXT = 64
FACTORS = {  # which factors: the model's settings, the factors ember must then pick at CONTEXT
    "long": ({}, LONG),
    "short": ({"original_max_position_embeddings": 512, "max_position_embeddings": 1024}, SHORT),
}


def ember_logits(path) -> tuple[np.ndarray, np.ndarray]:
    """Logits of every position (the prompt's rows from the prefill, then one row per decode step), and
    the rope factors ember chose."""
    gguf = GGUFFile.open(path)
    forward = build_forward(build_config(gguf), WeightStore(gguf), CONTEXT)
    cache = forward.new_cache(CONTEXT)
    rows = [forward.forward(np.array(PROMPT), 0, cache, forward.new_workspace(len(PROMPT), CONTEXT),
                            DISABLED_HOOKS, ExecutionPhase.PREFILL, all_logits=True)]
    workspace = forward.new_workspace(1, CONTEXT)
    for step, token in enumerate(DECODE):
        rows.append(forward.forward(np.array([token]), len(PROMPT) + step, cache, workspace, DISABLED_HOOKS,
                                    ExecutionPhase.DECODE).copy())
    return np.concatenate(rows), forward.rope_factors


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


@pytest.mark.parametrize("factors", list(FACTORS))
@pytest.mark.parametrize(("qtype", "min_cosine"), [
    (GGMLQuantizationType.F32, 0.9999),
    (GGMLQuantizationType.Q8_0, 0.999),
], ids=["f32", "q8_0"])
def test_llama_cpp_loads_the_file_and_agrees(tmp_path, qtype, min_cosine, factors) -> None:
    settings, chosen = FACTORS[factors]
    path = write_phi3_gguf(tiny_phi3(**settings), tmp_path / "tiny.gguf", qtype)
    ours, ours_factors = ember_logits(path)
    assert ours_factors.tolist() == pytest.approx(chosen)
    theirs = llama_cpp_logits(path)
    vocab = build_config(GGUFFile.open(path)).vocab_size
    assert ours.shape == theirs.shape == (len(PROMPT) + len(DECODE), vocab)
    # position 0 is <bos>, whose embedding the tiny model zeroes: the first layer's input is 0 there
    ours, theirs = ours[1:], theirs[1:]
    cosine = np.sum(ours * theirs, axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    agreement = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    print(f"\n{qtype.name} {factors}: min cosine {cosine.min():.7f}, argmax agreement {agreement:.2f}, "
          f"max |diff| {np.abs(ours - theirs).max():.2e} (max |logit| {np.abs(theirs).max():.2f})")
    assert cosine.min() > min_cosine
    assert agreement == 1.0
