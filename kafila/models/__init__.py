"""Models as the app sees them: the tokenizer, the vocabulary tests and the alias registry.

Reading GGUF files (the header, the tensor index, quant formats) lives below the app and the
backends, in backends/gguf."""

from kafila.models.registry import ALIASES, DEFAULT_MODEL, resolve_model
from kafila.models.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

__all__ = ["ALIASES", "DEFAULT_MODEL", "StreamDecoder", "Tokenizer", "load_tokenizer", "resolve_model"]
