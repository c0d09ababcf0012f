"""Cutting special and user-defined tokens out of the text (llama.cpp's `tokenizer_st_partition`).

Candidates are the CONTROL, USER_DEFINED and UNKNOWN tokens, longest (in UTF-8 bytes) first.
USER_DEFINED tokens are matched always; CONTROL and UNKNOWN ones only with `parse_special`. Each
candidate splits every remaining text fragment at each of its occurrences, left to right; text already
cut out as a token is never searched again. Matching is on the raw text: no normalization, no escaping.
"""

from __future__ import annotations

import re

from ember.tokenizer.vocab import (
    ATTR_CONTROL,
    ATTR_LSTRIP,
    ATTR_RSTRIP,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    Vocab,
)

Fragment = str | int  # raw text, or a token id already decided

_PREFIX = 3  # candidates are bucketed by their first characters to find the ones present quickly
_C_SPACE = " \t\n\v\f\r"  # C's isspace, what llama.cpp strips beside an LSTRIP / RSTRIP token


class SpecialSplitter:
    """Finds which candidates occur in a text, then cuts them out in llama.cpp's order."""

    def __init__(self, vocab: Vocab) -> None:
        wanted = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        candidates = [i for i, a in enumerate(vocab.attrs) if a & wanted]
        # tokens hold invalid UTF-8 as surrogate escapes (vocab.py): their length is their bytes'
        candidates.sort(key=lambda i: (-len(vocab.tokens[i].encode("utf-8", "surrogateescape")), i))
        self._order = {token: rank for rank, token in enumerate(candidates)}
        self._text = {i: vocab.tokens[i] for i in candidates}
        self._always = {i for i in candidates if not vocab.attrs[i] & (ATTR_CONTROL | ATTR_UNKNOWN)}
        self._lstrip = {i for i in candidates if vocab.attrs[i] & ATTR_LSTRIP}
        self._rstrip = {i for i in candidates if vocab.attrs[i] & ATTR_RSTRIP}
        self._short: list[int] = []
        self._buckets: dict[str, list[int]] = {}
        for i in candidates:
            text = self._text[i]
            if len(text) < _PREFIX:
                self._short.append(i)
            else:
                self._buckets.setdefault(text[:_PREFIX], []).append(i)
        starts = sorted({t[0] for t in self._text.values() if len(t) >= _PREFIX})
        self._starts = re.compile("[" + "".join(re.escape(c) for c in starts) + "]") if starts else None

    def _present(self, text: str, parse_special: bool) -> list[int]:
        found: set[int] = set()
        for i in self._short:
            if self._text[i] in text:
                found.add(i)
        if self._starts is not None:
            buckets = self._buckets
            for match in self._starts.finditer(text):
                position = match.start()
                for i in buckets.get(text[position:position + _PREFIX], ()):
                    if text.startswith(self._text[i], position):
                        found.add(i)
        if not parse_special:
            found &= self._always
        return sorted(found, key=self._order.__getitem__)

    def split(self, text: str, parse_special: bool) -> list[Fragment]:
        if not text:
            return []
        fragments: list[Fragment] = [text]
        for token in self._present(text, parse_special):
            needle = self._text[token]
            out: list[Fragment] = []
            for fragment in fragments:
                if isinstance(fragment, int) or needle not in fragment:
                    out.append(fragment)
                    continue
                parts = fragment.split(needle)
                last = len(parts) - 1
                for k, part in enumerate(parts):
                    if k:
                        out.append(token)
                        if token in self._rstrip:
                            part = part.lstrip(_C_SPACE)
                    if k < last and token in self._lstrip:
                        part = part.rstrip(_C_SPACE)
                    if part:
                        out.append(part)
            fragments = out
        return fragments
