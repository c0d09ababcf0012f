"""llama.cpp's Phi-3 vocabulary rule (`llama-vocab.cpp`, by model name): in a file whose `general.name`
contains "phi-3" or "phi3" (any case), every special token but <unk>, <s> and <|endoftext|> drops the
whitespace after it when text is tokenized with its special tokens (RSTRIP), so Phi-3's chat format
"<|user|>\\nHi<|end|>\\n<|assistant|>\\n" carries no newline tokens, as the model was trained."""

from __future__ import annotations

from typing import Any

import pytest

from ember.tokenizer import Tokenizer

CONTROL, USER_DEFINED, UNKNOWN, NORMAL, BYTE = 3, 4, 2, 1, 6
SPECIALS = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", USER_DEFINED), ("<|endoftext|>", CONTROL),
            ("<|user|>", USER_DEFINED), ("<|end|>", CONTROL), ("<|assistant|>", USER_DEFINED),
            ("<|system|>", USER_DEFINED)]
WORDS = ["▁", "H", "i", "▁Hi", "x", "▁x"]


# Phi-3.5-mini-instruct's template, as llama.cpp's tests carry it (tests/test-chat-template.cpp's list)
PHI3_5_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def phi3_vocab(name: str, template: str | None = None) -> Tokenizer:
    tokens = [t for t, _ in SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + WORDS
    types = [k for _, k in SPECIALS] + [BYTE] * 256 + [NORMAL] * len(WORDS)
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(i) for i in range(len(WORDS))]
    metadata: dict[str, Any] = {
        "general.name": name, "tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 5,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": False,
    }
    if template is not None:
        metadata["tokenizer.chat_template"] = template
    return Tokenizer.from_metadata(metadata)


def pieces(tokenizer: Tokenizer, text: str, parse_special: bool = True) -> list[str]:
    return [tokenizer.vocab.tokens[i] for i in tokenizer.encode(text, parse_special=parse_special)]


@pytest.mark.parametrize("name", ["Phi-3-mini-4k-instruct", "phi3 tiny", "Phi 3.5 PHI-3.5-mini"])
def test_whitespace_after_phi3_special_tokens_is_dropped(name: str) -> None:
    tok = phi3_vocab(name)
    # (SentencePiece's space prefix still starts the text after a special token, as in llama.cpp)
    assert pieces(tok, "<|user|>\nHi<|end|>\n<|assistant|>\n") == [
        "<|user|>", "▁", "H", "i", "<|end|>", "<|assistant|>"]
    assert pieces(tok, "</s> \t\nx") == ["</s>", "▁x"]  # </s> strips too, every C whitespace
    for keeps in ("<s>", "<unk>", "<|endoftext|>"):  # these keep what follows them
        assert pieces(tok, keeps + "\nx") == [keeps, "▁", "<0x0A>", "x"], keeps
    # the text before a token is kept (no LSTRIP); user-defined tokens strip without parse_special too
    assert pieces(tok, "Hi\n<|user|>\n\nHi", parse_special=False) == [
        "▁", "H", "i", "<0x0A>", "<|user|>", "▁", "H", "i"]


def test_other_models_keep_the_whitespace() -> None:
    tok = phi3_vocab("Phi 3.5 Mini Instruct")  # neither "phi-3" nor "phi3": llama.cpp's rule does not fire
    assert pieces(tok, "<|user|>\nHi") == ["<|user|>", "▁", "<0x0A>", "H", "i"]


def test_the_chat_template_from_the_file() -> None:
    """Phi-3.5's template rendered from the file, then tokenized as llama-server does: no newline after
    the role and end tokens, the text's own newlines kept."""
    tok = phi3_vocab("Phi-3.5-mini-instruct", PHI3_5_TEMPLATE)
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "Hi\nHi"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nx<|end|>\n<|user|>\nHi\nHi<|end|>\n<|assistant|>\n"
    assert [tok.vocab.tokens[i] for i in tok.encode_chat(messages)] == [
        "<|system|>", "▁x", "<|end|>", "<|user|>", "▁", "H", "i", "<0x0A>", "H", "i", "<|end|>",
        "<|assistant|>"]
