"""ember: GGUF language models on a NumPy engine, with an experiment hook contract."""

from ember.errors import EmberError

__version__ = "0.1.0"

__all__ = ["EmberError", "__version__"]
