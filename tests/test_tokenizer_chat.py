"""Chat templates: sandboxed Jinja2 rendering with transformers' conventions.

The expected prompts below were checked against transformers' own renderer
(`transformers.utils.chat_template_utils.render_jinja_template`, 5.x), which
`test_matches_transformers_renderer` re-checks when transformers is installed.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest

from ember.errors import TokenizerError
from ember.gguf_file import GGUFFile
from ember.tokenizer import ChatTemplate, Tokenizer

DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "tokenizer" / "chat_templates"
CONVERSATION = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there!"},
    {"role": "user", "content": "What is 2+2?"},
]
CHATML_TURNS = (
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\nHi there!<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
)


def template(name: str, **kwargs) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / name).read_text(encoding="utf-8"), **kwargs)


def test_qwen3_template() -> None:
    qwen3 = template("Qwen-Qwen3-0.6B.jinja", eos_token="<|im_end|>")
    assert qwen3.render(CONVERSATION) == CHATML_TURNS
    no_thinking = qwen3.render(CONVERSATION, enable_thinking=False)
    assert no_thinking == CHATML_TURNS + "<think>\n\n</think>\n\n"
    assert qwen3.render(CONVERSATION, add_generation_prompt=False) == CHATML_TURNS.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_gemma4_template() -> None:
    gemma4 = template("google-gemma-4-31B-it.jinja", bos_token="<bos>", eos_token="<eos>")
    assert gemma4.render(CONVERSATION) == (
        "<bos><|turn>user\nHello<turn|>\n<|turn>model\nHi there!<turn|>\n"
        "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )
    thinking = gemma4.render(
        [{"role": "system", "content": "Be brief."}, *CONVERSATION], enable_thinking=True
    )
    assert thinking.startswith("<bos><|turn>system\n<|think|>")


def test_smollm3_template() -> None:
    smollm3 = template("HuggingFaceTB-SmolLM3-3B.jinja")
    text = smollm3.render(CONVERSATION)
    assert text.startswith("<|im_start|>system\n## Metadata\n\nKnowledge Cutoff Date: June 2025\n")
    assert text.endswith(CHATML_TURNS.replace("<|im_start|>assistant\nHi", "<|im_start|>assistant\nHi", 1))


def test_smollm2_file_template(smollm2_path) -> None:
    tok = Tokenizer.from_gguf(smollm2_path)
    assert tok.has_chat_template
    assert tok.apply_chat_template(CONVERSATION) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        + CHATML_TURNS
    )
    prompt = tok.apply_chat_template(CONVERSATION)
    ids = tok.encode(prompt, parse_special=True)
    start = tok.token_id("<|im_start|>")
    assert ids[0] == start and ids[-4:] == [start, *tok.encode("assistant\n")]


def test_gemma4_fixture_template_uses_its_bos_text() -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / "ggml-vocab-gemma-4.gguf"))
    prompt = tok.apply_chat_template(CONVERSATION[:1])
    assert prompt == "<bos><|turn>user\nHello<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    ids = tok.encode(prompt, add_bos=False, parse_special=True)
    assert ids[:3] == [tok.bos_id, 105, 2364]  # <bos> <|turn> user


def test_encode_chat_gives_one_bos() -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / "ggml-vocab-gemma-4.gguf"))
    ids = tok.encode_chat(CONVERSATION[:1])
    assert ids[:3] == [tok.bos_id, 105, 2364] and ids.count(tok.bos_id) == 1
    assert ids == tok.encode(tok.apply_chat_template(CONVERSATION[:1]), add_bos=False, parse_special=True)


def test_no_template_is_a_clear_error() -> None:
    tok = Tokenizer.from_gguf(GGUFFile.open(DATA / "vocab" / "ggml-vocab-gpt-2.gguf"))
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(CONVERSATION)


def test_raise_exception_reaches_the_caller() -> None:
    gemma2 = template("google-gemma-2-2b-it.jinja", bos_token="<bos>")
    with pytest.raises(TokenizerError, match="System role not supported"):
        gemma2.render([{"role": "system", "content": "x"}, *CONVERSATION])


def test_strftime_now_uses_the_clock() -> None:
    llama = template(
        "meta-llama-Llama-3.2-3B-Instruct.jinja",
        bos_token="<|begin_of_text|>",
        now=lambda: datetime(2024, 7, 26),
    )
    assert "Today Date: 26 Jul 2024\n" in llama.render(CONVERSATION)


def test_tojson_keeps_order_and_does_not_escape_html() -> None:
    rendered = ChatTemplate("{{ value | tojson }}|{{ value | tojson(indent=2) }}").render(
        [], value={"b": "<a&'>", "a": 1}
    )
    assert rendered == '{"b": "<a&\'>", "a": 1}|{\n  "b": "<a&\'>",\n  "a": 1\n}'


def test_generation_tag_is_accepted() -> None:
    source = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    assert ChatTemplate(source).render(CONVERSATION) == "HelloHi there!What is 2+2?"


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set l = [1] %}{{ l.append(2) }}",
        "{{ raise_exception.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_blocks_python_internals(source: str) -> None:
    """A hostile template fails with TokenizerError or reads nothing (unsafe attributes are undefined)."""
    try:
        rendered = ChatTemplate(source).render(CONVERSATION)
    except TokenizerError:
        return
    assert rendered == ""


def test_syntax_error_is_reported() -> None:
    with pytest.raises(TokenizerError, match="does not parse"):
        ChatTemplate("{% for %}")


@pytest.mark.slow
@pytest.mark.reference
@pytest.mark.parametrize("name", sorted(p.name for p in TEMPLATES.glob("*.jinja")))
def test_matches_transformers_renderer(name: str) -> None:
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    source = (TEMPLATES / name).read_text(encoding="utf-8")
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    expected = chat_template_utils.render_jinja_template(
        [CONVERSATION], chat_template=source, add_generation_prompt=True, **variables
    )
    expected = expected[0] if isinstance(expected, tuple) else expected
    expected = expected[0] if isinstance(expected, list) else expected
    now = datetime.now  # both read the real clock (Llama 3.2 prints today's date)
    assert ChatTemplate(source, now=now, **variables).render(CONVERSATION) == expected
