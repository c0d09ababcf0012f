"""The tiny qwen2, olmo2, granite, smollm3 and qwen3moe files the tests write load in llama.cpp unchanged,
and llama.cpp's logits agree with ember's: what these files mean to llama.cpp (granite's multipliers,
smollm3's fixed no-rope step, qwen3moe's top-k renormalisation) is what ember computes.

As tests/test_gemma4_llamacpp.py: a prefill, then one token at a time; llama.cpp keeps an F16 KV cache,
so the check is cosine similarity and argmax agreement (docs/families.md §0.4). Skipped where
llama-cpp-python is not installed.
"""

from __future__ import annotations

import numpy as np
import pytest

from ember.experiments.adapters import DISABLED_HOOKS
from ember.experiments.context import ExecutionPhase
from ember.families import FAMILIES
from ember.gguf_file import GGUFFile
from ember.weights import WeightStore

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("torch")

pytestmark = [pytest.mark.slow]

PROMPT = [1, 40, 71, 100, 33, 259, 120, 87, 66, 200]
DECODE = [44, 45, 46, 47, 48]
CONTEXT = 64


def ember_logits(path) -> np.ndarray:
    """Logits of every position: the prompt's rows from the prefill, then one row per decode step."""
    gguf = GGUFFile.open(path)
    family = FAMILIES[gguf.architecture]
    forward = family.build_forward(family.build_config(gguf), WeightStore(gguf), CONTEXT)
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


@pytest.mark.parametrize("family", ["qwen2", "olmo2", "granite", "smollm3", "qwen3moe"])
def test_llama_cpp_loads_the_file_and_agrees(tmp_path, family) -> None:
    from reference import tiny_models
    from reference.gguf_writer import write_gguf

    path = write_gguf(getattr(tiny_models, f"tiny_{family}")(), tmp_path / f"{family}.gguf")
    ours, theirs = ember_logits(path), llama_cpp_logits(path)
    assert ours.shape == theirs.shape
    # a tiny model's padding token (granite's, smollm3's: id 1) embeds as zeros: its logits are zero in both
    zero = np.linalg.norm(theirs, axis=1) == 0
    np.testing.assert_array_equal(ours[zero], 0.0)
    ours, theirs = ours[~zero], theirs[~zero]
    cosine = np.sum(ours * theirs, axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    agreement = float(np.mean(ours.argmax(axis=1) == theirs.argmax(axis=1)))
    print(f"\n{family}: min cosine {cosine.min():.7f}, argmax agreement {agreement:.2f}")
    assert cosine.min() > 0.9999
    assert agreement == 1.0
