"""The tiny Phi-3 files the tests write (tests/test_phi3_tiny.py) load in llama.cpp unchanged, and
llama.cpp's logits agree with ember's: fused qkv and gate_up, partial rotary, LongRoPE's factors (long:
a context past the original 8; short: an original context of 512, longer than any context here, even
padded) and the attention factor mean to ember what they mean to llama.cpp.

As tests/test_gemma2_llamacpp.py: a prefill, then one token at a time; llama.cpp keeps an F16 KV cache
and quantizes the activations that meet its Q8_0 weights, so ember is compared with llama.cpp on the
file's dequantized F32 copy, tightly, and with llama.cpp on the file itself within llama.cpp's own
rounding (`reference.compare.check_against_llama_cpp`; docs/families.md §0.4).
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

from reference.compare import check_against_llama_cpp  # noqa: E402
from reference.gguf_writer import rewrite_gguf  # noqa: E402
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
@pytest.mark.parametrize("qtype", [GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_llama_cpp_loads_the_file_and_agrees(tmp_path, qtype, factors) -> None:
    settings, chosen = FACTORS[factors]
    path = write_phi3_gguf(tiny_phi3(**settings), tmp_path / "tiny.gguf", qtype)
    ours, ours_factors = ember_logits(path)
    assert ours_factors.tolist() == pytest.approx(chosen)
    theirs = llama_cpp_logits(path)
    vocab = build_config(GGUFFile.open(path)).vocab_size
    assert ours.shape == theirs.shape == (len(PROMPT) + len(DECODE), vocab)
    dequantized = llama_cpp_logits(rewrite_gguf(path, tmp_path / "f32.gguf", dequantize=True))
    # position 0 is <bos>, whose embedding the tiny model zeroes: the first layer's input is 0 there
    print("\n" + check_against_llama_cpp(ours[1:], theirs[1:], dequantized[1:]))
