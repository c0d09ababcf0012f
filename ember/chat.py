"""Interactive chat: the model's chat template, streamed replies, and the KV cache kept between turns.

    session = ChatSession(model)
    session.send("Hello!", on_text=print_piece)     # turn 1: the whole templated prompt is prefilled
    session.send("And then?")                        # turn 2: only the tokens after the cached prefix are

Each turn renders the whole conversation with the chat template and tokenizes it; `Model.generate`
with `reuse_cache=True` keeps the cached prefix this shares with what the cache already holds (the
previous prompt and reply) and prefills only the rest. `run_repl` wraps a session in a read-eval-print
loop with `/reset` (forget the conversation) and `/exit`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from ember.errors import ContextLengthError, EmberError, TokenizerError

HELP = "/reset forgets the conversation, /exit (or end of input) quits"


class ChatSession:
    """A conversation with one model; not thread-safe (the model has one KV cache)."""

    def __init__(self, model: Any, *, system: str | None = None, max_new_tokens: int = 256,
                 tracer: Any = None, **sampling: Any) -> None:
        from ember.inspection.refusal import refuse_with_experiments

        refuse_with_experiments("interactive", sampling.pop("experiments", ()))
        if not model.tokenizer.has_chat_template:
            raise TokenizerError(
                f"{model.source.name} has no chat template (no tokenizer.chat_template in its GGUF "
                "metadata): interactive chat needs a chat/instruct model"
            )
        self.model = model
        self.system = system
        self.max_new_tokens = max_new_tokens
        self.sampling = sampling
        self.tracer = tracer
        self.messages: list[dict[str, str]] = []
        self.turns: list[Any] = []  # the Generation of each turn since the last reset
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the cache keeps what the next prompt may still share, e.g. the
        system prompt)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.turns = []

    def send(self, text: str, on_text: Callable[[str], None] | None = None) -> Any:
        """Add the user's message, generate the reply (streamed to on_text), keep it; the Generation."""
        messages = [*self.messages, {"role": "user", "content": text}]
        prompt_ids = self.model.tokenizer.encode_chat(messages)
        room = self.model.context_length - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"the conversation ({len(prompt_ids)} tokens) fills the context of "
                f"{self.model.context_length} tokens: /reset to start over"
            )
        generation = self.model.generate(prompt_ids, max_new_tokens=min(self.max_new_tokens, room),
                                         reuse_cache=True, on_text=on_text, tracer=self.tracer,
                                         **self.sampling)
        self.messages = [*messages, {"role": "assistant", "content": generation.text}]
        self.turns.append(generation)
        return generation


def run_repl(model: Any, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
             stats: bool = True, **session_options: Any) -> ChatSession:
    """Read user lines from stdin until /exit or end of input; stream replies to stdout."""
    stdin = stdin if stdin is not None else sys.stdin
    stdout = stdout if stdout is not None else sys.stdout
    session = ChatSession(model, **session_options)
    interactive = _is_terminal(stdin)

    def write(text: str) -> None:
        stdout.write(text)
        stdout.flush()

    write(f"ember chat with {model.source.name} ({HELP})\n")
    while True:
        if interactive:
            write("> ")
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            session.reset()
            write("(conversation reset)\n")
            continue
        if text.startswith("/"):
            write(f"unknown command {text.split()[0]}: {HELP}\n")
            continue
        try:
            generation = session.send(text, on_text=write)
        except EmberError as error:
            write(f"\n(ember: {error})\n")
            continue
        write("\n")
        if stats:
            t = generation.timings
            write(f"[{t.prompt_tokens} new prompt tokens, {t.reused_prompt_tokens} reused from the cache; "
                  f"{len(generation.token_ids)} tokens at {t.decode_tokens_per_second:.1f} tok/s]\n")
    return session


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
