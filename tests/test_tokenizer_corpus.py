"""ember's tokenizer against real llama.cpp on a 373-string corpus, for nine vocabularies (plus GPT-2's
with the `default` pre-tokenizer).

The ids were recorded once by scripts/record_tokenizer_ids.py with llama-cpp-python 0.3.36 (see its
docstring for what each field is). Nothing here needs llama.cpp at test time.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from ember.gguf_file import GGUFFile
from ember.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
FIXTURE_VOCABS = ["gpt-2", "refact", "qwen2", "qwen35", "llama-bpe", "llama-spm", "gemma-4"]


@cache
def corpus() -> list[str]:
    return json.loads((DATA / "tokenizer" / "corpus.json").read_text(encoding="utf-8"))


def recorded(name: str) -> dict:
    return json.loads((DATA / "tokenizer" / f"{name}.json").read_text(encoding="utf-8"))


def as_bytes(value: str | dict) -> bytes:
    return bytes.fromhex(value["hex"]) if isinstance(value, dict) else value.encode("utf-8")


def mismatches(tok: Tokenizer, name: str) -> list[tuple[str, str]]:
    """Every (field, text) where ember differs from llama.cpp."""
    record = recorded(name)
    texts = corpus()
    assert len(record["cases"]) == len(texts) >= 200
    bad = []
    for text, case in zip(texts, record["cases"], strict=True):
        plain = tok.encode(text, add_bos=False)
        special = tok.encode(text, add_bos=False, parse_special=True)
        checks = {
            "plain": plain == case["plain"],
            "special": special == case["special"],
            "server": tok.encode(text, parse_special=True) == case["server"],
            "detok_plain": tok.decode_bytes(case["plain"]) == as_bytes(case["detok_plain"]),
            "detok_special": (
                tok.decode_bytes(case["special"], special=True) == as_bytes(case["detok_special"])
            ),
            "pieces": b"".join(tok.token_to_piece(t) for t in case["special"]) == as_bytes(case["pieces"]),
        }
        bad += [(field, text[:60]) for field, ok in checks.items() if not ok]
        if as_bytes(case["detok_plain"]) == text.encode("utf-8"):  # llama.cpp round-trips: so must ember
            if tok.decode(plain) != text:
                bad.append(("round_trip", text[:60]))
    return bad


def stream(tok: Tokenizer, ids: list[int]) -> str:
    decoder = tok.stream_decoder()
    return "".join(decoder.push(t) for t in ids) + decoder.flush()


@pytest.mark.parametrize("name", FIXTURE_VOCABS)
def test_fixture_vocab_corpus(name: str) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / f"ggml-vocab-{name}.gguf"))
    assert mismatches(tok, name) == []


def test_default_pre_tokenizer_corpus() -> None:
    """llama.cpp's fallback pre-tokenizer (`default`, also used when `pre` is missing), on GPT-2's vocab."""
    metadata = dict(GGUFFile.open(DATA / "vocab" / "ggml-vocab-gpt-2.gguf").metadata)
    metadata["tokenizer.ggml.pre"] = "default"
    tok = Tokenizer.from_metadata(metadata)
    assert mismatches(tok, "gpt-2-default") == []
    assert whole_vocab_mismatches(tok, "gpt-2-default") == []


def test_smollm2_corpus(smollm2_path) -> None:
    tok = Tokenizer.from_gguf(smollm2_path)
    assert recorded("smollm2")["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert mismatches(tok, "smollm2") == []


@pytest.mark.slow
def test_gemma3_corpus(gemma3_path) -> None:
    tok = Tokenizer.from_gguf(gemma3_path)
    assert recorded("gemma3")["sha256"] == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert mismatches(tok, "gemma3") == []


@pytest.mark.parametrize("name", ["llama-spm", "gemma-4", "gpt-2"])
def test_stream_decoder_matches_pieces(name: str) -> None:
    """Streaming gives llama.cpp's concatenated pieces, decoded, whatever the token boundaries."""
    tok = Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / f"ggml-vocab-{name}.gguf"))
    for text, case in zip(corpus(), recorded(name)["cases"], strict=True):
        expected = as_bytes(case["pieces"]).decode("utf-8", errors="replace")
        assert stream(tok, case["special"]) == expected, text[:60]


def whole_vocab_mismatches(tok: Tokenizer, name: str) -> list[int]:
    """NORMAL tokens whose printed text, tokenized alone, gives other ids than llama.cpp's."""
    record = recorded(name)["whole_vocab"]
    other = {int(k): v for k, v in record["other"].items()}
    checked, bad = 0, []
    for token, attr in enumerate(tok.vocab.attrs):
        if attr != 4:
            continue
        try:
            text = tok.token_to_piece(token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text:
            continue
        checked += 1
        if tok.encode(text, add_bos=False) != other.get(token, [token]):
            bad.append(token)
    assert checked == record["checked"]
    return bad


@pytest.mark.parametrize(
    "name",
    ["gpt-2", "refact", "llama-spm"]
    + [pytest.param(n, marks=pytest.mark.slow) for n in ("qwen2", "qwen35", "llama-bpe", "gemma-4")],
)
def test_fixture_whole_vocabulary(name: str) -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / f"ggml-vocab-{name}.gguf"))
    assert whole_vocab_mismatches(tok, name) == []


def test_smollm2_whole_vocabulary(smollm2_path) -> None:
    assert whole_vocab_mismatches(Tokenizer.from_gguf(smollm2_path), "smollm2") == []


@pytest.mark.slow
def test_gemma3_whole_vocabulary(gemma3_path) -> None:
    assert whole_vocab_mismatches(Tokenizer.from_gguf(gemma3_path), "gemma3") == []
