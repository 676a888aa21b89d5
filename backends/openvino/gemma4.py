"""Gemma 4 blocks on OpenVINO, as llama.cpp 0.3.36 computes them (backends/gguf/gemma4.py has the
block, each part named; src/models/gemma4.cpp).

What differs from the stage graph's Llama block (graph.py), and why it is a builder of its own:
every block has its own head count, KV heads, head size and rotated dims, so each block's KV
variables have their own shape [B, nkv_b, S, D_b] (rows.py and the shard's slots take every
variable's shape as it is) and each kind of block its own RoPE table: windowed blocks rotate
their first `rope_dims` with the windowed base at scale 1, full blocks theirs with the model's
base, linear scale and rope_freqs factors (a factor of 1e30 leaves a pair unturned). The values
are RMS-normalised without a weight (a full block without attn_v takes its key projection as
values, before k's norm), q·k is not scaled, and the experts of a MoE block take their own
normalised input and a router input of their own (moe.py's moe_ffn, GeGLU experts) beside the
block's dense FFN.

Per-layer embeddings and shared KV (the E2B/E4B models) travel with the hidden state in a carried
row (backends/gguf/gemma4.py): `Carried` splits a stage's input into the hidden state and those
columns, the first stage computes every block's per-layer input there, a shared source writes its
step's K and V there, and a stage whose sharing blocks lack their source keeps that source's KV
variable (same name) from them.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from backends.openvino.attention import geglu
from backends.openvino.graph import _i64, apply_rope, rms_norm, rope_tables
from backends.openvino.moe import moe_ffn
from backends.openvino.window import last_columns

MAX_I64 = np.iinfo(np.int64).max


def _columns(x: ov.Output, start: int, end: int) -> ov.Output:
    return ops.slice(x, _i64(start), _i64(end), _i64(1), _i64(-1)).output(0)


class Carried:
    """A stage's carried row [B, L, C] (backends/gguf/gemma4.py): its hidden state, the blocks'
    per-layer inputs and the shared sources' step K and V, put back together by `row`."""

    def __init__(self, builder, x_in: ov.Output) -> None:
        self.b, h = builder, builder.h
        self.g, self.H = h.gemma4, h.hidden
        self.hidden = _columns(x_in, 0, self.H)
        P, n = self.g.per_layer, len(self.g.blocks)
        self.ple = _columns(x_in, self.H, self.H + n * P) if P else None
        self.kv: dict[int, ov.Output] = {}
        for s in self.g.shared_sources:
            at = self.g.kv_columns(self.H, s)
            self.kv[s] = _columns(x_in, at, at + 2 * self.g.kv_width(s))

    def per_layer_inputs(self, x0: ov.Output) -> None:
        """The first stage: every block's per-layer input from x0 (the scaled embedding [B, L, H])
        and the per_layer_token_embd rows the shard put in the per-layer columns (module docstring
        of backends/gguf/gemma4.py)."""
        h, w, P, n = self.b.h, self.b.w, self.g.per_layer, len(self.g.blocks)
        (proj,) = w.project(x0, [("per_layer_model_proj.weight", 0)])  # [B, L, n·P]
        proj = ops.multiply(proj, ops.constant(np.float32(1.0 / np.sqrt(self.H))))
        proj = rms_norm(ops.reshape(proj, _i64(0, 0, n, P), True).output(0), w.vector("per_layer_proj_norm.weight"),
                        h.rms_eps)  # fmt: skip
        rows = ops.multiply(ops.reshape(self.ple, _i64(0, 0, n, P), True), ops.constant(np.float32(np.sqrt(P))))
        both = ops.multiply(ops.add(proj, rows), ops.constant(np.float32(1.0 / np.sqrt(2.0))))
        self.ple = ops.reshape(both, _i64(0, 0, n * P), True).output(0)

    def ple_of(self, b: int) -> ov.Output:
        P = self.g.per_layer
        return _columns(self.ple, b * P, (b + 1) * P)

    def read_kv(self, s: int) -> tuple[ov.Output, ov.Output]:
        """Source s's step K and V [B, nkv, L, D] from the row."""
        g, width = self.g.blocks[s], self.g.kv_width(s)
        k, v = (ops.transpose(ops.reshape(_columns(self.kv[s], a, a + width), _i64(0, 0, g.n_kv_heads, g.head_dim),
                                          True), _i64(0, 2, 1, 3)).output(0) for a in (0, width))  # fmt: skip
        return k, v

    def write_kv(self, s: int, k: ov.Output, v: ov.Output) -> None:
        """Source s's step K and V [B, nkv, L, D] into the row."""
        width = self.g.kv_width(s)
        flat = [ops.reshape(ops.transpose(t, _i64(0, 2, 1, 3)), _i64(0, 0, width), True).output(0) for t in (k, v)]
        self.kv[s] = ops.concat(flat, axis=-1).output(0)

    def row(self, x: ov.Output) -> ov.Output:
        parts = [x] + ([self.ple] if self.ple is not None else []) + [self.kv[s] for s in self.g.shared_sources]
        return ops.concat(parts, axis=-1).output(0)


class Gemma4Blocks:
    """Builds gemma4 blocks into a StageBuilder's stage graph (StageBuilder.stage hands over)."""

    def __init__(self, builder, position_ids: ov.Output, carried: Carried | None = None) -> None:
        self.b = builder
        self.h = builder.h
        self.g = builder.h.gemma4
        self.w = builder.w
        self._positions = position_ids
        self._tables: dict[bool, tuple[ov.Output, ov.Output]] = {}
        self._carried = carried
        self._kv: dict[int, tuple[ov.Output, ov.Output]] = {}  # block → its KV (k_all, v_all), this stage's

    def _rope(self, windowed: bool, rot: int) -> tuple[ov.Output, ov.Output]:
        """cos, sin [B, 1, L, rot] of windowed (True) or full blocks, made once a stage."""
        if windowed not in self._tables:
            h, fam = self.h, self.h.family
            if windowed:
                table = rope_tables(self._positions, rot, fam.rope_base_swa)
            else:
                factors = self.b.index.dequantize("rope_freqs.weight", np.float64)[: rot // 2]
                table = rope_tables(self._positions, rot, h.rope_base, h.rope_scale, factors)
            self._tables[windowed] = table
        return self._tables[windowed]

    def _rotate(self, x: ov.Output, rot: int, head_dim: int, table: tuple[ov.Output, ov.Output]) -> ov.Output:
        """NEOX RoPE over the first `rot` dims of each head of x [B, h, L, D]; the rest pass."""
        if rot == head_dim:
            return apply_rope(x, *table, rot)
        step, axis = _i64(1), _i64(-1)
        turned = apply_rope(ops.slice(x, _i64(0), _i64(rot), step, axis).output(0), *table, rot)
        return ops.concat([turned, ops.slice(x, _i64(rot), _i64(MAX_I64), step, axis)], axis=-1).output(0)

    def block(self, b: int, x: ov.Output, masks: dict, beam_idx: ov.Output, sinks: list) -> ov.Output:
        h, g, w = self.h, self.g.blocks[b], self.w
        D, nh, nkv, eps = g.head_dim, g.n_heads, g.n_kv_heads, h.rms_eps
        p = f"blk.{b}."
        y = rms_norm(x, w.vector(p + "attn_norm.weight"), eps)  # [B, L, H]
        table = self._rope(g.windowed, g.rope_dims)
        (q,) = w.project(y, [(p + "attn_q.weight", 0)])
        q = rms_norm(ops.reshape(q, _i64(0, 0, nh, D), True).output(0), w.vector(p + "attn_q_norm.weight"), eps)
        q = self._rotate(ops.transpose(q, _i64(0, 2, 1, 3)).output(0), g.rope_dims, D, table)  # [B, nh, L, D]
        k_all, v_all = self._attended_kv(b, y, beam_idx, sinks, table)  # [B, nkv, S, D]
        mask = last_columns(masks[True], k_all) if g.windowed else masks[False]  # window.py
        if nh != nkv:
            k_all, v_all = self.b._repeat_kv(k_all, nkv, nh, D), self.b._repeat_kv(v_all, nkv, nh, D)
        attn = ops.scaled_dot_product_attention(q, k_all, v_all, mask, ops.constant(np.float32(1.0)))
        attn = ops.reshape(ops.transpose(attn, _i64(0, 2, 1, 3)), _i64(0, 0, nh * D), True)  # [B, L, nh·D]
        (o,) = w.project(attn.output(0), [(p + "attn_output.weight", 0)])  # [B, L, H]
        a = ops.add(x, rms_norm(o, w.vector(p + "post_attention_norm.weight"), eps)).output(0)

        f = self._geglu(rms_norm(a, w.vector(p + "ffn_norm.weight"), eps), p)
        if g.moe:  # the dense FFN and the experts side by side, each normalised on its way out
            f = rms_norm(f, w.vector(p + "post_ffw_norm_1.weight"), eps)
            router = ops.multiply(ops.multiply(rms_norm(a, None, eps), ops.constant(np.float32(1.0 / np.sqrt(h.hidden)))),
                                  w.vector(p + "ffn_gate_inp.scale"))  # fmt: skip
            experts = moe_ffn(w, rms_norm(a, w.vector(p + "pre_ffw_norm_2.weight"), eps), p, h.family,
                              router_x=router.output(0))  # fmt: skip
            f = ops.add(f, rms_norm(experts, w.vector(p + "post_ffw_norm_2.weight"), eps)).output(0)
        out = ops.add(a, rms_norm(f, w.vector(p + "post_ffw_norm.weight"), eps)).output(0)
        if self.g.per_layer:  # the block's per-layer input, gated by its output
            (gate,) = w.project(out, [(p + "inp_gate.weight", 0)])
            (pe,) = w.project(geglu(gate, self._carried.ple_of(b), w.kquant == "ggml"), [(p + "proj.weight", 0)])
            out = ops.add(out, rms_norm(pe, w.vector(p + "post_norm.weight"), eps)).output(0)
        if p + "layer_output_scale.weight" in self.b.index.tensors:
            out = ops.multiply(out, w.vector(p + "layer_output_scale.weight")).output(0)
        return out

    def _attended_kv(self, b: int, y: ov.Output, beam_idx: ov.Output, sinks: list,
                     table: tuple[ov.Output, ov.Output]) -> tuple[ov.Output, ov.Output]:  # fmt: skip
        """Block b's keys and values over every held position [B, nkv, S, D]: its own (written to
        the carried row too where later blocks share them), or its source's, from this stage's
        source block or, where that is another stage's, from the row into a variable of its own."""
        g, w, eps, p = self.g.blocks[b], self.w, self.h.rms_eps, f"blk.{b}."
        s = g.kv_from
        if s in self._kv:
            return self._kv[s]
        D, nkv = g.head_dim, g.n_kv_heads
        if s == b:
            parts = [(p + "attn_k.weight", 0)] + ([(p + "attn_v.weight", 0)] if g.own_values else [])
            k, *v = w.project(y, parts)
            v = v[0] if v else k  # no attn_v: the values are the key projection
            k = rms_norm(ops.reshape(k, _i64(0, 0, nkv, D), True).output(0), w.vector(p + "attn_k_norm.weight"), eps)
            v = rms_norm(ops.reshape(v, _i64(0, 0, nkv, D), True).output(0), None, eps)
            k, v = (ops.transpose(t, _i64(0, 2, 1, 3)).output(0) for t in (k, v))  # [B, nkv, L, D]
            k = self._rotate(k, g.rope_dims, D, table)
            if b in self.g.shared_sources and self._carried is not None:
                self._carried.write_kv(b, k, v)
        else:
            k, v = self._carried.read_kv(s)
        self._kv[s] = (self.b._kv_cache(f"past_key_values.{s}.key", k, beam_idx, sinks, nkv, D),
                       self.b._kv_cache(f"past_key_values.{s}.value", v, beam_idx, sinks, nkv, D))  # fmt: skip
        return self._kv[s]

    def _geglu(self, y: ov.Output, p: str) -> ov.Output:
        """down(GELU(tanh)(gate · y) ⊙ up · y): Gemma's dense FFN."""
        gate, up = self.w.project(y, [(p + "ffn_gate.weight", 0), (p + "ffn_up.weight", 0)])
        (down,) = self.w.project(geglu(gate, up, self.w.kquant == "ggml"), [(p + "ffn_down.weight", 0)])
        return down
