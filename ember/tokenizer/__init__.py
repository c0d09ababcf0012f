"""Tokenization identical to llama.cpp, straight from GGUF metadata, plus chat templates.

`Tokenizer.from_gguf(path_or_gguf_file)` or `Tokenizer.from_metadata(metadata)`; see `tokenizer.py`.
"""

from ember.errors import TokenizerError
from ember.tokenizer.chat import ChatTemplate
from ember.tokenizer.decode import StreamDecoder
from ember.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "StreamDecoder", "Tokenizer", "TokenizerError"]
