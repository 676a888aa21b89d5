"""Hybrid (`qwen35`) blocks on OpenVINO: the gated delta-net layer and the gated attention layer,
as llama.cpp 0.3.36 computes them (src/models/qwen35.cpp, delta-net-base.cpp, ggml-cpu's
gated_delta_net and ssm_conv).

Delta-net layer (x [B, L, H] after attn_norm):
    qkv = x·attn_qkv, z = x·attn_gate, β = σ(x·ssm_beta), g = softplus(x·ssm_alpha + ssm_dt)·ssm_a
    causal conv over time, per channel, no bias: c_t = Σ_j cat(conv_state, qkv)[t + j]·w[:, j],
    then SiLU; the conv state is the last K − 1 inputs (a stateful variable per block);
    q, k = L2-normalised heads (x / sqrt(Σx² + eps)); value head j reads
    key head j mod Hk (llama.cpp tiles, not interleaves);
    the gated delta rule over the matrix state M [Hv, S_v, S_k] (a stateful variable per block):
        M ← exp(g_t)·M;  M ← M + β_t·(v_t − M k_t) k_tᵀ;  o_t = (M q_t)/sqrt(S)
    (the scale on the output, not on q: llama.cpp's fused gated_delta_net, its CPU default);
    y = RMSNorm(o; ssm_norm) · SiLU(z) → ssm_out.
Prefill and decode both run the recurrence as a sequential scan over the step's positions, as
ggml-cpu's fused op does (exact at f32, not the chunked WY form): one KafilaDeltaRule node where
the Kafila op library loads (backends/openvino/ggml_op/delta_rule.hpp), else an OpenVINO Loop
(a dozen tiny nodes a position, which prefill paid most: docs/BENCHMARKS.md, "Hybrid
(Qwen3.5-MoE) against llama.cpp").
The states live beside the KV cache: ReadValue → Gather(beam_idx) → … → Assign, so a slot's
InferRequest holds its request's recurrent state. The matrix state is kept flat [B, Hv·S·S] and
the conv state [B, K − 1, C]: only the KV cache has 4 dimensions, which the shard's restore reads.

Attention layer: attn_q's rows are per head D query rows then D gate rows; q/k RMSNorm; RoPE on
the first rope_dims of each head (NEOX halves; IMROPE with text positions: a frequency outside the
sections sees position 0); attention as the dense blocks; output × σ(gate) → attn_output.
Every block: residual, post_attention_norm → SwiGLU FFN (qwen35moe: experts and the gated shared
expert, moe.py) → residual.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset6 as ops6

from backends.openvino.graph import I64, _i64, apply_rope, rms_norm
from backends.openvino.moe import moe_ffn, shared_expert
from backends.openvino.weights import F32

MAX_I64 = np.iinfo(np.int64).max


def partial_rope_tables(position_ids: ov.Output, inv_freq: np.ndarray) -> tuple[ov.Output, ov.Output]:
    """cos, sin [B, 1, L, R] (R = 2·len(inv_freq)) for rotate_half RoPE of the first R dims."""
    inv = ops.constant(inv_freq.astype(np.float32).reshape(1, 1, -1))
    freqs = ops.multiply(ops.unsqueeze(ops.convert(position_ids, F32), _i64(2)), inv)  # [B, L, R/2]
    emb = ops.unsqueeze(ops.concat([freqs, freqs], axis=-1), _i64(1))  # [B, 1, L, R]
    return ops.cos(emb).output(0), ops.sin(emb).output(0)


def _variable(name: str, shape: list[int]) -> ov.op.util.Variable:
    info = ov.op.util.VariableInfo()
    info.variable_id, info.data_type, info.data_shape = name, F32, ov.PartialShape(shape)
    return ov.op.util.Variable(info)


def _state(name: str, like: ov.Output, dims: list[int], beam_idx: ov.Output) -> tuple[ov.Output, ov.op.util.Variable]:
    """ReadValue (zeros [B, *dims] in a fresh request) → Gather(beam_idx, 0)."""
    var = _variable(name, [-1, *dims])
    batch = ops.gather(ops.shape_of(like, I64), _i64(0), _i64(0))  # [1]
    init = ops.broadcast(ops.constant(np.float32(0.0)), ops.concat([batch, _i64(*dims)], axis=0))
    past = ops.gather(ops6.read_value(init, var), beam_idx, _i64(0))
    return past.output(0), var


def _out(x) -> ov.Output:
    return x if isinstance(x, ov.Output) else x.output(0)


def _l2_norm(x: ov.Output, eps: float) -> ov.Output:
    """x / sqrt(Σx² + eps) over the last axis (llama.cpp's build_gdn_l2_norm)."""
    ss = ops.reduce_sum(ops.multiply(x, x), _i64(-1), keep_dims=True)
    return ops.divide(x, ops.sqrt(ops.add(ss, ops.constant(np.float32(eps))))).output(0)


def _delta_rule(q, k, v, g, beta, m0, Hv: int, S: int) -> tuple[ov.Output, ov.Output]:
    """The gated delta rule (module docstring): the op where it loads, else the Loop."""
    from backends.openvino import ggml_kernels

    if ggml_kernels.available()[0]:
        return ggml_kernels.delta_rule(q, k, v, g, beta, m0)
    return _delta_rule_loop(q, k, v, g, beta, m0, Hv, S)


def _delta_rule_loop(q, k, v, g, beta, m0, Hv: int, S: int) -> tuple[ov.Output, ov.Output]:
    """The gated delta rule over the chunk's positions: q, k, v [B, L, Hv, S], g, β [B, L, Hv],
    m0 [B, Hv, S, S] → (o [B, L, Hv, S], final M [B, Hv, S, S])."""
    # body: one position
    bq = ops.parameter([-1, 1, Hv, S], F32)
    bk = ops.parameter([-1, 1, Hv, S], F32)
    bv = ops.parameter([-1, 1, Hv, S], F32)
    bg = ops.parameter([-1, 1, Hv], F32)
    bb = ops.parameter([-1, 1, Hv], F32)
    bm = ops.parameter([-1, Hv, S, S], F32)
    q_t = ops.squeeze(bq, _i64(1))  # [B, Hv, S]
    k_t = ops.squeeze(bk, _i64(1))
    v_t = ops.squeeze(bv, _i64(1))
    decay = ops.exp(ops.unsqueeze(ops.squeeze(bg, _i64(1)), _i64(2, 3)))  # [B, Hv, 1, 1]
    m = ops.multiply(bm, decay)  # [B, Hv, S_v, S_k]
    mk = ops.reduce_sum(ops.multiply(m, ops.unsqueeze(k_t, _i64(2))), _i64(3))  # [B, Hv, S_v]
    d = ops.multiply(ops.subtract(v_t, mk), ops.unsqueeze(ops.squeeze(bb, _i64(1)), _i64(2)))  # [B, Hv, S_v]
    m = ops.add(m, ops.multiply(ops.unsqueeze(d, _i64(3)), ops.unsqueeze(k_t, _i64(2))))
    o = ops.reduce_sum(ops.multiply(m, ops.unsqueeze(q_t, _i64(2))), _i64(3))  # [B, Hv, S_v]
    o = ops.unsqueeze(o, _i64(1))  # [B, 1, Hv, S]
    cond = ops.constant(np.array([True]))
    body = ov.Model([cond.output(0), o.output(0), m.output(0)], [bq, bk, bv, bg, bb, bm], "delta_rule_step")

    steps = ops.squeeze(ops.gather(ops.shape_of(q, I64), _i64(1), _i64(0)), _i64(0))  # L
    loop = ops.loop(steps, ops.constant(np.array(True)))
    loop.set_function(body)
    loop.set_special_body_ports([-1, 0])
    for param, value in ((bq, q), (bk, k), (bv, v), (bg, g), (bb, beta)):
        loop.set_sliced_input(param, value, 0, 1, 1, -1, 1)
    loop.set_merged_input(bm, m0, m.output(0))
    out = loop.get_concatenated_slices(o.output(0), 0, 1, 1, -1, 1)
    final = loop.get_iter_value(m.output(0), -1)
    return ops.multiply(out, ops.constant(np.float32(1.0) / np.sqrt(np.float32(S)))).output(0), final


class HybridBlocks:
    """Builds qwen35 blocks into a StageBuilder's stage graph (StageBuilder.block hands over)."""

    def __init__(self, builder) -> None:
        self.b = builder
        self.h = builder.h
        self.y = builder.h.hybrid
        self.w = builder.w
        self._tables: dict[int, tuple[ov.Output, ov.Output]] = {}

    def block(self, b: int, x: ov.Output, position_ids: ov.Output, mask: ov.Output, beam_idx: ov.Output,
              sinks: list) -> ov.Output:
        h, p = self.h, f"blk.{b}."
        y = rms_norm(x, self.w.vector(p + "attn_norm.weight"), h.rms_eps)
        if self.y.recurrent[b]:
            a = self.delta_net(b, y, beam_idx, sinks)
        else:
            a = self.attention(b, y, position_ids, mask, beam_idx, sinks)
        x = ops.add(x, a).output(0)
        y = rms_norm(x, self.w.vector(p + "post_attention_norm.weight"), h.rms_eps)
        if h.family.n_experts:  # qwen35moe: routed experts and the gated shared expert
            down = ops.add(moe_ffn(self.w, y, p, h.family), shared_expert(self.w, y, p)).output(0)
        else:
            down = self.w.swiglu(y, p)
        return ops.add(x, down).output(0)

    def attention(self, b: int, y: ov.Output, position_ids: ov.Output, mask: ov.Output, beam_idx: ov.Output,
                  sinks: list) -> ov.Output:
        h, p, hy = self.h, f"blk.{b}.", self.y
        D, nh, nkv, R = h.head_dim, h.n_heads, h.n_kv_heads, hy.rope_dims
        qg, k, v = self.w.project(y, [(p + "attn_q.weight", 0), (p + "attn_k.weight", 0), (p + "attn_v.weight", 0)])
        qg = ops.reshape(qg, _i64(0, 0, nh, 2 * D), True)  # [B, L, nh, 2D]: per head q then gate
        q = ops.slice(qg, _i64(0), _i64(D), _i64(1), _i64(-1))
        gate = ops.reshape(ops.slice(qg, _i64(D), _i64(2 * D), _i64(1), _i64(-1)), _i64(0, 0, nh * D), True)
        q = rms_norm(q, self.w.vector(p + "attn_q_norm.weight"), h.rms_eps)
        k = rms_norm(ops.reshape(k, _i64(0, 0, nkv, D), True), self.w.vector(p + "attn_k_norm.weight"), h.rms_eps)
        q = ops.transpose(q, _i64(0, 2, 1, 3))  # [B, nh, L, D]
        k = ops.transpose(k, _i64(0, 2, 1, 3))  # [B, nkv, L, D]
        v = ops.transpose(ops.reshape(v, _i64(0, 0, nkv, D), True), _i64(0, 2, 1, 3))
        if id(position_ids) not in self._tables:  # one pair of tables for the stage
            self._tables[id(position_ids)] = partial_rope_tables(position_ids, hy.rope_inv_freq(h.rope_base))
        cos, sin = self._tables[id(position_ids)]
        q, k = self._rope(q, cos, sin, R, D), self._rope(k, cos, sin, R, D)
        k_all = self.b._kv_cache(f"past_key_values.{b}.key", k, beam_idx, sinks)
        v_all = self.b._kv_cache(f"past_key_values.{b}.value", v, beam_idx, sinks)
        if nh != nkv:
            k_all, v_all = self.b._repeat_kv(k_all), self.b._repeat_kv(v_all)
        attn = ops.scaled_dot_product_attention(q, k_all, v_all, mask, ops.constant(np.float32(1.0 / np.sqrt(D))))
        attn = ops.reshape(ops.transpose(attn, _i64(0, 2, 1, 3)), _i64(0, 0, nh * D), True)  # [B, L, nh·D]
        attn = ops.multiply(attn, ops.sigmoid(gate))
        (o,) = self.w.project(attn.output(0), [(p + "attn_output.weight", 0)])
        return o

    @staticmethod
    def _rope(x: ov.Output, cos: ov.Output, sin: ov.Output, R: int, D: int) -> ov.Output:
        if R == D:
            return apply_rope(x, cos, sin, R)
        rot = apply_rope(ops.slice(x, _i64(0), _i64(R), _i64(1), _i64(-1)).output(0), cos, sin, R)
        return ops.concat([rot, ops.slice(x, _i64(R), _i64(D), _i64(1), _i64(-1))], axis=-1).output(0)

    def delta_net(self, b: int, y: ov.Output, beam_idx: ov.Output, sinks: list) -> ov.Output:
        h, p, hy = self.h, f"blk.{b}.", self.y
        S, Hk, Hv, K, C = hy.state, hy.k_heads, hy.v_heads, hy.conv_kernel, hy.conv_channels
        if hy.interleaved:  # qwen3next (backends/gguf/hybrid.py)
            qkv, z, beta, alpha = self._qwen3next_inputs(b, y)
        else:
            qkv, z, beta, alpha = self.w.project(y, [(p + "attn_qkv.weight", 0), (p + "attn_gate.weight", 0),
                                                     (p + "ssm_beta.weight", 0), (p + "ssm_alpha.weight", 0)])
        beta = ops.sigmoid(beta)  # [B, L, Hv]
        dt = ops.add(alpha, self.w.vector(p + "ssm_dt.bias"))
        g = ops.multiply(ops.softplus(dt), self.w.vector(p + "ssm_a"))  # [B, L, Hv], ≤ 0
        # causal conv: the last K − 1 inputs of earlier chunks, then this chunk's
        past, var = _state(f"recurrent.{b}.conv", qkv, [K - 1, C], beam_idx)
        cin = ops.concat([past, qkv], axis=1)  # [B, K − 1 + L, C]
        sinks.append(ops6.assign(ops.slice(cin, _i64(-(K - 1)), _i64(MAX_I64), _i64(1), _i64(1)), var))
        wconv = self.b.index.dequantize(p + "ssm_conv1d.weight", np.float32)  # [C, K]
        conv = None
        for j in range(K):
            stop = -(K - 1 - j) if j < K - 1 else MAX_I64
            term = ops.multiply(ops.slice(cin, _i64(j), _i64(stop), _i64(1), _i64(1)),
                                ops.constant(np.ascontiguousarray(wconv[:, j])))
            conv = term if conv is None else ops.add(conv, term)
        conv = ops.swish(conv)  # [B, L, C]
        kd = Hk * S
        q = ops.reshape(ops.slice(conv, _i64(0), _i64(kd), _i64(1), _i64(-1)), _i64(0, 0, Hk, S), True)
        k = ops.reshape(ops.slice(conv, _i64(kd), _i64(2 * kd), _i64(1), _i64(-1)), _i64(0, 0, Hk, S), True)
        v = ops.reshape(ops.slice(conv, _i64(2 * kd), _i64(MAX_I64), _i64(1), _i64(-1)), _i64(0, 0, Hv, S), True)
        q = _l2_norm(q, h.rms_eps)
        k = _l2_norm(k, h.rms_eps)
        if Hv != Hk and hy.interleaved:  # value head j reads key head j // r (qwen3next)
            q, k = (ops.reshape(ops.concat([ops.unsqueeze(t, _i64(3))] * (Hv // Hk), axis=3), _i64(0, 0, Hv, S), True)
                    for t in (q, k))  # fmt: skip
        elif Hv != Hk:  # value head j reads key head j mod Hk
            q = ops.concat([q] * (Hv // Hk), axis=2)
            k = ops.concat([k] * (Hv // Hk), axis=2)
        flat, mvar = _state(f"recurrent.{b}.matrix", qkv, [Hv * S * S], beam_idx)
        m0 = ops.reshape(flat, _i64(0, Hv, S, S), True)
        o, m = _delta_rule(*(_out(t) for t in (q, k, v, g, beta, m0)), Hv, S)
        sinks.append(ops6.assign(ops.reshape(m, _i64(0, Hv * S * S), True), mvar))
        o = rms_norm(o, self.w.vector(p + "ssm_norm.weight"), h.rms_eps)  # [B, L, Hv, S]
        o = ops.multiply(o, ops.swish(ops.reshape(z, _i64(0, 0, Hv, S), True)))
        (out,) = self.w.project(ops.reshape(o, _i64(0, 0, Hv * S), True).output(0), [(p + "ssm_out.weight", 0)])
        return out

    def _qwen3next_inputs(self, b: int, y: ov.Output) -> tuple[ov.Output, ov.Output, ov.Output, ov.Output]:
        """qwen3next's q|k|v [B, L, C], z, β and α logits [B, L, Hv] from its per-key-head layouts."""
        p, hy = f"blk.{b}.", self.y
        S, Hk, Hv = hy.state, hy.k_heads, hy.v_heads
        r = Hv // Hk
        if p + "attn_qkv.weight" in self.b.index.tensors:
            names = ("attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight")
            qkv, z, ba = self.w.project(y, [(p + n, 0) for n in names])
        else:  # legacy ssm_in: per key head q S, k S, v r·S, z r·S
            mixed, ba = self.w.project(y, [(p + "ssm_in.weight", 0), (p + "ssm_ba.weight", 0)])
            g = ops.reshape(mixed, _i64(0, 0, Hk, 2 * S + 2 * r * S), True)
            def part(a: int, z_: int, n: int) -> ov.Output:
                return ops.reshape(ops.slice(g, _i64(a), _i64(z_), _i64(1), _i64(-1)), _i64(0, 0, n), True)

            qkv = ops.concat([part(0, S, Hk * S), part(S, 2 * S, Hk * S), part(2 * S, 2 * S + r * S, Hv * S)], axis=-1)
            z = part(2 * S + r * S, 2 * S + 2 * r * S, Hv * S)
        ba = ops.reshape(ba, _i64(0, 0, Hk, 2 * r), True)  # per key head: r betas, then r alphas
        beta = ops.reshape(ops.slice(ba, _i64(0), _i64(r), _i64(1), _i64(-1)), _i64(0, 0, Hv), True)
        alpha = ops.reshape(ops.slice(ba, _i64(r), _i64(2 * r), _i64(1), _i64(-1)), _i64(0, 0, Hv), True)
        return _out(qkv), _out(z), _out(beta), _out(alpha)
