"""Pieces of the stage graph that some families add to Llama's block (backends/gguf/families.py).

Sliding-window attention: a windowed layer attends as the full layers do, to the whole KV state
(the cache holds every position: the window is a mask, not a shorter cache), but a query at
logical position p sees only keys at logical positions k with p − k < window (llama.cpp's
LLAMA_SWA_TYPE_STANDARD). A key's logical position is its rank among the visible positions of
its row (cumulative sum of attention_mask − 1): every slot's visible positions are its tokens
at logical positions 0, 1, 2, … in physical order (a prompt is fed from 0; a cut keeps a
prefix; a row group copies a slot's live positions in order; padding is masked out).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

I64 = ov.Type.i64
LOWEST_F32 = np.finfo(np.float32).min


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def window_mask(full: ov.Output, attention_mask: ov.Output, position_ids: ov.Output, window: int) -> ov.Output:
    """The full layers' additive mask `full` f32 [B, 1, L, S] with, in addition, every key more
    than `window` − 1 logical positions before its query masked out."""
    visible = ops.convert(ops.not_equal(attention_mask, ops.constant(np.int64(0))), I64)  # [B, S] 0/1
    key_pos = ops.subtract(ops.cumsum(visible, ops.constant(np.int64(1))), _i64(1))  # [B, S]
    key_pos = ops.unsqueeze(key_pos, _i64(1, 2))  # [B, 1, 1, S]
    query_pos = ops.unsqueeze(position_ids, _i64(1, 3))  # [B, 1, L, 1]
    near = ops.less(ops.subtract(query_pos, key_pos), ops.constant(np.int64(window)))  # [B, 1, L, S]
    return ops.select(near, full, ops.constant(LOWEST_F32)).output(0)


def gelu_tanh(x: ov.Output) -> ov.Output:
    """0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³))) (ggml_gelu; Gemma's GeGLU)."""
    return ops.gelu(x, "tanh").output(0)


def softcap(logits: ov.Output, cap: float) -> ov.Output:
    """cap·tanh(logits / cap) (Gemma's final logit soft-capping)."""
    scaled = ops.multiply(logits, ops.constant(np.float32(1.0 / cap)))
    return ops.multiply(ops.tanh(scaled), ops.constant(np.float32(cap))).output(0)
