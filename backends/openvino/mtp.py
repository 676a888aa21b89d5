"""A file's multi-token-prediction (nextn) block as an OpenVINO stage: the model's own draft head
(`--speculate mtp`; its driver is kafila/session/ring/speculation/mtp.py).

What it computes is llama.cpp's qwen35 / qwen35moe `graph_mtp` (src/models/qwen35.cpp), for MTP
position q at RoPE position q:

    x  = eh_proj · [rms(e_q)·enorm | rms(h_{q−1})·hnorm]   e_q: token q's embedding row (nextn.embed_tokens
                                                           or token_embd); h_{q−1}: the model's final hidden
                                                           at q − 1 after output_norm (the target's, or the
                                                           MTP's own output while drafting)
    x  = the MTP block on x: a gated full-attention block (qwen35moe's with its experts) with its
         own KV cache
    h' = rms(x)·(nextn.shared_head_norm or output_norm)   the next draft step's h
    token = argmax of (nextn.shared_head_head or the model's lm_head) · h'

The stage's input hidden_states is [B, L, 2H], each row [e_q | h_{q−1}], so an MtpShard's slots,
masks, rewinds and cuts are an OpenVINOShard's; it always folds the greedy token into its graph.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from backends.base import ShardSpec
from backends.gguf import ModelIndex
from backends.gguf.hybrid import mtp_block, mtp_tensor
from backends.openvino.graph import StageBuilder, _i64, causal_mask, rms_norm
from backends.openvino.shard import OpenVINOShard

I64 = ov.Type.i64


def mtp_model(builder: StageBuilder) -> ov.Model:
    """The MTP stage graph (module docstring): outputs hidden_out [B, L, H] (h') and token i64 [1]
    (the last row's greedy token)."""
    from backends.openvino.delta_net import HybridBlocks

    index, h, w = builder.index, builder.h, builder.w
    b = mtp_block(index)
    p = f"blk.{b}."
    params = x_in, attention_mask, position_ids, beam_idx = builder.parameters(2 * h.hidden)
    e = ops.slice(x_in, _i64(0), _i64(h.hidden), _i64(1), _i64(-1))  # [B, L, H]
    prev = ops.slice(x_in, _i64(h.hidden), _i64(2 * h.hidden), _i64(1), _i64(-1))
    both = ops.concat([rms_norm(e, w.vector(p + "nextn.enorm.weight"), h.rms_eps),
                       rms_norm(prev, w.vector(p + "nextn.hnorm.weight"), h.rms_eps)], axis=-1)  # fmt: skip
    (x,) = w.project(both.output(0), [(p + "nextn.eh_proj.weight", 0)])
    new_len = ops.gather(ops.shape_of(position_ids, I64), _i64(1), _i64(0))
    mask = causal_mask(attention_mask.output(0), new_len)
    sinks: list = []
    x = HybridBlocks(builder).block(b, x, position_ids.output(0), mask, beam_idx.output(0), sinks)
    out = rms_norm(x, w.vector(mtp_tensor(index, "shared_head_norm.weight", "output_norm.weight")), h.rms_eps)
    last = ops.reshape(ops.gather(out, _i64(-1), _i64(1)), _i64(-1, h.hidden), False)  # [B, H]
    lm = "token_embd.weight" if h.tied_embeddings else "output.weight"
    (logits,) = w.project(last.output(0), [(mtp_tensor(index, "shared_head_head.weight", lm), 0)])
    r_hidden = ops.result(out, name="hidden_out")
    r_hidden.output(0).set_names({"hidden_out"})
    r_token = ops.result(builder._top1(logits), name="token")
    r_token.output(0).set_names({"token"})
    return ov.Model([r_hidden, r_token], sinks, list(params), "kafila_mtp")


class MtpShard(OpenVINOShard):
    """The MTP block of `index` (a ShardSpec of that one block, head folded in). `forward` takes
    rows [e | h] (backends.gguf.hybrid.mtp_inputs), returns h' per row; `greedy(h')` is the
    token the graph computed."""

    def __init__(self, index: ModelIndex, precision: str = "serving", kquant: str | None = None) -> None:
        from backends import DEFAULT_KQUANT

        b = mtp_block(index)
        super().__init__(ShardSpec(index.path, b, b + 1, embed=False, head=True), precision, index=index,
                         kquant=kquant or DEFAULT_KQUANT)  # fmt: skip
        self._steps = None  # an attention block: no recurrent state to cut back

    def _stage_model(self, builder: StageBuilder, spec: ShardSpec) -> tuple[ov.Model, bool]:
        return mtp_model(builder), True

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        raise NotImplementedError("the MTP stage folds its greedy token in; it has no logits graph")


__all__ = ["MtpShard", "mtp_model"]
