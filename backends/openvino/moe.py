"""Mixture-of-experts feed-forward in the stage graph, as llama.cpp's build_moe_ffn computes it.

    x [T, H] → router logits = ffn_gate_inp · x [T, E] → softmax → top-k (values w [T, k], ids [T, k])
    → (qwen3moe, Mixtral: w / max(Σw, 2^−14)) (× expert_weights_scale when set)
    → Σ_j w_j · down_j(silu(gate_j · x) ⊙ up_j · x)          (+ qwen2moe's gated shared expert)

gpt-oss: logits + ffn_gate_inp.bias → top-k of the logits → w = softmax over those k; each expert's
gate, up and down add their bias rows (Gathered by the same expert ids as the weights), and the
activation is swiglu_oai(gate_j · x + bg_j, up_j · x + bu_j) (backends/openvino/attention.py).

Only the experts some row selected are read: the ids of all rows go through Unique (U ≤ min(E,
T·k) experts, sorted), and each 3-D expert tensor's codes are Gathered by those ids before they
are decompressed, so a decode step (T = 1) reads k of E experts' bytes, a batch of rows the
union of theirs, and a long prompt chunk (U → E) every expert once. Each of the U experts is
applied to all T rows ([U, T, ·] batched MatMuls) and the rows that did not pick it get weight 0:
exact (a 0 weight times a finite value), at U/k times the decode FLOPs of a per-row dispatch —
compute a bandwidth-bound decode step has to spare; a prompt's chunk computes E/k times its
FFN work.

In the ggml form (`--kquant ggml`) the experts after the router are one GgmlMoe node, llama.cpp's
own arithmetic on the file's blocks (backends/openvino/ggml_kernels.py), where no per-expert
scale applies; GgmlMatMulId's rows otherwise.

Expert weights are kept as codes and f32 scales and offsets [E, out, groups, 1]: u4 / i4 codes
[E, out, groups, group] for Q4_0, Q4_1, Q4_K, Q2_K and Q3_K (two a byte), one byte a code for
the others (i8 / u8; MXFP4 and IQ4 as their tables' values); F32/F16/BF16 experts are f32
[E, out, in]. Decompression is exact in f32: (q − bias)·scale (+ offset), as
backends/gguf/quant.py's QuantBlocks computes it.
"""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops

from backends.gguf.families import FUSED_GATE_UP_EXPS, Family
from backends.gguf.optional import applied_scale
from backends.gguf.quant import CODE_BIAS, FLOAT_TYPES, split_blocks
from backends.openvino.attention import geglu, swiglu_oai
from backends.openvino.lowbit import pack_i4

I64 = ov.Type.i64
F32 = ov.Type.f32
WEIGHTS_SUM_MIN = 6.103515625e-5  # llama.cpp clamps Σw below by the smallest normal f16
# bench/moe.py's baseline: every expert read and applied at every step (the same answer)
READ_ALL_EXPERTS = False
# the integer 4-bit types' codes as OpenVINO keeps them (Q2_K's 0..3 and Q3_K's −4..3 fit too)
FOUR_BIT = {"Q4_0": ov.Type.u4, "Q4_1": ov.Type.u4, "Q4_K": ov.Type.u4, "Q2_K": ov.Type.u4, "Q3_K": ov.Type.i4}


def _i64(*values: int) -> ov.Node:
    return ops.constant(np.array(values, dtype=np.int64))


class Experts:
    """One 3-D expert tensor [E, out, in] as constants, decompressed after a Gather by expert ids.

    The integer 4-bit types keep their codes as OpenVINO u4 / i4 constants (FOUR_BIT, two codes a
    byte), which Gather takes by whole experts and Convert decompresses at the plugin's speed (the
    same decode time as one byte a code; a nibble unpacking written as graph arithmetic took 3.5×).
    The other types keep one byte a code, MXFP4 and IQ4 as their table's values: OpenVINO
    2026.4's Gather on f4e2m1 returns wrong values and can crash the process, and a table lookup
    after the Gather took 4× the decode time (backends/memory.py prices experts as held here)."""

    def __init__(self, bank, name: str, rows: tuple[int, int] | None = None) -> None:
        index = bank.index
        t = index.tensors[name]
        E, out, cols = t.shape
        a, z = rows or (0, out)  # a fused tensor's part: rows a..z of each expert
        self.shape = (E, z - a, cols)
        if t.qtype in FLOAT_TYPES:
            self.dense = bank._const(index.dequantize(name, np.float32).reshape(E, out, cols)[:, a:z])
            return
        self.dense = None
        b = split_blocks(t.qtype, index.raw(name), E * out, cols)
        groups, group = b.q.shape[1], b.q.shape[2]
        q = b.q.reshape(E, out, groups, group)[:, a:z]
        scale = b.scale.astype(np.float32).reshape(E, out, groups, 1)[:, a:z]
        if t.qtype in FOUR_BIT:
            self.codes = bank._const(pack_i4(q), FOUR_BIT[t.qtype], q.shape)
        else:
            self.codes = bank._const(q.astype(np.int8) if q.dtype == np.int8 else q)
        self.bias = float(CODE_BIAS.get(t.qtype, 0))
        self.scale = bank._const(scale)
        self.offset = None if b.offset is None else bank._const(
            b.offset.astype(np.float32).reshape(E, out, groups, 1)[:, a:z])

    def take(self, ids: ov.Output) -> ov.Output:
        """The weights of experts `ids` [U]: f32 [U, out, in]."""
        _, out, cols = self.shape
        axis = _i64(0)
        if self.dense is not None:
            return ops.gather(self.dense, ids, axis).output(0)
        w = ops.convert(ops.gather(self.codes, ids, axis), F32)  # [U, out, groups, group]
        if self.bias:
            w = ops.subtract(w, ops.constant(np.float32(self.bias)))
        w = ops.multiply(w, ops.gather(self.scale, ids, axis))
        if self.offset is not None:
            w = ops.add(w, ops.gather(self.offset, ids, axis))
        return ops.reshape(w, _i64(-1, out, cols), False).output(0)  # [U, out, in]


def route(logits: ov.Output, k: int, normalize: bool, scale: float,
          gating: str = "softmax") -> tuple[ov.Output, ov.Output]:
    """Router logits [T, E] → (weights f32 [T, k], expert ids i64 [T, k]): softmax, then top-k;
    gating "softmax_weight" (gpt-oss): top-k of the logits, then softmax over those k."""
    probs = ops.softmax(logits, -1) if gating == "softmax" else logits
    top = ops.topk(probs, ops.constant(np.int64(k)), axis=-1, mode="max", sort="value", index_element_type=I64)
    weights, ids = top.output(0), top.output(1)
    if gating == "softmax_weight":
        weights = ops.softmax(weights, -1).output(0)
    if normalize:
        total = ops.reduce_sum(weights, _i64(-1), keep_dims=True)  # [T, 1]
        weights = ops.divide(weights, ops.maximum(total, ops.constant(np.float32(WEIGHTS_SUM_MIN))))
    if scale not in (0.0, 1.0):
        weights = ops.multiply(weights, ops.constant(np.float32(scale)))
    return weights if isinstance(weights, ov.Output) else weights.output(0), ids


def moe_ffn(bank, x: ov.Output, prefix: str, fam: Family, router_x: ov.Output | None = None) -> ov.Output:
    """x [B, L, H] → the experts' weighted sum [B, L, H] (module docstring); `router_x` [B, L, H]:
    the router's input where it is not x (gemma4)."""
    shape = ops.shape_of(x, I64)  # [3]
    hidden = bank.index.hparams.hidden
    xt = ops.reshape(x, _i64(-1, hidden), False).output(0)  # [T, H]
    rt = xt if router_x is None else ops.reshape(router_x, _i64(-1, hidden), False).output(0)
    (logits,) = bank.project(rt, [(prefix + "ffn_gate_inp.weight", 0)])  # [T, E] (+ gpt-oss's bias)
    weights, ids = route(logits, fam.n_experts_used, fam.experts_renorm, fam.experts_scale,
                         fam.experts_gating)  # [T, k] ×2  # fmt: skip
    if _ggml_experts(bank, prefix):
        return ops.reshape(_ggml_moe(bank, xt, weights, ids, prefix, fam), shape, False).output(0)
    n_experts = bank.index.tensors[prefix + "ffn_gate_inp.weight"].shape[0]
    picked = ops.reshape(ids, _i64(-1), False)  # [T·k]
    if READ_ALL_EXPERTS:  # every id once more: U = E (through Unique, so that nothing folds into constants)
        picked = ops.concat([picked, _i64(*range(n_experts))], 0)
    used = ops.unique(picked, sorted=True, index_element_type=I64).output(0)  # [U]
    zeros = ops.broadcast(ops.constant(np.float32(0.0)),
                          ops.concat([ops.gather(ops.shape_of(xt, I64), _i64(0), _i64(0)), _i64(n_experts)], 0))
    dense_w = ops.scatter_elements_update(zeros, ids, weights, ops.constant(np.int64(1)))  # [T, E]
    w_used = ops.transpose(ops.gather(dense_w, used, _i64(1)), _i64(1, 0))  # [U, T]
    gate, up, (gate_s, up_s) = _gate_and_up(bank, prefix)
    down = Experts(bank, prefix + "ffn_down_exps.weight").take(used)  # [U, H, F]
    xu = ops.unsqueeze(xt, _i64(0))  # [1, T, H]
    g = _times_rows(bank, ops.matmul(xu, gate.take(used), False, True), gate_s, used)  # [U, T, F]
    u = _times_rows(bank, ops.matmul(xu, up.take(used), False, True), up_s, used)  # [U, T, F]
    if fam.expert_biases:
        g = _plus_rows(bank, g, prefix + "ffn_gate_exps.bias", used)
        u = _plus_rows(bank, u, prefix + "ffn_up_exps.bias", used)
    act = _glu(g, u, fam)
    d = _times_rows(bank, ops.matmul(act, down, False, True), prefix + "ffn_down_exps.scale", used)  # [U, T, H]
    if fam.expert_biases:
        d = _plus_rows(bank, d, prefix + "ffn_down_exps.bias", used)
    out = ops.reduce_sum(ops.multiply(d, ops.unsqueeze(w_used, _i64(2))), _i64(0), keep_dims=False)  # [T, H]
    return ops.reshape(out, shape, False).output(0)  # [B, L, H]


EXPERT_TENSORS = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")


def _glu(gate: ov.Output, up: ov.Output, fam: Family, ggml: bool = False) -> ov.Output:
    """The experts' activation of the family: SwiGLU, gpt-oss's swiglu_oai, Gemma's GeGLU (`ggml`:
    ggml's own, attention.geglu)."""
    if fam.ffn_act == "swiglu_oai":
        return swiglu_oai(gate, up)
    if fam.ffn_act == "gelu_tanh":
        return geglu(gate, up, ggml)
    return ops.multiply(ops.swish(gate), up).output(0)


def _gate_and_up(bank, prefix: str) -> tuple[Experts, Experts, tuple[str, str]]:
    """The gate and up experts and their .scale names; a fused ffn_gate_up_exps [E, 2F, H] holds
    gate's F rows then up's, both scaled by ffn_up_exps.scale (llama.cpp's build_moe_ffn)."""
    fused = prefix + FUSED_GATE_UP_EXPS
    if fused in bank.index.tensors:
        F = bank.index.tensors[fused].shape[1] // 2
        return Experts(bank, fused, (0, F)), Experts(bank, fused, (F, 2 * F)), (prefix + "ffn_up_exps.scale",) * 2
    return (Experts(bank, prefix + "ffn_gate_exps.weight"), Experts(bank, prefix + "ffn_up_exps.weight"),
            (prefix + "ffn_gate_exps.scale", prefix + "ffn_up_exps.scale"))  # fmt: skip


def _scaled(bank, name: str) -> bool:
    """Whether llama.cpp multiplies by the per-expert factor `name` (present, and applied by the
    architecture's graph: backends/gguf/optional.py)."""
    return applied_scale(bank.index.hparams.arch, name.removesuffix(".scale"), bank.index.tensors) is not None


def _times_rows(bank, y: ov.Output, name: str, used: ov.Output) -> ov.Output:
    """y [U, T, n] × the file's per-expert factor `name` {E} of experts `used` (none: y)."""
    if not _scaled(bank, name):
        return y if isinstance(y, ov.Output) else y.output(0)
    s = ops.gather(bank.vector(name), used, _i64(0))  # [U]
    return ops.multiply(y, ops.reshape(s, _i64(-1, 1, 1), False)).output(0)


def _times_picked(bank, y: ov.Output, name: str, ids: ov.Output) -> ov.Output:
    """y [T, k, n] × the per-expert factor `name` {E} of each row's picked experts (none: y)."""
    if not _scaled(bank, name):
        return y
    return ops.multiply(y, ops.unsqueeze(ops.gather(bank.vector(name), ids, _i64(0)), _i64(2))).output(0)


def _ggml_experts(bank, prefix: str) -> bool:
    """Whether this block's experts run on ggml's kernels (--kquant ggml and block types; a fused
    gate_up only through the GgmlMoe node, where no scale applies to it)."""
    from backends.openvino.ggml_kernels import GGML_QTYPES

    tensors = bank.index.tensors
    names = _expert_names(bank, prefix)
    if names[0] == names[1] and (_scaled(bank, prefix + "ffn_up_exps.scale")
                                 or any(n.removesuffix(".weight") + ".bias" in tensors for n in names)):  # fmt: skip
        return False
    return bank.kquant == "ggml" and all(n in tensors and tensors[n].qtype in GGML_QTYPES for n in names)


def _expert_names(bank, prefix: str) -> list[str]:
    """The gate, up and down expert tensors' names (a fused gate_up twice)."""
    fused = prefix + FUSED_GATE_UP_EXPS
    if fused in bank.index.tensors:
        return [fused, fused, prefix + "ffn_down_exps.weight"]
    return [prefix + n for n in EXPERT_TENSORS]


def _ggml_moe(bank, xt: ov.Output, weights: ov.Output, ids: ov.Output, prefix: str, fam: Family) -> ov.Output:
    """The experts' weighted sum [T, H] by ggml's mul_mat_id arithmetic (GgmlMatMulId): each row
    through its own k experts only, read from the file's blocks."""
    from backends.openvino import ggml_kernels

    def experts(x: ov.Output, name: str) -> ov.Output:  # x [T, 1 | k, in] → [T, k, out]
        t = bank.index.tensors[prefix + name]
        E, out, cols = t.shape
        raw = np.memmap(bank.index.path, np.uint8, "c", t.offset, (t.n_bytes,))
        return ggml_kernels.matmul_id(x, ids, raw, t.qtype, E, out, cols, bank.keep)

    if (fused := _ggml_moe_node(bank, xt, weights, ids, prefix, fam)) is not None:
        return fused
    xk = ops.unsqueeze(xt, _i64(1)).output(0)  # [T, 1, H]
    g = _times_picked(bank, experts(xk, "ffn_gate_exps.weight"), prefix + "ffn_gate_exps.scale", ids)  # [T, k, F]
    u = _times_picked(bank, experts(xk, "ffn_up_exps.weight"), prefix + "ffn_up_exps.scale", ids)
    if fam.expert_biases:
        g = _plus_picked(bank, g, prefix + "ffn_gate_exps.bias", ids)
        u = _plus_picked(bank, u, prefix + "ffn_up_exps.bias", ids)
    d = experts(_glu(g, u, fam, ggml=True), "ffn_down_exps.weight")  # [T, k, H]
    d = _times_picked(bank, d, prefix + "ffn_down_exps.scale", ids)
    if fam.expert_biases:
        d = _plus_picked(bank, d, prefix + "ffn_down_exps.bias", ids)
    return ops.reduce_sum(ops.multiply(d, ops.unsqueeze(weights, _i64(2))), _i64(1), keep_dims=False).output(0)


def _ggml_moe_node(bank, xt: ov.Output, weights: ov.Output, ids: ov.Output, prefix: str, fam: Family) -> ov.Output | None:
    """The experts' weighted sum [T, H] as one GgmlMoe node (llama.cpp's build_moe_ffn after the
    router: its GLU, the down matrix's per-expert scale and its slot-order sum included), where
    gate and up carry no scale and the biases are all three or none; else None."""
    from backends.openvino import ggml_kernels

    names = _expert_names(bank, prefix)
    fused = names[0] == names[1]
    biases = [n.removesuffix(".weight") + ".bias" for n in names]
    have = [b in bank.index.tensors for b in biases]
    if any(have) != all(have) or any(_scaled(bank, prefix + n.removesuffix(".weight") + ".scale")
                                     for n in EXPERT_TENSORS[:2]):  # fmt: skip
        return None
    tensors = [bank.index.tensors[n] for n in names]
    raw = lambda t: np.memmap(bank.index.path, np.uint8, "c", t.offset, (t.n_bytes,))  # noqa: E731
    gate = raw(tensors[0])
    raws = [gate, gate if fused else raw(tensors[1]), raw(tensors[2])]
    E, F, H = tensors[0].shape[0], tensors[0].shape[1] // (2 if fused else 1), tensors[2].shape[1]
    bias_outs = [bank._const(bank.index.dequantize(b, np.float32)).output(0) for b in biases] if all(have) else None
    down_scale = prefix + "ffn_down_exps.scale"
    scales = ops.gather(bank.vector(down_scale), ids, _i64(0)).output(0) if _scaled(bank, down_scale) else None  # [T, k]
    return ggml_kernels.moe(xt, ids, weights, raws, [t.qtype for t in tensors], E, F, H, bank.keep,
                            oai=fam.ffn_act == "swiglu_oai", biases=bias_outs, gelu=fam.ffn_act == "gelu_tanh",
                            down_scales=scales, fused=fused)  # fmt: skip


def _plus_picked(bank, y: ov.Output, name: str, ids: ov.Output) -> ov.Output:
    """y [T, k, n] + the bias rows [E, n] of each row's picked experts ids [T, k]."""
    rows = ops.gather(bank._const(bank.index.dequantize(name, np.float32)), ids, _i64(0))  # [T, k, n]
    return ops.add(y, rows).output(0)


def _plus_rows(bank, y: ov.Output, name: str, used: ov.Output) -> ov.Output:
    """y [U, T, n] + the bias rows [E, n] of experts `used` [U] (only those rows are read)."""
    rows = ops.gather(bank._const(bank.index.dequantize(name, np.float32)), used, _i64(0))  # [U, n]
    return ops.add(y, ops.unsqueeze(rows, _i64(1))).output(0)  # [U, T, n]


def shared_expert(bank, x: ov.Output, prefix: str) -> ov.Output:
    """qwen2moe's shared expert: sigmoid(ffn_gate_inp_shexp · x) · down(silu(gate · x) ⊙ up · x)."""
    down = bank.swiglu(x, prefix, "_shexp")
    gate_w = bank.vector(prefix + "ffn_gate_inp_shexp.weight")  # [H]
    g = ops.sigmoid(ops.reduce_sum(ops.multiply(x, gate_w), _i64(-1), keep_dims=True))  # [B, L, 1]
    return ops.multiply(down, g).output(0)
