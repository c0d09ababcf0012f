"""Tokenizer API: special ids, BOS rules, attributes, errors, decoding and streaming."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ember.errors import TokenizerError
from ember.gguf_file import GGUFFile
from ember.tokenizer import Tokenizer

DATA = Path(__file__).parent / "data"
FIXTURE_VOCABS = ["gpt-2", "refact", "qwen2", "qwen35", "llama-bpe", "llama-spm", "gemma-4"]


def fixture(name: str) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / f"ggml-vocab-{name}.gguf"))


def fixture_metadata(name: str) -> dict:
    return dict(GGUFFile.open(DATA / "vocab" / f"ggml-vocab-{name}.gguf").metadata)


def check_vocab_facts(tok: Tokenizer, name: str) -> None:
    """Special ids, add_bos, the EOG set and token attributes equal what llama.cpp reported.

    `eot` is left out: when several end-of-turn texts exist and the file names none, llama.cpp takes
    the first in its hash-map order (qwen2: <|im_end|>; SmolLM2: <|endoftext|>); ember takes the lowest id.
    """
    facts = json.loads((DATA / "tokenizer" / f"{name}.json").read_text(encoding="utf-8"))["vocab_facts"]
    assert tok.vocab_size == facts["n_tokens"]
    for role in (
        "bos",
        "eos",
        "sep",
        "pad",
        "fim_pre",
        "fim_suf",
        "fim_mid",
        "fim_pad",
        "fim_rep",
        "fim_sep",
    ):
        assert tok.vocab.special[role] == facts["special"][role], role
    assert tok.add_bos == facts["add_bos"]
    assert tok.vocab.add_eos == facts["add_eos"]
    assert tok.eog_ids == frozenset(facts["eog"])
    attrs = {str(i): a for i, a in enumerate(tok.vocab.attrs) if a != 4}
    assert attrs == facts["attrs"]


@pytest.mark.parametrize("name", FIXTURE_VOCABS)
def test_vocab_facts_match_llama_cpp(name: str) -> None:
    check_vocab_facts(fixture(name), name)


def test_smollm2_vocab_facts(smollm2_path) -> None:
    tok = Tokenizer.from_gguf(smollm2_path)
    check_vocab_facts(tok, "smollm2")
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (1, 2, 0, 2)
    assert tok.eog_ids == {0, 2, 4}
    assert tok.encode("Hello") == [19556]  # no BOS by default for SmolLM2


@pytest.mark.slow
def test_gemma3_vocab_facts(gemma3_path) -> None:
    tok = Tokenizer.from_gguf(gemma3_path)
    check_vocab_facts(tok, "gemma3")
    assert tok.encode("Hello")[0] == 2
    assert not tok.has_chat_template


def test_gemma4_ids_and_forced_bos() -> None:
    metadata = fixture_metadata("gemma-4")
    metadata["tokenizer.ggml.add_bos_token"] = False  # llama.cpp forces BOS for gemma4 anyway
    tok = Tokenizer.from_metadata(metadata)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (2, 1, 0, 3)
    assert tok.eog_ids == {1, 106, 50}
    assert tok.encode("") == [2]
    assert tok.encode("<|turn>user\nHi<turn|>", parse_special=True) == [2, 105, 2364, 107, 10979, 106]
    assert tok.encode("", add_bos=False) == []


def test_bos_defaults_per_type() -> None:
    assert fixture("llama-spm").encode("") == [1]
    assert fixture("llama-bpe").encode("Hello")[0] == 128000
    assert fixture("qwen2").encode("") == []
    assert fixture("llama-bpe").encode("<|begin_of_text|>Hello", parse_special=True) == [128000, 128000, 9906]


def test_special_tokens_in_text() -> None:
    qwen = fixture("qwen2")
    im_start = qwen.token_id("<|im_start|>")
    assert qwen.encode("<|im_start|>user", parse_special=True)[0] == im_start
    assert im_start not in qwen.encode("<|im_start|>user")
    # Qwen's ordinary `</s>` is made CONTROL by llama.cpp: one token with parse_special, hidden in decode
    (s_token,) = qwen.encode("</s>", parse_special=True)
    assert (
        s_token == 128247 and qwen.decode([s_token]) == "" and qwen.decode([s_token], special=True) == "</s>"
    )
    spm = fixture("llama-spm")
    assert spm.encode("a<s>b", add_bos=False, parse_special=True) == [
        spm.token_id("▁a"),
        1,
        spm.token_id("▁b"),
    ]


def test_user_defined_tokens_match_without_parse_special() -> None:
    gemma4 = fixture("gemma-4")
    assert gemma4.encode("<|channel>", add_bos=False) == [100]
    assert gemma4.encode("<|turn>", add_bos=False) != [105]
    assert gemma4.decode([100]) == "<|channel>"  # USER_DEFINED always prints


def test_unknown_vocab_type_is_named() -> None:
    metadata = fixture_metadata("gpt-2")
    metadata["tokenizer.ggml.model"] = "t5"
    with pytest.raises(TokenizerError, match="'t5'"):
        Tokenizer.from_metadata(metadata)


def test_unknown_pre_tokenizer_is_named() -> None:
    metadata = fixture_metadata("gpt-2")
    metadata["tokenizer.ggml.pre"] = "qwen3"
    with pytest.raises(TokenizerError, match="'qwen3'"):
        Tokenizer.from_metadata(metadata)


def test_missing_merges_and_missing_tokenizer() -> None:
    metadata = fixture_metadata("gemma-4")
    del metadata["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(metadata)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({"general.architecture": "llama"})


def test_from_gguf_accepts_a_path_and_rejects_other_things() -> None:
    tok = Tokenizer.from_gguf(DATA / "vocab" / "ggml-vocab-gpt-2.gguf")
    assert tok.decode(tok.encode("Hello world")) == "Hello world"
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf(42)


def test_missing_pre_means_default() -> None:
    metadata = fixture_metadata("gpt-2")
    del metadata["tokenizer.ggml.pre"]
    tok = Tokenizer.from_metadata(metadata)
    assert tok.vocab.pre.name == "default"
    assert tok.decode(tok.encode("Hello, world! 12345")) == "Hello, world! 12345"


def test_decode_rejects_ids_outside_the_vocabulary() -> None:
    tok = fixture("gpt-2")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    assert tok.decode(np.array(tok.encode("abc"), dtype=np.int64)) == "abc"


def test_clean_spaces_follows_the_pre_type() -> None:
    assert fixture("llama-bpe").decode(fixture("llama-bpe").encode("I 'm here , ok ?")) == "I'm here, ok?"
    assert fixture("qwen2").decode(fixture("qwen2").encode("I 'm here , ok ?")) == "I 'm here , ok ?"


def stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.stream_decoder()
    return [decoder.push(t) for t in ids] + [decoder.flush()]


def test_stream_decoder_holds_back_split_characters() -> None:
    spm = fixture("llama-spm")
    llama_bytes = [spm.token_id(f"<0x{b:02X}>") for b in "🦙".encode()]
    assert stream(spm, llama_bytes) == ["", "", "", "🦙", ""]
    assert stream(spm, [spm.token_id("▁Hello"), *llama_bytes]) == [" Hello", "", "", "", "🦙", ""]
    # an unfinished character at the end becomes U+FFFD, never raw bytes
    assert stream(spm, llama_bytes[:2]) == ["", "", "\ufffd"]
    # byte-level BPE splits characters too
    gpt2 = fixture("gpt-2")
    ids = gpt2.encode("数据 🦙!")
    assert "".join(stream(gpt2, ids)) == "数据 🦙!"
    assert all("\ufffd" not in piece for piece in stream(gpt2, ids))


def test_stream_decoder_hides_control_tokens() -> None:
    qwen = fixture("qwen2")
    ids = qwen.encode("<|im_start|>Hi<|im_end|>", parse_special=True)
    assert "".join(stream(qwen, ids)) == "Hi"
    decoder = qwen.stream_decoder(special=True)
    assert "".join(decoder.push(t) for t in ids) == "<|im_start|>Hi<|im_end|>"


def test_text_that_is_not_unicode_is_refused() -> None:
    tok = fixture("gpt-2")
    with pytest.raises(TokenizerError, match="surrogate"):
        tok.encode("a\udc80b")
    with pytest.raises(TokenizerError, match="str"):
        tok.encode(b"bytes")
