"""The EmberError family: every error a user can cause ends as one of these, with a readable message."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class EmberError(Exception):
    """Base class of every error ember reports to its users."""


class GGUFError(EmberError):
    """A GGUF file is malformed, truncated, or uses something ember does not support."""


class UnsupportedArchitectureError(GGUFError):
    """The file's `general.architecture` is not one of ember's families."""


class ModelSourceError(EmberError):
    """A model name or path could not be resolved to a verified local file."""


class ConfigError(EmberError):
    """A configuration value is impossible (wrong type, out of range, does not fit the model)."""


class TokenizerError(EmberError):
    """The tokenizer metadata is missing, unsupported, or cannot do what was asked."""


class ContextLengthError(ConfigError):
    """A prompt plus the requested new tokens does not fit the context."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C (every open run is closed as KILLED); the process then exits 143
    (128 + SIGTERM), as a terminated program does, where Ctrl-C exits 130."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler: `signal.signal(signal.SIGTERM, raise_terminated)`."""
    raise Terminated()


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean mode?)` when one of `choices` is close to `word`, else ``: for every message that
    refuses a name."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
