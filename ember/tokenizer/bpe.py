"""BPE sessions: `gpt2` (byte-level, regex pre-split) and `gemma4` (raw UTF-8 with U+2581 spaces).

Per raw fragment, as llama.cpp's `llm_tokenizer_bpe_session`: escape spaces (gemma4), pre-split with
the pre-tokenizer's regexes, byte-encode each piece (gpt2), then per piece:
* `ignore_merges` (llama3 family): a piece that is itself a token is emitted whole;
* gemma4: a piece made only of newlines that is a token is emitted whole;
* otherwise merge by rank, and emit each final symbol, falling back to single-byte tokens
  (`<0xXX>` for gemma4, the raw one-byte text for gpt2) and silently dropping what has none.
"""

from __future__ import annotations

from ember.tokenizer.merge import merge_symbols
from ember.tokenizer.pretokenize import split
from ember.tokenizer.vocab import GEMMA4, Vocab

ESCAPED_SPACE = "\u2581"
_CACHEABLE = 256  # pieces up to this many characters are memoized


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (llama.cpp's unicode_byte_to_utf8)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}
_LATIN1_TO_BYTE_CHARS = {b: c for b, c in BYTE_TO_UNICODE.items()}  # str.translate table on latin-1 text


class BpeSession:
    def __init__(self, vocab: Vocab) -> None:
        assert vocab.pre is not None
        self._token_to_id = vocab.token_to_id
        self._ranks = vocab.merges
        self._patterns = vocab.pre.compiled()
        self._byte_encode = vocab.model != GEMMA4
        self._escape = vocab.escape_whitespaces
        self._ignore_merges = vocab.pre.ignore_merges
        self._newline_rule = vocab.pre.name == "gemma4"
        self._cache: dict[str, list[int]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        if self._escape:
            text = text.replace(" ", ESCAPED_SPACE)
        cache = self._cache
        for piece in split(text, self._patterns):
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece)
                if len(piece) <= _CACHEABLE:
                    if len(cache) > 200_000:
                        cache.clear()
                    cache[piece] = ids
            out.extend(ids)

    def _encode_piece(self, piece: str) -> list[int]:
        token_to_id = self._token_to_id
        if self._byte_encode:
            piece = piece.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)
        if self._ignore_merges and piece in token_to_id:
            return [token_to_id[piece]]
        if self._newline_rule and piece in token_to_id and not piece.strip("\n"):
            return [token_to_id[piece]]
        ranks = self._ranks
        symbols = merge_symbols(list(piece), lambda a, b: ranks.get(a + " " + b))
        ids: list[int] = []
        for symbol in symbols:
            token = token_to_id.get(symbol)
            if token is not None:
                ids.append(token)
                continue
            for byte in symbol.encode("utf-8"):
                if self._byte_encode:
                    token = token_to_id.get(chr(byte)) if byte < 0x80 else None
                else:
                    token = token_to_id.get(f"<0x{byte:02X}>")
                if token is not None:
                    ids.append(token)
        return ids
