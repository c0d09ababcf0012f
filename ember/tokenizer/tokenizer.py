"""`Tokenizer`: llama.cpp-exact encoding and decoding from GGUF `tokenizer.*` metadata."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from ember.errors import TokenizerError
from ember.tokenizer.bpe import BpeSession
from ember.tokenizer.chat import ChatTemplate
from ember.tokenizer.decode import PieceTable, StreamDecoder, detokenize
from ember.tokenizer.specials import SpecialSplitter
from ember.tokenizer.spm import SpmSession
from ember.tokenizer.vocab import SPM, Vocab


class Tokenizer:
    """Tokenizes as llama.cpp does for `llama` (SPM), `gpt2` (byte-level BPE) and `gemma4` vocabularies.

    `encode(text)` matches `llama_tokenize(text, add_special, parse_special)`; `decode(ids)` matches
    `llama_detokenize(ids, remove_special=False, unparse_special=special)`.
    """

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self._splitter = SpecialSplitter(vocab)
        self._session = SpmSession(vocab) if vocab.model == SPM else BpeSession(vocab)
        self._pieces = PieceTable(vocab)
        self._chat: ChatTemplate | None = None

    # construction

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata mapping (`tokenizer.ggml.*` keys and `tokenizer.chat_template`)."""
        return cls(Vocab.from_metadata(metadata))

    @classmethod
    def from_gguf(cls, source: Any) -> Tokenizer:
        """Build from a GGUF file: a path, or an open `ember.gguf_file.GGUFFile`."""
        if isinstance(source, (str, os.PathLike)):
            from ember.gguf_file import GGUFFile

            source = GGUFFile.open(source)
        metadata = getattr(source, "metadata", None)
        if metadata is None:
            raise TokenizerError(f"cannot read a tokenizer from {source!r}: expected a path or a GGUFFile")
        return cls.from_metadata(metadata)

    # special ids

    @property
    def vocab_size(self) -> int:
        return self.vocab.size

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.special["eot"]

    @property
    def pad_id(self) -> int | None:
        return self.vocab.special["pad"]

    @property
    def unk_id(self) -> int | None:
        return self.vocab.special["unk"]

    @property
    def eog_ids(self) -> frozenset[int]:
        """Ids that end generation (llama.cpp's EOG set: eos, eot and end-of-turn-looking tokens)."""
        return self.vocab.eog_ids

    @property
    def add_bos(self) -> bool:
        """Whether `encode` adds BOS by default (the file's flag, llama.cpp's per-type rules)."""
        return self.vocab.add_bos

    def token_text(self, token_id: int) -> str:
        """The token's stored text (e.g. `Ġhello`, `▁Hello`, `<0x0A>`)."""
        return self.vocab.tokens[token_id]

    def token_id(self, text: str) -> int | None:
        """The id of the token whose stored text is exactly `text`, if any."""
        return self.vocab.token_to_id.get(text)

    # encoding

    def encode(self, text: str, *, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids for `text`.

        add_bos: None follows the model (BOS when llama.cpp adds it, and EOS when the file asks);
        True/False force BOS on or off (and add no EOS).
        parse_special: also turn the text of CONTROL tokens (`<|im_start|>`) into those tokens;
        USER_DEFINED tokens are matched either way, as llama.cpp does.
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects a str, got {type(text).__name__}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise TokenizerError(
                    f"cannot tokenize text holding a lone surrogate ({error.object[error.start]!r} at "
                    f"position {error.start}); it has no UTF-8 form"
                ) from None
        vocab = self.vocab
        out: list[int] = []
        want_bos = vocab.add_bos if add_bos is None else add_bos
        if want_bos:
            if self.bos_id is None:
                raise TokenizerError("BOS was requested but the vocabulary has no BOS token")
            out.append(self.bos_id)
        fragments = self._splitter.split(text, parse_special)
        if vocab.model == SPM:
            previous_is_token = True
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                    previous_is_token = True
                else:
                    prefix = " " if vocab.add_space_prefix and previous_is_token else ""
                    self._session.encode(prefix + fragment, out)
                    previous_is_token = False
        else:
            for fragment in fragments:
                if isinstance(fragment, int):
                    out.append(fragment)
                else:
                    self._session.encode(fragment, out)
        if add_bos is None and vocab.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    # decoding

    def decode(self, ids: Iterable[int], *, special: bool = False) -> str:
        """Text for `ids`; control tokens print only with `special=True`. Invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, special=special).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int], *, special: bool = False,
                     remove_special: bool = False) -> bytes:
        """llama.cpp's `llama_detokenize` output, as raw bytes."""
        return detokenize(self.vocab, self._pieces, [int(i) for i in ids], remove_special=remove_special,
                          unparse_special=special)

    def token_to_piece(self, token_id: int, *, special: bool = False) -> bytes:
        """One token's bytes as llama.cpp's `token_to_piece` gives them (no leading-space strip)."""
        return self._pieces.piece(int(token_id), special)

    def stream_decoder(self, *, special: bool = False) -> StreamDecoder:
        """A decoder for generated ids: `push(id) -> str`, `flush() -> str`; never splits a character."""
        return StreamDecoder(self._pieces, special=special)

    # chat templates

    @property
    def chat_template(self) -> str | None:
        return self.vocab.chat_template

    @property
    def has_chat_template(self) -> bool:
        return self.vocab.chat_template is not None

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **extra: Any) -> str:
        """Render the file's `tokenizer.chat_template` for `messages` (extra variables pass through)."""
        if self._chat is None:
            if self.vocab.chat_template is None:
                raise TokenizerError(
                    "this model has no chat template (no tokenizer.chat_template in its GGUF metadata); "
                    "format the prompt yourself or use a chat/instruct model"
                )
            self._chat = ChatTemplate(self.vocab.chat_template, bos_token=self._special_text(self.bos_id),
                                      eos_token=self._special_text(self.eos_id))
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    **extra: Any) -> list[int]:
        """Render the chat template and tokenize the prompt the way llama-server does.

        A leading BOS text (Gemma templates print `<bos>`) is dropped when the tokenizer adds BOS itself,
        so the prompt starts with exactly one BOS; then `encode(..., parse_special=True)`.
        """
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        bos_text = self._special_text(self.bos_id)
        if self.add_bos and bos_text and text.startswith(bos_text):
            text = text[len(bos_text):]
        return self.encode(text, parse_special=True)

    def _special_text(self, token: int | None) -> str:
        if token is None:
            return ""
        return self._pieces.piece(token, True).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        pre = self.vocab.pre.name if self.vocab.pre is not None else "-"
        return f"Tokenizer(model={self.vocab.model!r}, pre={pre!r}, vocab_size={self.vocab.size})"
