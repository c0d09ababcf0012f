"""The tiny gpt-oss files the tests write (tests/test_gptoss_tiny.py: sinks, sliding layers, YaRN, biases,
MXFP4 experts) load in llama.cpp unchanged, and llama.cpp's logits agree with ember's: what the file
means to llama.cpp (its fixed sliding pattern, attention scale, SwiGLU constants, top-k-then-softmax
gating) is what ember computes.

As tests/test_gemma2_llamacpp.py: a prefill, then one token at a time past the window (4); llama.cpp keeps
an F16 KV cache and quantizes the activations that meet its quantized weights, so ember is compared with
llama.cpp on the file's dequantized F32 copy, tightly, and with llama.cpp on the file itself within
llama.cpp's own rounding (`reference.compare.check_against_llama_cpp`; docs/families.md §0.4).
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

from reference.compare import check_against_llama_cpp  # noqa: E402
from reference.gguf_writer import rewrite_gguf  # noqa: E402
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


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_llama_cpp_loads_the_file_and_agrees(tmp_path, qtype) -> None:
    """The experts are MXFP4 in both files (the rest F32 or Q8_0)."""
    path = write_gptoss_gguf(tiny_gptoss(), tmp_path / "tiny.gguf", qtype)
    ours = ember_logits(path)
    theirs = llama_cpp_logits(path)
    vocab = build_config(GGUFFile.open(path)).vocab_size
    assert ours.shape == theirs.shape == (len(PROMPT) + len(DECODE), vocab)
    dequantized = llama_cpp_logits(rewrite_gguf(path, tmp_path / "f32.gguf", dequantize=True))
    print("\n" + check_against_llama_cpp(ours, theirs, dequantized))
