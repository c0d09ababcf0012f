"""Token ids back to text, as llama.cpp's `token_to_piece` and `detokenize`, plus a streaming decoder.

Pieces are bytes: byte tokens and byte-level BPE pieces can split a UTF-8 character, so text is only
formed from a complete sequence (`detokenize`) or through an incremental decoder that holds back an
unfinished character (`StreamDecoder`).
"""

from __future__ import annotations

import codecs

from ember.errors import TokenizerError
from ember.tokenizer.bpe import UNICODE_TO_BYTE
from ember.tokenizer.vocab import (
    ATTR_BYTE,
    ATTR_CONTROL,
    ATTR_NORMAL,
    ATTR_UNKNOWN,
    ATTR_USER_DEFINED,
    BPE,
    Vocab,
)

_HIDDEN = ATTR_CONTROL | ATTR_UNKNOWN


class PieceTable:
    """Each token's bytes as llama.cpp prints it with `special=true`, computed on first use."""

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab
        self._byte_level = vocab.model == BPE and not vocab.escape_whitespaces
        self._pieces: dict[int, bytes] = {}

    def piece(self, token: int, special: bool) -> bytes:
        vocab = self._vocab
        if not 0 <= token < vocab.size:
            raise TokenizerError(f"token id {token} is outside the vocabulary (0..{vocab.size - 1})")
        if not special and vocab.attrs[token] & _HIDDEN:
            return b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self._make(token)
        return piece

    def _make(self, token: int) -> bytes:
        attr, text = self._vocab.attrs[token], self._vocab.tokens[token]
        if attr & (_HIDDEN | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & ATTR_NORMAL:
            if self._byte_level:
                return _byte_level_decode(text)
            return text.replace("\u2581", " ").encode("utf-8", "surrogateescape")
        if attr & ATTR_BYTE:
            return bytes([int(text[3:5], 16)])
        return b""  # UNUSED and UNDEFINED tokens print nothing


def _byte_level_decode(text: str) -> bytes:
    out = bytearray()
    for char in text:
        byte = UNICODE_TO_BYTE.get(char)
        if byte is not None:
            out.append(byte)
        else:  # llama.cpp's marker for a character outside the byte table
            out += b"[UNK_BYTE_0x" + char.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def detokenize(vocab: Vocab, pieces: PieceTable, ids: list[int], *, remove_special: bool = False,
               unparse_special: bool = False) -> bytes:
    """llama.cpp's `llama_detokenize(tokens, remove_special, unparse_special)`, as bytes."""
    ids = list(ids)
    remove_space = vocab.add_space_prefix
    if remove_special and vocab.add_bos and ids and ids[0] == vocab.special["bos"]:
        remove_space = False
        ids = ids[1:]
    if remove_special and vocab.add_eos and ids and ids[-1] == vocab.special["eos"]:
        ids = ids[:-1]
    out = bytearray()
    for position, token in enumerate(ids):
        piece = pieces.piece(token, unparse_special)
        if position == 0 and remove_space and piece.startswith(b" "):
            piece = piece[1:]
        out += piece
    if vocab.clean_spaces:
        out = _clean_spaces(out)
    return bytes(out)


def _clean_spaces(text: bytearray) -> bytearray:
    """llama.cpp's three clean-up passes over the detokenized bytes."""
    space, quote = ord(" "), ord("'")
    # 1: no space before ? ! . ,
    out = bytearray(text[:1])
    for i in range(1, len(text)):
        if text[i - 1] == space and text[i] in b"?!.,":
            out.pop()
        out.append(text[i])
    # 2: " ' " becomes "'"
    text, out = out, bytearray(out[:1])
    i, n = 1, len(text)
    while i < n:
        char = text[i]
        if char == quote and i + 1 < n and text[i - 1] == space and text[i + 1] == space:
            out.pop()
            i += 1
            text[i] = 0  # llama.cpp overwrites the skipped space, so the next check sees no space
        out.append(char)
        i += 1
    # 3: no space before 's 'm 're 've (kept before 't 'd 'll)
    text, out = out, bytearray(out[:1])
    n = len(text)
    for i in range(1, n):
        char = text[i]
        if text[i - 1] == space and char == quote and i + 1 < n:
            after = text[i + 1]
            if after in b"sm":
                out.pop()
            elif after not in b"td" and i + 2 < n and text[i + 1:i + 3] in (b"re", b"ve"):
                out.pop()
        out.append(char)
    return out


class StreamDecoder:
    """Turns generated ids into text piece by piece, holding back an unfinished UTF-8 character.

    Like llama-server's streaming: pieces as `token_to_piece(special)` gives them, no clean-up passes.
    Bytes that can never form a character come out as U+FFFD, so the text is always valid.
    """

    def __init__(self, pieces: PieceTable, *, special: bool = False) -> None:
        self._pieces = pieces
        self._special = special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._pieces.piece(int(token_id), self._special))

    def flush(self) -> str:
        """Whatever is held back (an unfinished character becomes U+FFFD); the decoder starts afresh."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
