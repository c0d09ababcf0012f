"""llama.cpp's pre-tokenizer regexes, with character classes from Unicode 15.1.

Each pre-tokenizer is a list of regexes applied in sequence: every regex re-splits every piece the
previous one produced, keeping the text between matches as pieces of its own ("isolated" split). The
end of a piece is the end of the text for the next regex (its lookaheads see nothing beyond it).

llama.cpp's tables are Unicode 15.1 while the `regex` module's and `tokenizers`' follow newer versions,
so ember classifies characters itself. Like llama.cpp's own fallback it matches on a *collapsed* copy
of the text: every non-ASCII letter, number, mark, punctuation or White_Space character is replaced by
one private-use stand-in for its class (same length, so match offsets carry over to the original), and
the patterns use small classes (`[A-Za-z<L>]`). Unassigned and other characters stay as they are and
belong to no class, as in llama.cpp. Case-insensitive contractions are spelled `'[sS]`: `(?i)` would
also match the long s and the Kelvin sign.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from ember.errors import TokenizerError
from ember.tokenizer.unicode_tables import RANGES

# llama.cpp's whitespace flag (the Unicode White_Space property).
_WHITESPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]

# Private-use stand-ins for non-ASCII members of each class; real U+E000..U+E004 become U+E005 ("other").
_STAND_IN = {"L": "\ue000", "N": "\ue001", "M": "\ue002", "P": "\ue003", "WS": "\ue004"}
_OTHER = 0xE005
_CLASSES = {
    "L": "A-Za-z" + _STAND_IN["L"],
    "N": "0-9" + _STAND_IN["N"],
    "M": _STAND_IN["M"],
    "P": "!\"#%&'()*,\\-./:;?@\\[\\\\\\]_{}" + _STAND_IN["P"],
    "WS": "\\t\\n\\x0b\\x0c\\r " + _STAND_IN["WS"],
}


def _ranges(major: str) -> list[tuple[int, int]]:
    return [(int(a, 16), int(b, 16)) for a, b in (item.split("-") for item in RANGES[major].split())]


@cache
def collapse_table() -> dict[int, int]:
    """str.translate table: non-ASCII code point -> the stand-in of its class (built once, ~140k entries)."""
    table: dict[int, int] = {}
    for major in ("L", "N", "M", "P"):
        stand_in = ord(_STAND_IN[major])
        for first, last in _ranges(major):
            for cp in range(max(first, 0x80), last + 1):
                table[cp] = stand_in
    for first, last in _WHITESPACE:
        for cp in range(max(first, 0x80), last + 1):
            table[cp] = ord(_STAND_IN["WS"])
    for cp in range(0xE000, 0xE005):
        table[cp] = _OTHER
    return table


def collapse(text: str) -> str:
    """`text` with every non-ASCII character replaced by its class stand-in (same length)."""
    return text if text.isascii() else text.translate(collapse_table())


def _expand(pattern: str) -> str:
    """Replace {L}, {N}, {M}, {P} and {WS} by class bodies (they go inside [...])."""
    for name, body in _CLASSES.items():
        pattern = pattern.replace("{" + name + "}", body)
    return pattern


_CONTRACTIONS_CI = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_WS_TAIL = "[{WS}]+(?![^{WS}])|[{WS}]+"

GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{WS}{L}{N}]+|" + _WS_TAIL
LLAMA3 = (_CONTRACTIONS_CI + "|[^\\r\\n{L}{N}]?[{L}]+|[{N}]{1,3}| ?[^{WS}{L}{N}]+[\\r\\n]*|[{WS}]*[\\r\\n]+|"
          + _WS_TAIL)
QWEN2 = (_CONTRACTIONS_CI + "|[^\\r\\n{L}{N}]?[{L}]+|[{N}]| ?[^{WS}{L}{N}]+[\\r\\n]*|[{WS}]*[\\r\\n]+|"
         + _WS_TAIL)
QWEN35 = (_CONTRACTIONS_CI + "|[^\\r\\n{L}{N}]?[{L}{M}]+|[{N}]| ?[^{WS}{L}{M}{N}]+[\\r\\n]*|[{WS}]*[\\r\\n]+|"
          + _WS_TAIL)
# gpt-4o (o200k) as llama.cpp runs it on collapsed text: an upper/lower-case letter is "a letter not in
# a-z" / "not in A-Z", so a non-ASCII letter counts as both; the contraction is the word's suffix
_UPPER, _LOWER = "(?:(?=[{L}])[^a-z])", "(?:(?=[{L}])[^A-Z])"
GPT4O = ("[^\\r\\n{L}{N}]?" + _UPPER + "*" + _LOWER + "+" + _CONTRACTIONS_CI + "?|"
         "[^\\r\\n{L}{N}]?" + _UPPER + "+" + _LOWER + "*" + _CONTRACTIONS_CI + "?|"
         "[{N}]{1,3}| ?[^{WS}{L}{N}]+[\\r\\n/]*|[{WS}]*[\\r\\n]+|" + _WS_TAIL)
DIGIT = "[{N}]"
DEFAULT = ["[{P}\\$\\+<=>\\^~\\|]+", GPT2, "[{N}]+", "[0-9][0-9][0-9]"]
NEWLINE_RUNS = "[^\\n]+|[\\n]+"


@dataclass(frozen=True)
class PreTokenizer:
    """How a `gpt2`/`gemma4` vocabulary pre-splits text, and the flags llama.cpp ties to the pre type."""

    name: str
    patterns: tuple[str, ...]
    ignore_merges: bool = False
    clean_spaces: bool = True
    add_bos: bool = False

    def compiled(self) -> list[re.Pattern[str]]:
        return [_compile(p) for p in self.patterns]


@cache
def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(_expand(pattern))


def split(text: str, patterns: list[re.Pattern[str]]) -> list[str]:
    """Apply each regex in turn to every piece; unmatched stretches become pieces too."""
    collapsed = collapse(text)
    spans = [(0, len(text))]
    for pattern in patterns:
        out: list[tuple[int, int]] = []
        for first, last in spans:
            position = first
            for match in pattern.finditer(collapsed, first, last):
                start, end = match.span()
                if start > position:
                    out.append((position, start))
                if end > start:
                    out.append((start, end))
                position = end
            if position < last:
                out.append((position, last))
        spans = out
    return [text[a:b] for a, b in spans]


def _group(names: str, patterns: list[str], **flags: bool) -> dict[str, PreTokenizer]:
    return {name: PreTokenizer(name, tuple(patterns), **flags) for name in names.split()}


# Names llama.cpp accepts for the regex sets ember implements (llama-vocab.cpp's big `if` chain).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_group("default", DEFAULT),
    **_group("gpt-2 phi-2 jina-es jina-de gigachat mellum modern-bert a.x-4.0 mpt olmo jais", [GPT2]),
    **_group("trillion granite-docling", [GPT2], clean_spaces=False),
    **_group("starcoder refact codeshell exaone minerva mellum2", [DIGIT, GPT2]),
    **_group("smollm command-r", [DIGIT, GPT2], clean_spaces=False),
    **_group("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano", [LLAMA3],
             ignore_merges=True, add_bos=True),
    **_group("dbrx smaug-bpe", [LLAMA3]),
    **_group("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", [QWEN2], clean_spaces=False),
    **_group("megrez stablelm2", [QWEN2]),
    **_group("qwen35", [QWEN35], clean_spaces=False),
    **_group("gemma4", [NEWLINE_RUNS]),
    **_group("gpt-4o llama4 kanana2 talkie", [GPT4O], clean_spaces=False),
}


def pre_tokenizer(name: str | None) -> PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre = name` (None: `default`)."""
    if name is None:
        return PRE_TOKENIZERS["default"]
    try:
        return PRE_TOKENIZERS[name]
    except KeyError:
        known = ", ".join(sorted(PRE_TOKENIZERS))
        raise TokenizerError(
            f"unsupported pre-tokenizer tokenizer.ggml.pre = {name!r}; ember knows: {known}"
        ) from None
