"""llama.cpp's own quantizer and dequantizer (libggml-base from llama-cpp-python) through ctypes.

The external reference for the block formats: `ggml_quantize` is ggml_quantize_chunk (what
llama_model_quantize calls for every tensor; MXFP4 included, which llama.cpp's file quantizer only
writes for gpt-oss expert tensors), `ggml_dequantize` is ggml's dequantize_row_<type>, the C code
llama.cpp's CPU backend converts weights with.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import gguf
import numpy as np


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    import llama_cpp

    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(qtype: str, w: np.ndarray) -> np.ndarray:
    """float32 w [rows, cols] → the raw blocks uint8 [rows, row bytes] ggml writes for `qtype`."""
    w = np.ascontiguousarray(w, np.float32)
    rows, cols = w.shape
    t = gguf.GGMLQuantizationType[qtype]
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[t]
    out = np.zeros((rows, cols // block_weights * block_bytes), np.uint8)
    n = _lib().ggml_quantize_chunk(int(t), w.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    assert n == out.nbytes, (qtype, n, out.nbytes)
    return out


def ggml_dequantize(qtype: str, raw: np.ndarray, cols: int) -> np.ndarray:
    """Raw blocks uint8 [rows, row bytes] → float32 [rows, cols] by ggml's dequantize_row_<type>."""
    raw = np.ascontiguousarray(raw, np.uint8)
    rows = raw.size // (cols // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
                        * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][1])
    fn = getattr(_lib(), f"dequantize_row_{qtype.lower() if not qtype.endswith('_K') else qtype[:-2].lower() + '_K'}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    out = np.zeros((rows, cols), np.float32)
    fn(raw.ctypes.data, out.ctypes.data, rows * cols)
    return out
