"""Chat templates (`tokenizer.chat_template`) rendered the way transformers renders them.

A GGUF file is untrusted input, so templates run in Jinja2's `ImmutableSandboxedEnvironment`: no
attribute access to Python internals, no mutation of lists or dicts (templates use `namespace()`).
The environment matches transformers' (`trim_blocks`, `lstrip_blocks`, loop controls, a pass-through
`{% generation %}` tag) with the helpers HF-style templates call: `raise_exception`, `strftime_now`
and a `tojson` that neither escapes HTML nor sorts keys.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import TokenizerError


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template; `render` turns a conversation into prompt text."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 now: Callable[[], datetime] = datetime.now) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise TokenizerError(f"the chat template does not parse: {error} (line {error.lineno})") from None
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
               **extra: Any) -> str:
        variables: dict[str, Any] = {
            "messages": messages,
            "tools": None,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        variables.update(extra)
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.SecurityError as error:
            raise TokenizerError(f"the chat template tried something the sandbox forbids: {error}") from None
        except jinja2.TemplateError as error:
            raise TokenizerError(f"the chat template failed: {error}") from None
