"""The SentencePiece-style session (`tokenizer.ggml.model = "llama"`), as llama.cpp's `llm_tokenizer_spm`.

No pre-split: the whole fragment (spaces escaped to U+2581, with one leading space when
`add_space_prefix` applies) is one symbol sequence. Adjacent symbols whose concatenation is any
vocabulary token merge, highest token score first; what never became a token falls back to `<0xXX>`
byte tokens, then to a token spelled as that single byte.
"""

from __future__ import annotations

from ember.errors import TokenizerError
from ember.tokenizer.merge import merge_symbols
from ember.tokenizer.vocab import Vocab

ESCAPED_SPACE = "\u2581"


class SpmSession:
    def __init__(self, vocab: Vocab) -> None:
        self._token_to_id = vocab.token_to_id
        self._scores = vocab.scores

    def encode(self, text: str, out: list[int]) -> None:
        token_to_id, scores = self._token_to_id, self._scores

        def priority(left: str, right: str) -> float | None:
            token = token_to_id.get(left + right)
            return None if token is None else -scores[token]

        for symbol in merge_symbols(list(text.replace(" ", ESCAPED_SPACE)), priority):
            token = token_to_id.get(symbol)
            if token is not None:
                out.append(token)
            else:
                out.extend(self._byte_token(b) for b in symbol.encode("utf-8"))

    def _byte_token(self, byte: int) -> int:
        token = self._token_to_id.get(f"<0x{byte:02X}>")
        if token is None and byte < 0x80:
            token = self._token_to_id.get(chr(byte))
        if token is None:
            raise TokenizerError(
                f"the vocabulary has no byte token <0x{byte:02X}> for a character it cannot otherwise spell"
            )
        return token
