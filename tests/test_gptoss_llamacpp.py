"""The tiny gpt-oss files the tests write (tests/test_gptoss_tiny.py: sinks, sliding layers, YaRN, biases,
MXFP4 experts) load in llama.cpp unchanged, and llama.cpp's logits agree with ember's: what the file
means to llama.cpp (its fixed sliding pattern, attention scale, SwiGLU constants, top-k-then-softmax
gating) is what ember computes.

As tests/test_gemma2_llamacpp.py: a prefill, then one token at a time past the window (4); llama.cpp keeps
an F16 KV cache (and quantizes activations for its quantized products), so the check is cosine
similarity and argmax agreement rather than a tight tolerance (docs/families.md §0.4).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase
from ember.families.gptoss import build_config, build_forward
from ember.gguf_file import GGUFFile
from ember.weights import WeightStore

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_gptoss_tiny import PROMPT, tiny_gptoss, write_gptoss_gguf  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.reference]

DECODE = [43, 161, 197, 232, 213, 50, 51, 52]
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


@pytest.mark.parametrize(("qtype", "min_cosine"), [
    (GGMLQuantizationType.F32, 0.9999),
    (GGMLQuantizationType.Q8_0, 0.999),
], ids=["f32", "q8_0"])
def test_llama_cpp_loads_the_file_and_agrees(tmp_path, qtype, min_cosine) -> None:
    path = write_gptoss_gguf(tiny_gptoss(), tmp_path / "tiny.gguf", qtype)
    ours = ember_logits(path)
    theirs = llama_cpp_logits(path)
    vocab = build_config(GGUFFile.open(path)).vocab_size
    assert ours.shape == theirs.shape == (len(PROMPT) + len(DECODE), vocab)
    cosine = np.sum(ours * theirs, axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    agreement = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    print(f"\n{qtype.name}: min cosine {cosine.min():.7f}, argmax agreement {agreement:.2f}, "
          f"max |diff| {np.abs(ours - theirs).max():.2e} (max |logit| {np.abs(theirs).max():.2f})")
    assert cosine.min() > min_cosine
    assert agreement == 1.0
