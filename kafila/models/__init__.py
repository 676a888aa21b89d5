"""Models: the GGUF index, exact quant formats, tokenizer and aliases."""

from kafila.models.gguf_index import Hyperparams, ModelIndex, TensorInfo, open_model
from kafila.models.registry import ALIASES, DEFAULT_MODEL, resolve_model
from kafila.models.tokenizer import StreamDecoder, Tokenizer, load_tokenizer

__all__ = [
    "ALIASES", "DEFAULT_MODEL", "Hyperparams", "ModelIndex", "StreamDecoder", "TensorInfo",
    "Tokenizer", "load_tokenizer", "open_model", "resolve_model",
]  # fmt: skip
