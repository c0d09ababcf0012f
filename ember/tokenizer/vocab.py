"""The vocabulary as llama.cpp sees it: tokens, scores, attributes, special ids and per-type flags.

Built from GGUF `tokenizer.*` metadata the way llama.cpp's `llama_vocab::impl::load` reads it,
including the attribute changes it makes by token text (tokens that look like end-of-turn or
fill-in-the-middle markers become CONTROL whatever the file says).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ember.errors import TokenizerError
from ember.tokenizer.pretokenize import PreTokenizer, pre_tokenizer

# llama.cpp token attributes (bit flags); GGUF token types map onto them one to one.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7  # whitespace before the token is dropped from text around it (llama.cpp's bits)
ATTR_RSTRIP = 1 << 8  # whitespace after it is dropped

_TYPE_TO_ATTR = {1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL, 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED,
                 6: ATTR_BYTE}

# Vocabulary kinds ember tokenizes, by `tokenizer.ggml.model`.
SPM, BPE, GEMMA4 = "llama", "gpt2", "gemma4"

# Texts llama.cpp promotes to special roles (and to CONTROL) when the file names no id for the role.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
              "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_ROLE_TEXTS = {
    "eom": ("<|eom_id|>",),
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Every token with one of these texts ends generation and is made CONTROL.
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: USER_DEFINED

_ID_KEYS = {
    "bos": "bos_token_id", "eos": "eos_token_id", "eot": "eot_token_id", "eom": "eom_token_id",
    "unk": "unknown_token_id", "sep": "seperator_token_id", "pad": "padding_token_id",
    "mask": "mask_token_id",
    "fim_pre": "fim_pre_token_id", "fim_suf": "fim_suf_token_id", "fim_mid": "fim_mid_token_id",
    "fim_pad": "fim_pad_token_id", "fim_rep": "fim_rep_token_id", "fim_sep": "fim_sep_token_id",
}
_DEPRECATED_ID_KEYS = {
    "fim_pre": "prefix_token_id", "fim_suf": "suffix_token_id", "fim_mid": "middle_token_id",
}


def _key(name: str) -> str:
    return "tokenizer.ggml." + name


@dataclass
class Vocab:
    """Everything the encoders and the decoder need, after llama.cpp's load-time rules."""

    model: str
    tokens: list[str]
    token_to_id: dict[str, int]
    scores: list[float]
    attrs: list[int]
    special: dict[str, int | None]
    eog_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool
    escape_whitespaces: bool
    pre: PreTokenizer | None
    merges: dict[str, int] = field(default_factory=dict)
    chat_template: str | None = None

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Vocab:
        model = metadata.get(_key("model"))
        if model is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model; the file carries no tokenizer")
        tokens = metadata.get(_key("tokens"))
        if tokens is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        token_to_id = {t: i for i, t in enumerate(tokens)}
        if len(token_to_id) != len(tokens):
            raise TokenizerError("tokenizer.ggml.tokens contains duplicate token texts")

        pre_name = metadata.get(_key("pre"))
        special: dict[str, int | None] = dict.fromkeys(_ID_KEYS)
        add_eos = False
        escape_whitespaces = False
        pre: PreTokenizer | None = None
        merges: dict[str, int] = {}
        if model == SPM:
            special.update(bos=1, eos=2, unk=0)
            add_bos, add_space_prefix, clean_spaces, escape_whitespaces = True, True, False, True
        elif model in (BPE, GEMMA4):
            merges = _merge_ranks(metadata, model)
            if model == BPE:
                special.update(bos=11, eos=11)
                pre = pre_tokenizer(pre_name)
            else:
                pre = pre_tokenizer("gemma4")
            escape_whitespaces = pre.name == "gemma4"
            add_bos, add_space_prefix, clean_spaces = pre.add_bos, False, pre.clean_spaces
        else:
            raise TokenizerError(
                f"unsupported vocabulary type tokenizer.ggml.model = {model!r}; "
                "ember supports 'llama' (SentencePiece), 'gpt2' (byte-level BPE) and 'gemma4'"
            )
        add_space_prefix = bool(metadata.get(_key("add_space_prefix"), add_space_prefix))

        scores = metadata.get(_key("scores"))
        if scores is None:
            scores = [0.0] * len(tokens)
        else:  # float32 (or int32) values, widened exactly
            scores = np.asarray(scores[: len(tokens)]).astype(np.float32).astype(np.float64).tolist()
        types = metadata.get(_key("token_type"))
        if types is None:
            attrs = [ATTR_NORMAL] * len(tokens)
        else:
            lookup = _TYPE_TO_ATTR.get
            attrs = [lookup(t, ATTR_UNDEFINED) for t in np.asarray(types[: len(tokens)]).tolist()]
        if len(scores) < len(tokens) or len(attrs) < len(tokens):
            raise TokenizerError("tokenizer.ggml.scores or token_type is shorter than tokenizer.ggml.tokens")

        for role, name in _ID_KEYS.items():
            value = metadata.get(_key(name))
            if value is None and role in _DEPRECATED_ID_KEYS:
                value = metadata.get(_key(_DEPRECATED_ID_KEYS[role]))
            current = special[role]
            if current is not None and current >= len(tokens):
                special[role] = None
            if value is not None and 0 <= int(value) < len(tokens):
                special[role] = int(value)

        add_bos = bool(metadata.get(_key("add_bos_token"), add_bos))
        add_eos = bool(metadata.get(_key("add_eos_token"), add_eos))
        if pre is not None and pre.name == "gemma4":
            add_bos = True  # llama.cpp forces it for Gemma 4 (ggml-org/llama.cpp#21500)

        eog_ids = _apply_text_rules(tokens, token_to_id, attrs, special)
        _apply_name_rules(str(metadata.get("general.name", "")), token_to_id, attrs)
        chat_template = metadata.get("tokenizer.chat_template")
        return cls(
            model=model, tokens=tokens, token_to_id=token_to_id, scores=scores, attrs=attrs, special=special,
            eog_ids=eog_ids, add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
            clean_spaces=clean_spaces, escape_whitespaces=escape_whitespaces, pre=pre, merges=merges,
            chat_template=chat_template if isinstance(chat_template, str) else None,
        )


def _merge_ranks(metadata: Mapping[str, Any], model: str) -> dict[str, int]:
    """Merge string -> rank; the first occurrence wins, as in llama.cpp's `emplace`.

    llama.cpp splits a merge at the first space from index 1 and looks pairs up as (left, right).
    Keying by the original string and looking up `left + " " + right` is the same thing as long as
    no left symbol holds a space past its first character, which the encoders guarantee (byte-level
    text has no spaces; gemma4 text has them escaped to U+2581).
    """
    merges = metadata.get(_key("merges"))
    if merges is None:
        raise TokenizerError(f"vocabulary type {model!r} needs tokenizer.ggml.merges, which the file lacks")
    count = len(merges)
    return dict(zip(reversed(merges), range(count - 1, -1, -1), strict=True))


def _apply_name_rules(model_name: str, token_to_id: dict[str, int], attrs: list[int]) -> None:
    """llama.cpp's attributes by model name: a Phi-3 vocabulary (`general.name` containing "phi-3" or
    "phi3", any case) drops whitespace after every special token but <unk>, <s> and <|endoftext|>, so
    "<|user|>\nHi" tokenizes as <|user|> Hi (llama.cpp requires a </s> there; ember does not)."""
    name = model_name.lower()
    if "phi-3" not in name and "phi3" not in name:
        return
    for i, attr in enumerate(attrs):
        if attr & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
            attrs[i] |= ATTR_RSTRIP
    if "</s>" in token_to_id:
        attrs[token_to_id["</s>"]] |= ATTR_RSTRIP
    for text in ("<unk>", "<s>", "<|endoftext|>"):
        if text in token_to_id:
            attrs[token_to_id[text]] &= ~ATTR_RSTRIP


def _apply_text_rules(tokens: list[str], token_to_id: dict[str, int], attrs: list[int],
                      special: dict[str, int | None]) -> frozenset[int]:
    """llama.cpp's load-time rules keyed on token text; returns the end-of-generation ids.

    llama.cpp takes the first match in hash-map order when several texts fit one role; ember takes
    the lowest id. Either way every EOG-looking token is CONTROL and in the EOG set.
    """

    def promote(role: str, texts: tuple[str, ...]) -> None:
        if special[role] is not None:
            return
        found = sorted(token_to_id[t] for t in texts if t in token_to_id)
        if found:
            special[role] = found[0]
            attrs[found[0]] |= ATTR_CONTROL

    promote("eot", _EOT_TEXTS)
    for role, texts in _ROLE_TEXTS.items():
        promote(role, texts)

    for i, text in enumerate(tokens):
        if attrs[i] & ATTR_CONTROL and not attrs[i] & ATTR_UNUSED and "unused" in text:
            attrs[i] |= ATTR_UNUSED

    eog = {special[r] for r in ("fim_pad", "fim_rep", "fim_sep") if special[r] is not None}
    for text in _EOG_TEXTS:
        token = token_to_id.get(text)
        if token is not None:
            eog.add(token)
            attrs[token] |= ATTR_CONTROL
    for text in _ALWAYS_RENDERED:
        if text in token_to_id:
            attrs[token_to_id[text]] = ATTR_USER_DEFINED
    eog.update(special[r] for r in ("eos", "eot", "eom") if special[r] is not None)

    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts) and (
        "<|return|>" in texts or "<|flush|>" in texts
    ):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
    if "</s>" in texts and ("<|tool_response>" in texts or "<|plamo:eos|>" in texts):
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = ATTR_NORMAL
    return frozenset(eog)
