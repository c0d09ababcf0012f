"""llama.cpp's own vocabulary fixtures: every case must give exactly the expected ids.

The files come from llama.cpp's `models/` directory (as vendored in llama-cpp-python 0.3.36): a
vocab-only GGUF, `.inp` with inputs separated by `\\n__ggml_vocab_test__\\n`, and `.out` with the
expected ids (HF tokenizers' output, which llama.cpp's CI asserts it matches), one line per input,
without BOS.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from ember.gguf_file import GGUFFile
from ember.tokenizer import Tokenizer

VOCAB_DIR = Path(__file__).parent / "data" / "vocab"
NAMES = ["gpt-2", "refact", "qwen2", "qwen35", "llama-bpe", "llama-spm", "gemma-4"]
SEPARATOR = "\n__ggml_vocab_test__\n"


@cache
def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(VOCAB_DIR / f"ggml-vocab-{name}.gguf"))


def cases(name: str) -> list[tuple[str, list[int]]]:
    inputs = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split(SEPARATOR)
    if inputs and inputs[-1] == "":
        inputs.pop()
    outputs = (VOCAB_DIR / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(outputs) >= len(inputs) > 40
    return [(text, [int(x) for x in line.split()]) for text, line in zip(inputs, outputs, strict=False)]


@pytest.mark.parametrize("name", NAMES)
def test_every_fixture_case_matches(name: str) -> None:
    tok = tokenizer(name)
    mismatches = [(text, expected, tok.encode(text, add_bos=False)) for text, expected in cases(name)]
    mismatches = [m for m in mismatches if m[1] != m[2]]
    assert mismatches == []


@pytest.mark.parametrize("name", NAMES)
def test_fixture_round_trip(name: str) -> None:
    """Text made only of normal tokens comes back unchanged where llama.cpp's detokenizer keeps it.

    clean_spaces (gpt-2, llama-bpe, refact, gemma-4) rewrites " ," and " 's", so those cases are
    skipped there. SPM's added space prefix is stripped again by the detokenizer.
    """
    tok = tokenizer(name)
    for text, _ in cases(name):
        decoded = tok.decode(tok.encode(text, add_bos=False))
        if tok.vocab.clean_spaces and any(s in text for s in (" ?", " !", " .", " ,", " '")):
            continue
        assert decoded == text
