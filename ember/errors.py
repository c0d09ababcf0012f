"""The EmberError family: every error a user can cause ends as one of these, with a readable message."""

from __future__ import annotations


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
