"""GGUF files below the app and the backends: the lean header read, the tensor index with
its refusals and block ranges, and the exact quant formats (block layouts, dequantisation).
Imports nothing of kafila; the app and every backend read models through it."""

from backends.gguf.index import Hyperparams, ModelIndex, TensorInfo, open_model

__all__ = ["Hyperparams", "ModelIndex", "TensorInfo", "open_model"]
