"""A stage's OpenVINO graph, built from GGUF tensors with the opset API (no torch, no export).

Stage graph (blocks [first, last); a first stage's shard looks up the embedding's rows itself):

    hidden_states f32 [B, L, H]
    attention_mask i64 [B, S]   physical positions past + new (S = past + L), 0 = masked out
    position_ids i64 [B, L]     logical positions of the new tokens (RoPE)
    beam_idx i32 [B]            KV rows to keep, in order: [0] for a slot's own request (the pattern
                                the plugins' KV fusion needs); a row group's rows (rows.py)
    → hidden_states f32 [B, L, H] after block last − 1

(A Gemma 4 file with per-layer embeddings or shared KV: rows of `hparams.carried` columns, H first:
backends/openvino/gemma4.py's Carried.)

Head graph: hidden f32 [N, H] → final RMSNorm → lm_head → logits f32 [N, V], plus
token i64 [1], the greedy top-1 of the last row (so a decode step reads one id, not V floats).
A shard holding both the last block and the head folds norm + lm_head + top-1 of the last row
into its stage graph as a second output `token` i64 [1] (one inference per decode step; batched
rows take their tokens from the head graph).

Each block is Llama's: RMSNorm → q/k/v (+ Qwen2 biases) → (Qwen3: RMSNorm per q/k head) → RoPE
(rotate_half) → KV per layer as ReadValue → Gather(beam_idx, 0) → Concat(axis 2) → Assign →
GQA broadcast → ScaledDotProductAttention(mask) → o_proj → residual → RMSNorm → SwiGLU → residual.
RoPE is rotate_half throughout: llama's q/k rows (permuted in GGUF for pairwise "normal" RoPE)
are un-permuted into HF order first; qwen2/qwen3 rows are already in that order ("neox" RoPE).
The angle tables fold in llama3's rope_freqs factors and linear scaling: θ_i = p·scale·base^(−2i/D)/f_i.

Families (backends/gguf/families.py) change parts of the block: Gemma 3 scales the embedding,
normalizes the attention and FFN outputs before their residual adds, uses GeGLU, its own q·k
scale and soft-capped logits, and its windowed layers take a second mask and RoPE table
(backends/openvino/attention.py); MoE families replace the FFN by backends/openvino/moe.py's.
gpt-oss adds the attention output's bias and per-head sinks, YaRN-scaled RoPE tables (the windowed
layers' too), normalizes the FFN's input with post_attention_norm, and routes its biased experts
by a softmax over the top k (moe.py).
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset6 as ops6

from backends.gguf import ModelIndex
from backends.gguf.families import Yarn, yarn_magnitude, yarn_multipliers
from backends.openvino.attention import attention_with_sinks, geglu, softcap, window_mask
from backends.openvino.moe import moe_ffn, shared_expert
from backends.openvino.window import last_columns
from backends.openvino.weights import F32, WeightBank

I64 = ov.Type.i64


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


def rms_norm(x: ov.Output, weight: ov.Node | None, eps: float) -> ov.Output:
    """x · 1/sqrt(mean(x²) + eps) · weight (the pattern the plugins fuse into RMS); no weight: × 1."""
    var = ops.reduce_mean(ops.power(x, ops.constant(np.float32(2.0))), _i64(-1), keep_dims=True)
    inv = ops.divide(ops.constant(np.float32(1.0)), ops.sqrt(ops.add(var, ops.constant(np.float32(eps)))))
    normed = ops.multiply(x, inv)
    return (normed if weight is None else ops.multiply(normed, weight)).output(0)


def rope_tables(position_ids: ov.Output, head_dim: int, base: float, scale: float = 1.0,
                factors: np.ndarray | None = None, yarn: Yarn | None = None) -> tuple[ov.Output, ov.Output]:
    """cos, sin [B, 1, L, D] for rotate_half RoPE at the given logical positions; frequency i is
    scale·base^(−2i/D) / factors[i] (linear scaling, llama3 rope_freqs), × YaRN's multiplier i,
    cos and sin × YaRN's magnitude (attention.py)."""
    inv_freq = scale / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [D/2]
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, np.float64)
    if yarn is not None:
        inv_freq = inv_freq * yarn_multipliers(yarn, head_dim, base)
    inv_freq = ops.constant(inv_freq.astype(np.float32).reshape(1, 1, -1))  # [1, 1, D/2]
    pos = ops.unsqueeze(ops.convert(position_ids, F32), _i64(2))  # [B, L, 1]
    freqs = ops.multiply(pos, inv_freq)  # [B, L, D/2]
    emb = ops.concat([freqs, freqs], axis=-1)  # [B, L, D]
    emb = ops.unsqueeze(emb, _i64(1))  # [B, 1, L, D]
    cos, sin = ops.cos(emb).output(0), ops.sin(emb).output(0)
    if yarn is not None and yarn_magnitude(yarn) != 1.0:
        magnitude = ops.constant(np.float32(yarn_magnitude(yarn)))
        cos, sin = ops.multiply(cos, magnitude).output(0), ops.multiply(sin, magnitude).output(0)
    return cos, sin


def apply_rope(x: ov.Output, cos: ov.Output, sin: ov.Output, head_dim: int) -> ov.Output:
    """x [B, h, L, D] · cos + rotate_half(x) · sin, rotate_half(x) = cat(−x[..., D/2:], x[..., :D/2])
    (written as HF's export writes it, the shape the plugins' RoPE fusion matches)."""
    half, axis, step = _i64(head_dim // 2), _i64(-1), _i64(1)
    x2 = ops.slice(x, half, _i64(np.iinfo(np.int64).max), step, axis)  # [B, h, L, D/2]
    x1 = ops.slice(x, _i64(0), half, step, axis)  # [B, h, L, D/2]
    rotated = ops.concat([ops.multiply(x2, ops.constant(np.float32(-1.0))), x1], axis=-1)
    return ops.add(ops.multiply(x, cos), ops.multiply(rotated, sin)).output(0)


def causal_mask(attention_mask: ov.Output, new_len: ov.Output) -> ov.Output:
    """f32 [B, 1, L, S], 0 where new token i sees physical position j (j ≤ S − L + i and
    mask[j] ≠ 0), the lowest f32 elsewhere: added to the scores. A boolean mask gives the same
    result, but the CPU plugin's attention kernel ran far slower with it on a prompt (the default
    model's prefill of 512 positions 5.2× as long, of 2048 11×: bench/prefill.py, docs/BENCHMARKS.md)."""
    total = ops.gather(ops.shape_of(attention_mask, I64), _i64(1), _i64(0))  # [1] S
    zero, one = _i64(0), _i64(1)
    start, step = ops.constant(np.int64(0)), ops.constant(np.int64(1))
    j = ops.range(start, ops.squeeze(total, zero), step, I64)  # [S]
    i = ops.range(start, ops.squeeze(new_len, zero), step, I64)  # [L]
    last_visible = ops.add(i, ops.subtract(total, new_len))  # [L]: S − L + i
    causal = ops.less_equal(ops.unsqueeze(j, zero), ops.unsqueeze(last_visible, one))  # [L, S]
    visible = ops.not_equal(attention_mask, ops.constant(np.int64(0)))  # [B, S]
    visible = ops.unsqueeze(visible, _i64(1, 2))  # [B, 1, 1, S]
    seen = ops.logical_and(ops.unsqueeze(causal, zero), visible)  # [B, 1, L, S]
    return ops.select(seen, ops.constant(np.float32(0.0)), ops.constant(np.finfo(np.float32).min)).output(0)


def round_to_f16_mantissa(x: ov.Output) -> ov.Output:
    """x with its mantissa rounded to f16's 11 bits, in f32 arithmetic (Veltkamp's split: c = x·(2¹³ + 1),
    x − … = c − (c − x)); the plugin folds a Convert f32 → f16 → f32 pair away."""
    c = ops.multiply(x, ops.constant(np.float32(8193.0)))
    return ops.subtract(c, ops.subtract(c, x)).output(0)


class StageBuilder:
    """Builds the stage graph for blocks [first, last) of one GGUF model."""

    def __init__(self, index: ModelIndex, weights: WeightBank, f16_kv: bool = False) -> None:
        self.index = index
        self.h = index.hparams
        self.w = weights
        self.f16_kv = f16_kv

    def block(self, b: int, x: ov.Output, rope: dict, masks: dict, beam_idx: ov.Output, sinks: list) -> ov.Output:
        """Block b; `rope` and `masks` map windowed (True) / full (False) to (cos, sin) and mask."""
        h, fam = self.h, self.h.family
        cos, sin = rope[fam.windowed(b)]
        mask = masks[fam.windowed(b)]
        D, nh, nkv = h.head_dim, h.n_heads, h.n_kv_heads
        p = f"blk.{b}."
        # llama: un-permute q/k rows (and whatever lies along them) into HF order; qwen: as stored
        qh, kh, dh = (0, 0, 0) if h.rope_neox else (nh, nkv, 1)

        # attention
        y = rms_norm(x, self.w.vector(p + "attn_norm.weight"), h.rms_eps)  # [B, L, H]
        q, k, v = self.w.project(y, [(p + "attn_q.weight", qh), (p + "attn_k.weight", kh),
                                     (p + "attn_v.weight", 0)])  # [B, L, nh·D], [B, L, nkv·D] ×2 (+ biases)
        q = ops.reshape(q, _i64(0, 0, nh, D), True)  # [B, L, nh, D]
        k = ops.reshape(k, _i64(0, 0, nkv, D), True)  # [B, L, nkv, D]
        if h.qk_norm:  # qwen3: RMSNorm over each head's D values
            q = rms_norm(q, self.w.vector(p + "attn_q_norm.weight", dh), h.rms_eps)
            k = rms_norm(k, self.w.vector(p + "attn_k_norm.weight", dh), h.rms_eps)
        q = ops.transpose(q, _i64(0, 2, 1, 3))  # [B, nh, L, D]
        k = ops.transpose(k, _i64(0, 2, 1, 3))  # [B, nkv, L, D]
        v = ops.transpose(ops.reshape(v, _i64(0, 0, nkv, D), True), _i64(0, 2, 1, 3))  # [B, nkv, L, D]
        q = apply_rope(q, cos, sin, D)
        k = apply_rope(k, cos, sin, D)

        k_all = self._kv_cache(f"past_key_values.{b}.key", k, beam_idx, sinks)  # [B, nkv, S, D]
        v_all = self._kv_cache(f"past_key_values.{b}.value", v, beam_idx, sinks)  # [B, nkv, S, D]
        if fam.windowed(b):  # its KV holds the newest columns only (window.py)
            mask = last_columns(mask, k_all)
        if nh != nkv:
            k_all, v_all = self._repeat_kv(k_all), self._repeat_kv(v_all)  # [B, nh, S, D]
        scale = fam.attn_scale or 1.0 / np.sqrt(D)
        if fam.attn_sinks:  # gpt-oss: a learnt logit per head in each softmax denominator
            attn = attention_with_sinks(q, k_all, v_all, mask, scale, self.w.vector(p + "attn_sinks.weight"), nh)
        else:
            attn = ops.scaled_dot_product_attention(q, k_all, v_all, mask, ops.constant(np.float32(scale)))
        attn = ops.reshape(ops.transpose(attn, _i64(0, 2, 1, 3)), _i64(0, 0, nh * D), True)  # [B, L, nh·D]
        (o,) = self.w.project(attn.output(0), [(p + "attn_output.weight", 0)])  # [B, L, H]
        if fam.post_norms:  # Gemma: the attention's output normalized before the residual add
            o = rms_norm(o, self.w.vector(p + "post_attention_norm.weight"), h.rms_eps)
        x = ops.add(x, o).output(0)

        y = rms_norm(x, self.w.vector(p + fam.ffn_norm), h.rms_eps)
        if fam.n_experts:  # mixture of experts (backends/openvino/moe.py)
            down = moe_ffn(self.w, y, p, fam)
            if fam.shared_expert:
                down = ops.add(down, shared_expert(self.w, y, p)).output(0)
            return ops.add(x, down).output(0)  # [B, L, H]
        # feed-forward (SwiGLU; Gemma: GeGLU)
        if fam.ffn_act == "gelu_tanh":
            gate, up = self.w.project(y, [(p + "ffn_gate.weight", 0), (p + "ffn_up.weight", 0)])  # [B, L, F] ×2
            (down,) = self.w.project(geglu(gate, up, self.w.kquant == "ggml"), [(p + "ffn_down.weight", 0)])
        else:
            down = self.w.swiglu(y, p)  # [B, L, H]
        if fam.post_norms:
            down = rms_norm(down, self.w.vector(p + "post_ffw_norm.weight"), h.rms_eps)
        return ops.add(x, down).output(0)  # [B, L, H]

    def _kv_cache(self, name: str, new: ov.Output, beam_idx: ov.Output, sinks: list, nkv: int = 0,
                  head_dim: int = 0) -> ov.Output:
        """ReadValue → Gather(beam_idx, 0) → Concat(axis 2) → Assign: past + new [B, nkv, S, D]
        (nkv, head_dim: the model's unless given: gemma4's blocks differ)."""
        nkv, head_dim = nkv or self.h.n_kv_heads, head_dim or self.h.head_dim
        shape = ov.PartialShape([-1, nkv, -1, head_dim])
        info = ov.op.util.VariableInfo()
        info.variable_id, info.data_type, info.data_shape = name, F32, shape
        var = ov.op.util.Variable(info)
        batch = ops.gather(ops.shape_of(new, I64), _i64(0), _i64(0))  # [1]
        init = ops.broadcast(ops.constant(np.float32(0.0)),
                             ops.concat([batch, _i64(nkv, 0, head_dim)], axis=0))  # [B, nkv, 0, D]
        past = ops6.read_value(init, var)
        past = ops.gather(past, beam_idx, _i64(0))
        if self.f16_kv:
            new = round_to_f16_mantissa(new)
        both = ops.concat([past, new], axis=2)
        sinks.append(ops6.assign(both, var))
        return both.output(0)

    def _repeat_kv(self, kv: ov.Output, nkv: int = 0, nh: int = 0, head_dim: int = 0) -> ov.Output:
        """[B, nkv, S, D] → [B, nh, S, D], each KV head shared by nh/nkv query heads (the model's
        counts unless given)."""
        nkv, nh, head_dim = nkv or self.h.n_kv_heads, nh or self.h.n_heads, head_dim or self.h.head_dim
        shape = ops.shape_of(kv, I64)  # [4]
        b = ops.gather(shape, _i64(0), _i64(0))  # [1] B
        s = ops.gather(shape, _i64(2), _i64(0))  # [1] S
        x = ops.unsqueeze(kv, _i64(2))  # [B, nkv, 1, S, D]
        target = ops.concat([b, _i64(nkv, nh // nkv), s, _i64(head_dim)], axis=0)
        x = ops.broadcast(x, target, broadcast_spec="BIDIRECTIONAL")  # [B, nkv, g, S, D]
        return ops.reshape(x, ops.concat([b, _i64(nh), s, _i64(head_dim)], axis=0), False).output(0)

    def stage(self, first: int, last: int, top1: bool = False) -> ov.Model:
        """The model of blocks [first, last). With `top1` (the shard also holds the head and the
        last block) a second output `token` i64 [1] is the greedy top-1 after the last row: a
        decode step is then one inference."""
        params = x_in, attention_mask, position_ids, beam_idx = self.parameters(self.h.carried)
        x = x_in.output(0)  # [B, L, H]
        carried = None
        if self.h.carried != self.h.hidden:  # Gemma 4's per-layer inputs and shared KV travel along
            from backends.openvino.gemma4 import Carried

            carried = Carried(self, x)
            x = carried.hidden
        new_len = ops.gather(ops.shape_of(position_ids, I64), _i64(1), _i64(0))  # [1] L
        mask = causal_mask(attention_mask.output(0), new_len)  # [B, 1, L, S]
        h, fam = self.h, self.h.family
        rope, masks = {}, {False: mask}
        if h.gemma4 is None:  # gemma4's blocks make their own tables (gemma4.py)
            factors = self.index.dequantize("rope_freqs.weight", np.float64) if h.rope_freq_factors else None
            rope[False] = rope_tables(position_ids.output(0), h.head_dim, h.rope_base, h.rope_scale, factors, fam.yarn)
        windowed = any(fam.windowed(b) for b in range(first, last))
        if windowed and h.gemma4 is None:  # windowed layers: own RoPE base (Gemma: scale 1)
            swa_scale = h.rope_scale if fam.swa_rope_scaled else 1.0
            rope[True] = rope_tables(position_ids.output(0), h.head_dim, fam.rope_base_swa, swa_scale, yarn=fam.yarn)
        if windowed:
            masks[True] = window_mask(mask, attention_mask.output(0), position_ids.output(0), fam.sliding_window)
        if first == 0 and fam.embed_scale != 1.0:  # Gemma: the embedding's rows × sqrt(hidden)
            x = ops.multiply(x, ops.constant(np.float32(fam.embed_scale))).output(0)
        if first == 0 and carried is not None and h.gemma4.per_layer:
            carried.per_layer_inputs(x)
        sinks: list = []
        if h.hybrid is not None:  # delta-net and gated attention blocks (qwen35): delta_net.py
            from backends.openvino.delta_net import HybridBlocks

            hybrid = HybridBlocks(self)
        if h.gemma4 is not None:  # blocks of their own geometry each: gemma4.py
            from backends.openvino.gemma4 import Gemma4Blocks

            gemma4 = Gemma4Blocks(self, position_ids.output(0), carried)
        for b in range(first, last):
            if h.hybrid is not None:
                x = hybrid.block(b, x, position_ids.output(0), mask, beam_idx.output(0), sinks)
                continue
            if h.gemma4 is not None:
                x = gemma4.block(b, x, masks, beam_idx.output(0), sinks)
                continue
            x = self.block(b, x, rope, masks, beam_idx.output(0), sinks)
        out = ops.result(x if carried is None else carried.row(x), name="hidden_out")
        out.output(0).set_names({"hidden_out"})  # not "hidden_states": that names the input
        results = [out]
        if top1:
            last_row = ops.reshape(ops.gather(x, _i64(-1), _i64(1)), _i64(-1, self.h.hidden), False)  # [B, H]
            # the last row's token only, as the head graph computes it: a TopK straight over all
            # rows' logits made the CPU plugin compile this lm_head differently, and a one-stage
            # chain's greedy tokens parted from a split chain's at serving precision
            r_token = ops.result(self._top1(self._lm_head(last_row.output(0))), name="token")
            r_token.output(0).set_names({"token"})
            results.append(r_token)
        return ov.Model(results, sinks, list(params), f"kafila_stage_{first}_{last}")

    @staticmethod
    def parameters(width: int) -> tuple[ov.Node, ov.Node, ov.Node, ov.Node]:
        """A stage graph's inputs, named (module docstring): hidden_states f32 [B, L, width],
        attention_mask i64 [B, S], position_ids i64 [B, L], beam_idx i32 [B]."""
        x_in = ops.parameter([-1, -1, width], F32, name="hidden_states")
        attention_mask = ops.parameter([-1, -1], I64, name="attention_mask")
        position_ids = ops.parameter([-1, -1], I64, name="position_ids")
        beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
        for param, name in ((x_in, "hidden_states"), (attention_mask, "attention_mask"),
                            (position_ids, "position_ids"), (beam_idx, "beam_idx")):
            param.output(0).set_names({name})
        return x_in, attention_mask, position_ids, beam_idx

    def _lm_head(self, hidden: ov.Output) -> ov.Output:
        """[N, H] → final RMSNorm → lm_head → logits [N, V]."""
        y = rms_norm(hidden, self.w.vector("output_norm.weight"), self.h.rms_eps)
        name = "token_embd.weight" if self.h.tied_embeddings else "output.weight"
        (logits,) = self.w.project(y, [(name, 0)])
        if self.h.family.logit_softcap:
            logits = softcap(logits, self.h.family.logit_softcap)
        return logits

    @staticmethod
    def _top1(logits: ov.Output) -> ov.Output:
        """The greedy token i64 [1] of the last row of logits [N, V]."""
        last = ops.gather(logits, _i64(-1), _i64(0))  # [1, V]
        topk = ops.topk(last, ops.constant(np.int64(1)), axis=-1, mode="max", sort="none", index_element_type=I64)
        return ops.reshape(topk.output(1), _i64(1), False).output(0)  # [1]

    def head(self) -> ov.Model:
        """Final norm + lm_head: hidden [N, H] → logits [N, V] and the last row's top-1 token [1]."""
        hidden = ops.parameter([-1, self.h.carried], F32, name="hidden")
        hidden.output(0).set_names({"hidden"})
        x = hidden.output(0)
        if self.h.carried != self.h.hidden:  # a carried row (gemma4.py): its hidden state
            x = ops.slice(x, _i64(0), _i64(self.h.hidden), _i64(1), _i64(-1)).output(0)
        logits = self._lm_head(x)  # [N, V]
        token = self._top1(logits)  # [1]
        r_logits = ops.result(logits, name="logits")
        r_logits.output(0).set_names({"logits"})
        r_token = ops.result(token, name="token")
        r_token.output(0).set_names({"token"})
        return ov.Model([r_logits, r_token], [hidden], "kafila_head")
