"""The `gpt-4o` pre-tokenizer (Phi-4-mini, Llama 4: `tokenizer.ggml.pre` = gpt-4o / llama4 / kanana2 /
talkie), against llama.cpp's own regex for it (`llama-vocab.cpp`, LLAMA_VOCAB_PRE_TYPE_GPT4O).

llama.cpp does not run tiktoken's o200k pattern as written: its regex engine sees text with every
non-ASCII character collapsed to its Unicode class, so it rewrites "upper-case letter" as "a letter not in
a-z" and "lower-case letter" as "a letter not in A-Z" (a non-ASCII letter is both). ember splits as
llama.cpp does; on ASCII text that is exactly o200k's split.
"""

from __future__ import annotations

import random

import pytest

from ember.tokenizer.pretokenize import pre_tokenizer, split

regex = pytest.importorskip("regex")

_CONTRACTION = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
# llama.cpp's pattern, verbatim (the second of its two strings; the first is the o200k original, a comment)
LLAMA_CPP = ("[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+" + _CONTRACTION + "?|"
             "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*" + _CONTRACTION + "?|"
             "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
O200K = ("[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
         "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
         "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}|"
         " ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")

TEXTS = [
    "HelloWorld I'M here, aren't you?  12345 x\n\n/path//to\r\n",
    "camelCaseJSONParser's XMLHttpRequest ALLCAPS'LL lower'S",
    "  tabs\t\tand   spaces\n \n",
    "a/b\n/c  /d\r\n//e",
    "École ÜBER straße naïve café ΑΘΗΝΑ Αθήνα мир ПРИВЕТ",
    "日本語テキスト 你好，世界！ 한국어",
    "e\u0301clair cafe\u0301 हिन्दी ไทย",
    "3.14159 + 2,718 = 100000000; $42.00 @user #tag 😀👍🏽",
]


def ours(text: str) -> list[str]:
    return split(text, pre_tokenizer("gpt-4o").compiled())


@pytest.mark.parametrize("text", TEXTS)
def test_split_is_llama_cpp_s(text: str) -> None:
    assert ours(text) == [m.group() for m in regex.finditer(LLAMA_CPP, text)]


def test_random_text_splits_as_llama_cpp() -> None:
    pieces = list("aZéÉßΩωжЖ日ー1٣ ,.'/\n\r\t-") + ["'s", "'LL", "\u0301", "😀", "  ", "\r\n"]
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        assert ours(text) == [m.group() for m in regex.finditer(LLAMA_CPP, text)], repr(text)


@pytest.mark.parametrize("text", TEXTS[:4])
def test_ascii_splits_as_o200k(text: str) -> None:
    """On ASCII text llama.cpp's rewrite is o200k itself."""
    assert ours(text) == [m.group() for m in regex.finditer(O200K, text)]


def test_non_ascii_case_follows_llama_cpp_not_o200k() -> None:
    """"aÄb": o200k ends the lower-case run at the upper-case Ä; llama.cpp (and ember) take Ä as a letter
    of either case, so the word stays whole."""
    assert [m.group() for m in regex.finditer(O200K, "aÄb")] == ["a", "Äb"]
    assert ours("aÄb") == ["aÄb"] == [m.group() for m in regex.finditer(LLAMA_CPP, "aÄb")]


@pytest.mark.parametrize("name", ["gpt-4o", "llama4", "kanana2", "talkie"])
def test_the_names_llama_cpp_maps_to_it(name: str) -> None:
    pre = pre_tokenizer(name)
    assert pre.patterns == pre_tokenizer("gpt-4o").patterns
    assert not pre.clean_spaces and not pre.ignore_merges and not pre.add_bos
