"""Chat templates (`tokenizer.chat_template`) rendered the way transformers renders them.

A GGUF file is untrusted input, so templates run in Jinja2's `ImmutableSandboxedEnvironment`: no
attribute access to Python internals, no mutation of lists or dicts (templates use `namespace()`).
The environment matches transformers' (`trim_blocks`, `lstrip_blocks`, loop controls, a pass-through
`{% generation %}` tag) with the helpers HF-style templates call: `raise_exception`, `strftime_now`
and a `tojson` that neither escapes HTML nor sorts keys.

The sandbox stops a template from reaching Python, not from looping, recursing or allocating without
end, so compiling and rendering run under limits. Breaking one, or any other failure of the template
(an undefined name, a division by zero, a forbidden attribute, `range(10**9)`), is a `TokenizerError`
with one line:

- Time: `TIME_LIMIT_SECONDS` (10 s) per compile and per render. A watchdog thread raises an exception
  in the rendering thread at the deadline, so it stops any Python-level loop, the template's own or a
  filter's (markupsafe 3.0.3's `striptags` is quadratic; 3.0.4's is not). Nested `range(100000)` loops
  stop at 10.0 s. The slowest real template measured, Gemma 4 31B's, is quadratic in the messages:
  0.5-0.7 s for 400 messages, 1.9 s for 800 (2 busy cores); the others render 400 messages in under
  20 ms.
- Output: `MAX_OUTPUT_CHARS` (1,000,000 characters, about 250k tokens, more than any context ember
  runs), counted as the text is produced: `{% for i in range(100000) %}{{ 'x' * 100000 }}` stops in
  10 ms instead of building 10 GB.
- Memory (Linux): a render may take `MEMORY_LIMIT_BYTES` (64 MiB) more than the process holds when it
  starts; RLIMIT_DATA is set for the render and restored after (elsewhere there is no memory limit).
  A huge allocation (`'x'.ljust(10**10)`, `'%999999999s' | format(x)`, doubling a string with `~`)
  fails at once. Printing a self-similar list (`[a, a]` nested 40 deep) runs in C, out of the
  watchdog's reach, until the memory is used: 2.4 s (its `tojson`: 6.8 s).
- Numbers and repetition: `*` and `**` refuse, before computing them, integers over `MAX_INT_BITS`
  (100,000 bits; `10 ** (10 ** 8)` is CPU time no watchdog interrupts) and strings or lists repeated
  past `MAX_OUTPUT_CHARS` items. `range` keeps Jinja's cap of 100,000 items.

Renders are serialized process-wide (the memory limit is the process's); the limits and the streamed
output add about 10 us to a render (SmolLM2's template: 20 -> 30 us). Jinja's optimizer (constant
folding) is off, so what a template computes runs in the render; only a constant expression printed as
it is (`{{ 'a' | upper }}`) is still folded by Jinja's code generator, under the compile's limits. The
output is the same (checked on the real templates in tests/data).
"""

from __future__ import annotations

import ctypes
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ember.errors import TokenizerError

try:
    import resource
except ImportError:  # Windows: no memory limit
    resource = None  # type: ignore[assignment]

TIME_LIMIT_SECONDS = 10.0
MAX_OUTPUT_CHARS = 1_000_000
MEMORY_LIMIT_BYTES = 64 << 20
MAX_INT_BITS = 100_000
_REFIRE_SECONDS = 1.0  # the watchdog raises again if an interrupt was swallowed (e.g. in a __del__)
_MESSAGE_CHARS = 300  # error text quoted from a template is cut here (raise_exception('x' * 10**6))

T = TypeVar("T")


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
    # json.dumps' encoder is C, out of the watchdog's reach; this one is Python (same text)
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    return "".join(encoder.iterencode(value))


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` checked before they build something huge."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if isinstance(left, int) and isinstance(right, int):
            if operator == "**":
                bits = (abs(left).bit_length() - 1) * right if right > 0 else 0
            else:
                bits = abs(left).bit_length() + abs(right).bit_length()
            if bits > MAX_INT_BITS:
                raise TokenizerError(f"the chat template computes a number of about {bits:,} bits with "
                                     f"{operator} (ember's limit: {MAX_INT_BITS:,})")
        elif operator == "*":
            count, item = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(count, int) and hasattr(item, "__len__") and len(item) * count > MAX_OUTPUT_CHARS:
                raise TokenizerError(f"the chat template repeats a value of length {len(item):,} {count:,} "
                                     f"times (ember's limit: {MAX_OUTPUT_CHARS:,} items)")
        return super().call_binop(context, operator, left, right)


class ChatTemplate:
    """A compiled chat template; `render` turns a conversation into prompt text.

    `time_limit` (seconds) defaults to `TIME_LIMIT_SECONDS`, read when the template compiles or renders.
    """

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 now: Callable[[], datetime] = datetime.now, time_limit: float | None = None) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.time_limit = time_limit
        env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True, optimized=False,
                              extensions=[loopcontrols, _GenerationTag])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        try:
            self._template = self._limited(lambda: env.from_string(source), "compiling")
        except jinja2.TemplateSyntaxError as error:
            raise TokenizerError(_one_line(f"the chat template does not parse: {error.message}")
                                 + f" (line {error.lineno})") from None
        except TokenizerError:
            raise
        except Exception as error:
            raise _failure(error, "compiling") from None

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
            return self._limited(lambda: self._produce(variables), "rendering")
        except TokenizerError:
            raise
        except Exception as error:
            raise _failure(error, "rendering") from None

    def _produce(self, variables: dict[str, Any]) -> str:
        pieces: list[str] = []
        size = 0
        stream = self._template.generate(**variables)
        try:
            for piece in stream:
                size += len(piece)
                if size > MAX_OUTPUT_CHARS:
                    raise TokenizerError(f"the chat template's output passed {MAX_OUTPUT_CHARS:,} characters "
                                         "(ember's limit)")
                pieces.append(piece)
        finally:
            stream.close()
        return "".join(pieces)

    def _limited(self, work: Callable[[], T], doing: str) -> T:
        """`work()` under the time and memory limits; the interrupt never escapes."""
        seconds = TIME_LIMIT_SECONDS if self.time_limit is None else self.time_limit
        with _LIMITS.one_at_a_time:
            saved = _LIMITS.cap_memory()
            try:
                _WATCHDOG.watch(seconds)
                try:
                    try:
                        return work()
                    finally:
                        _WATCHDOG.release()
                except _Interrupt:
                    _WATCHDOG.release()  # again: an interrupt may have landed before the first release ran
            finally:
                _LIMITS.restore_memory(saved)
        raise TokenizerError(f"the chat template ran past ember's time limit of {seconds:g} s while {doing} "
                             "(an endless loop, or far too much work)")


def _failure(error: Exception, doing: str) -> TokenizerError:
    if isinstance(error, jinja2.exceptions.SecurityError):
        return TokenizerError(_one_line(f"the chat template tried something the sandbox forbids: {error}"))
    if isinstance(error, jinja2.TemplateError):
        return TokenizerError(_one_line(f"the chat template failed: {error}"))
    if isinstance(error, MemoryError):
        return TokenizerError(f"the chat template needed more than ember's memory limit of "
                              f"{MEMORY_LIMIT_BYTES >> 20} MiB while {doing}")
    if isinstance(error, RecursionError):
        return TokenizerError(f"the chat template recursed too deeply while {doing} (RecursionError)")
    return TokenizerError(_one_line(f"the chat template failed while {doing}: "
                                    f"{type(error).__name__}: {error}"))


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_CHARS else text[:_MESSAGE_CHARS - 3] + "..."


# ------------------------------------------------------------------------------------ the limits


class _Interrupt(BaseException):
    """Raised in the rendering thread at its deadline; a BaseException, so no `except Exception` eats it."""


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_set_async_exc.restype = ctypes.c_int


class _Watchdog:
    """One daemon thread that raises `_Interrupt` in the watched thread once its deadline passes.

    `release` runs in the watched thread, where an interrupt can land between any two bytecodes: it
    touches only a C lock (`with` on it is interrupt-safe) and retries until the watch is cleared and
    a pending interrupt dropped; the watchdog raises only under that lock, and again only a second later.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watched: tuple[int, float] | None = None  # (thread id, deadline); a fresh tuple per watch
        self._looks_at = float("inf")  # when the watchdog thread looks at `_watched` next
        self._thread: threading.Thread | None = None

    def watch(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with self._lock:
            self._watched = (threading.get_ident(), deadline)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ember-chat-template-watchdog",
                                                daemon=True)
                self._thread.start()
            wake = deadline < self._looks_at
        if wake:  # else the watchdog looks again before this deadline anyway (saves a thread switch)
            self._wake.set()

    def release(self) -> None:
        while True:
            try:
                with self._lock:
                    watched, self._watched = self._watched, None
                if watched is not None:
                    _set_async_exc(watched[0], ctypes.py_object())  # drop an interrupt not yet raised
                return
            except _Interrupt:
                continue

    def _run(self) -> None:
        while True:
            try:
                self._wake.clear()
                with self._lock:
                    watched = self._watched
                    now = time.monotonic()
                    if watched is not None and watched[1] <= now:
                        _set_async_exc(watched[0], ctypes.py_object(_Interrupt))
                        pause: float | None = _REFIRE_SECONDS
                    else:
                        pause = None if watched is None else watched[1] - now
                    self._looks_at = float("inf") if pause is None else now + pause
                self._wake.wait(pause)
            except MemoryError:  # the render used the memory this thread needs: try again shortly
                time.sleep(0.01)

    def after_fork(self) -> None:
        """The child has no watchdog thread (and maybe a lock held by a thread it did not inherit)."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._watched = None
        self._looks_at = float("inf")
        self._thread = None


class _Limits:
    """The process-wide part: one render at a time, and the memory cap (RLIMIT_DATA, Linux)."""

    def __init__(self) -> None:
        self.one_at_a_time = threading.Lock()
        self.saved: tuple[int, int] | None = None
        self._statm: int | None = None  # /proc/self/statm, kept open (reading it anew costs 20 us)

    def cap_memory(self) -> tuple[int, int] | None:
        if resource is None:
            return None
        if self._statm is None:
            try:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
            except OSError:  # not Linux: no memory limit
                return None
        held = int(os.pread(self._statm, 256, 0).split()[5]) * os.sysconf("SC_PAGE_SIZE")  # data + stack
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        cap = held + MEMORY_LIMIT_BYTES
        if hard != resource.RLIM_INFINITY:
            cap = min(cap, hard)
        if soft != resource.RLIM_INFINITY and soft <= cap:
            return None  # the process is already held tighter
        self.saved = (soft, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
        return self.saved

    def restore_memory(self, saved: tuple[int, int] | None) -> None:
        if saved is not None:
            resource.setrlimit(resource.RLIMIT_DATA, saved)
            self.saved = None

    def after_fork(self) -> None:
        """A child forked during a render (by another thread) gets its memory limit back."""
        self.restore_memory(self.saved)
        self.one_at_a_time = threading.Lock()
        if self._statm is not None:
            os.close(self._statm)  # it reads the parent's /proc entry
            self._statm = None


_WATCHDOG = _Watchdog()
_LIMITS = _Limits()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: (_WATCHDOG.after_fork(), _LIMITS.after_fork()))
