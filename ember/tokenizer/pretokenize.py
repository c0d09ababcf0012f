"""llama.cpp's pre-tokenizer regexes, with character classes from Unicode 15.1.

Each pre-tokenizer is a list of regexes applied in sequence: every regex re-splits every piece the
previous one produced, keeping the text between matches as pieces of its own ("isolated" split). The
end of a piece is the end of the text for the next regex (its lookaheads see nothing beyond it).

`\\p{L}` and friends are spelled out from ember's own Unicode 15.1 tables, and `\\s` is the White_Space
property, because llama.cpp's tables are Unicode 15.1 while the `regex` module's follow newer versions.
Case-insensitive contractions are written as `'[sS]`: `(?i)` would also match long s and the Kelvin sign.
"""

from __future__ import annotations

from dataclasses import dataclass

import regex

from ember.errors import TokenizerError
from ember.tokenizer.unicode_tables import RANGES

# llama.cpp's whitespace flag (the Unicode White_Space property).
_WHITESPACE = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
               (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]


def _class_body(ranges: list[tuple[int, int]]) -> str:
    return "".join(f"\\U{a:08X}" if a == b else f"\\U{a:08X}-\\U{b:08X}" for a, b in ranges)


def _parse(text: str) -> list[tuple[int, int]]:
    return [(int(a, 16), int(b, 16)) for a, b in (item.split("-") for item in text.split())]


_CLASSES = {major: _class_body(_parse(text)) for major, text in RANGES.items()}
_CLASSES["WS"] = _class_body(_WHITESPACE)


def _expand(pattern: str) -> str:
    """Replace {L}, {N}, {M}, {P}, {S} and {WS} by class bodies (they go inside [...])."""
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

    def compiled(self) -> list[regex.Pattern]:
        return [_compile(p) for p in self.patterns]


_CACHE: dict[str, regex.Pattern] = {}


def _compile(pattern: str) -> regex.Pattern:
    compiled = _CACHE.get(pattern)
    if compiled is None:
        compiled = _CACHE[pattern] = regex.compile(_expand(pattern), regex.VERSION0)
    return compiled


def split(text: str, patterns: list[regex.Pattern]) -> list[str]:
    """Apply each regex in turn to every piece; unmatched stretches become pieces too."""
    pieces = [text]
    for pattern in patterns:
        out: list[str] = []
        for piece in pieces:
            position = 0
            for match in pattern.finditer(piece):
                start, end = match.span()
                if start > position:
                    out.append(piece[position:start])
                if end > start:
                    out.append(piece[start:end])
                position = end
            if position < len(piece):
                out.append(piece[position:])
        pieces = out
    return pieces


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
