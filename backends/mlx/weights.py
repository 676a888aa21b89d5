"""A shard's weights for MLX, built from the GGUF's bytes through backends.gguf.quant.

Quantized matrices become MLX affine quantized arrays (w = scale·q + bias per group of 32: a
uint32 `weight` of packed codes, `scales`, `biases`), exactly:

  type   codes            bits  scale      bias        note
  Q4_0   q                4     d (f16)    −8d         as mx.load gives them
  Q4_1   q                4     d (f16)    m
  Q5_0   q (0..31)        5     d (f16)    −16d
  Q5_1   q (0..31)        5     d (f16)    m
  Q8_0   q + 128          8     d (f16)    −128d
  Q4_K   q                4     d·sc (f32) −dmin·m     f32: d·sc and dmin·m are not f16 values
  Q5_K   q (0..31)        5     d·sc (f32) −dmin·m
  Q6_K   q (0..63)        6     d·sc (f32) −32·d·sc    groups of 16: see below
  Q2_K   q (0..3)         2     d·sc (f32) −dmin·m     groups of 16, likewise
  Q3_K   q + 4 (0..7)     3     d·sc (f32) −4·d·sc     groups of 16, likewise
  IQ4_NL K[q] + 128       8     d (f16)    −128d       K: the IQ4 grid's values (−127..113)
  IQ4_XS K[q] + 128       8     d·sc (f32) −128·d·sc
  MXFP4  v + 12 (0..24)   5     2^(e−128)  −12·2^(e−128)  v: doubled E2M1 values (−12..12)

Q6_K (and Q2_K, Q3_K) has one scale per 16 weights and MLX's smallest group is 32, so each group of 16 is padded
with 16 zero columns (and the input with 16 zeros): 12 bits of codes + 4 bits of f32 scale/bias
per weight = 2 bytes per weight in memory (dense f32 would be 4; the file holds 0.82; f16 is not
exact). F32, F16 and BF16 matrices are dense f32 (F16/BF16: 4 bytes per weight against 2 in the
file).

`mx.load` is not used (mlx 0.32.4): it refuses any file holding a Q5_K tensor ("[load_gguf]
gguf_tensor_to_f16 failed"), returns Q6_K and BF16 rounded to dense f16, and Q4_K as dense f16
that is wrong (max error 0.38 on weights of ≈ 0.2 in tests/synthetic_gguf.py's files). Only the
shard's tensors are read (memory-mapped through the model index), not the whole file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from backends.gguf import ModelIndex, open_model
from backends.gguf.families import FUSED_GATE_UP_EXPS
from backends.gguf.optional import applied_scale, bias_before_scale
from backends.gguf.quant import FLOAT_TYPES, QuantBlocks, split_blocks

GROUP_SIZE = 32  # MLX's group of every quantized matrix (Q6_K's 16 are padded to it)
PAD_GROUP = 16  # Q6_K's, Q2_K's and Q3_K's group
PADDED_CODES = {"Q6_K": (32, 6), "Q2_K": (0, 2), "Q3_K": (4, 3)}  # (shift to unsigned codes, bits)
LOOKUP_CODES = {"IQ4_NL": (128, 8), "IQ4_XS": (128, 8), "MXFP4": (12, 5)}  # table values −127..113, −12..12


@dataclass(frozen=True)
class Linear:
    """y = x·Wᵀ (+ bias): W either quantized (weight uint32 + scales + biases) or dense."""

    weight: mx.array  # uint32 [out, in'·bits/32] when quantized, float [out, in] when dense
    scales: mx.array | None  # [out, in'/32]
    biases: mx.array | None  # [out, in'/32]
    bias: mx.array | None = None  # [out], the file's .bias (q/k/v, o, FFN, lm_head)
    bits: int = 0  # bits per code; 0 when dense
    padded: bool = False  # Q6_K: in' = 2·in, each 16 inputs followed by 16 zero columns
    out_scale: mx.array | None = None  # [1]: the file's .scale where the architecture applies it
    bias_first: bool = False  # a feed-forward's: (W·x + b)·s (llama.cpp's build_ffn), else (W·x)·s + b

    def __call__(self, x: mx.array) -> mx.array:
        if self.scales is None:
            y = x @ self.weight.T
        else:
            y = mx.quantized_matmul(
                pad16(x) if self.padded else x, self.weight, self.scales, self.biases,
                transpose=True, group_size=GROUP_SIZE, bits=self.bits,
            )  # fmt: skip
        if self.out_scale is not None and not self.bias_first:
            y = y * self.out_scale
        if self.bias is not None:
            y = y + self.bias
        return y * self.out_scale if self.out_scale is not None and self.bias_first else y

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` of W, dequantized: the embedding lookup. ids [n] → [n, in]."""
        if self.scales is None:
            return self.weight[ids]
        w = mx.dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids],
            group_size=GROUP_SIZE, bits=self.bits,
        )  # fmt: skip
        if self.padded:  # [n, 2·in] → [n, in]
            w = w.reshape(w.shape[0], -1, GROUP_SIZE)[..., :PAD_GROUP].reshape(w.shape[0], -1)
        return w


def pad16(x: mx.array) -> mx.array:
    """[..., in] → [..., 2·in]: 16 zeros after every 16 inputs (the padded groups' inputs)."""
    groups = x.reshape(*x.shape[:-1], -1, PAD_GROUP)  # [..., in/16, 16]
    groups = mx.concatenate([groups, mx.zeros_like(groups)], axis=-1)  # [..., in/16, 32]
    return groups.reshape(*x.shape[:-1], -1)


def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [rows, n] → uint32 [rows, n·bits/32] as MLX packs them: code i in bits
    [i·bits, (i+1)·bits) of the row's little-endian bit stream."""
    rows = q.shape[0]
    stream = np.unpackbits(q[..., None], axis=-1, count=bits, bitorder="little")  # [rows, n, bits]
    packed = np.packbits(stream.reshape(rows, -1), axis=-1, bitorder="little")  # [rows, n·bits/8]
    return np.ascontiguousarray(packed).view(np.uint32)


def affine(b: QuantBlocks, f32: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, bool]:
    """(codes uint8 [rows, in'], scales, biases [rows, in'/32], bits, padded) with
    w = scale·code + bias exactly (see the module docstring)."""
    s = b.scale
    if f32:  # before the products below: −16d of a large f16 d is not an f16 value
        s = s.astype(np.float32)
    if b.group == PAD_GROUP:  # Q6_K, Q2_K, Q3_K: groups of 16 padded to 32
        rows, groups, _ = b.q.shape
        shift, bits = PADDED_CODES[b.qtype]  # code = q + shift, unsigned
        codes = np.zeros((rows, groups, GROUP_SIZE), np.uint8)
        codes[..., :PAD_GROUP] = (b.q.astype(np.int16) + shift).astype(np.uint8)
        s32 = s.astype(np.float32)
        bias = b.offset.astype(np.float32) if b.offset is not None else -shift * s32
        return codes.reshape(rows, -1), s32, bias, bits, True
    if b.qtype in LOOKUP_CODES:  # the table's values v as unsigned codes v + shift
        shift, bits = LOOKUP_CODES[b.qtype]
        codes, bias = (b.q.astype(np.int16) + shift).astype(np.uint8), -shift * s
    elif b.qtype == "Q8_0":
        codes, bias = (b.q.astype(np.int16) + 128).astype(np.uint8), -128 * s
    elif b.qtype in ("Q4_0", "Q5_0"):
        codes, bias = b.q, -(8 if b.qtype == "Q4_0" else 16) * s
    else:  # Q4_1, Q5_1, Q4_K, Q5_K: w = scale·q + offset
        codes, bias = b.q, b.offset
    if f32 or s.dtype == np.float32:
        s, bias = s.astype(np.float32), bias.astype(np.float32)
    return codes.reshape(codes.shape[0], -1), s, bias, b.bits, False


@dataclass(frozen=True)
class Experts:
    """A block's E expert matrices of one kind (GGUF's 3-D `ffn_*_exps`), as Linear holds one:
    quantized per expert (weight uint32 [E, out, in'·bits/32], scales and biases [E, out, in'/32])
    or dense [E, out, in]. `__call__` multiplies each token by its k chosen experts only
    (mx.gather_qmm / gather_mm: the other experts' weights are not read)."""

    weight: mx.array
    scales: mx.array | None
    biases: mx.array | None
    bits: int = 0
    padded: bool = False
    bias: mx.array | None = None  # [E, out]: gpt-oss's per-expert bias rows
    out_scale: mx.array | None = None  # [E]: the file's per-expert .scale where the architecture applies it

    def __call__(self, x: mx.array, ids: mx.array) -> mx.array:
        """x [T, 1, 1, in] (or [T, k, 1, in]), ids [T, k] → [T, k, 1, out]."""
        if self.scales is None:
            y = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=ids)
        else:
            y = mx.gather_qmm(pad16(x) if self.padded else x, self.weight, self.scales, self.biases, rhs_indices=ids,
                              transpose=True, group_size=GROUP_SIZE, bits=self.bits)  # fmt: skip
        if self.out_scale is not None:
            y = y * self.out_scale[ids][:, :, None, None]
        return y if self.bias is None else y + self.bias[ids][:, :, None, :]


@dataclass(frozen=True)
class MoEWeights:
    """A mixture-of-experts FFN (qwen3moe, qwen2moe, Mixtral-layout llama; families.py): the
    router [E, hidden] and the experts, and qwen2moe's shared expert with its gate [1, hidden]."""

    router: Linear
    gate: Experts  # hidden → F, per expert
    up: Experts
    down: Experts  # F → hidden
    shared: tuple[Linear, Linear, Linear] | None = None  # gate, up, down of the shared expert
    shared_gate: Linear | None = None


GEMMA4_PARTS = ("layer_output_scale.weight", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
                "post_ffw_norm_2.weight", "ffn_gate_inp.scale")  # Gemma4Parts' fields, in order


@dataclass(frozen=True)
class Gemma4Parts:
    """What a gemma4 block has besides Gemma's norms (backends/gguf/gemma4.py)."""

    layer_scale: mx.array | None  # [1]: the block's output × this
    pre_ffw_norm_2: mx.array | None = None  # MoE blocks: the experts' input norm
    post_ffw_norm_1: mx.array | None = None  # the dense FFN's output norm
    post_ffw_norm_2: mx.array | None = None  # the experts' output norm
    router_scale: mx.array | None = None  # [hidden]: the router's input × this (ffn_gate_inp.scale)
    inp_gate: Linear | None = None  # per-layer embeddings: hidden → P, its gate
    proj: Linear | None = None  # P → hidden
    post_norm: mx.array | None = None  # [hidden]


@dataclass(frozen=True)
class BlockWeights:
    attn_norm: mx.array  # [hidden]
    q: Linear  # hidden → n_heads·head_dim, rows in GGUF (interleaved-RoPE) order
    k: Linear | None  # hidden → n_kv_heads·head_dim, likewise (gemma4: none where the KV is shared)
    v: Linear | None  # hidden → n_kv_heads·head_dim (gemma4 may have none: the keys' projection)
    o: Linear  # n_heads·head_dim → hidden
    ffn_norm: mx.array  # [hidden]
    gate: Linear | None  # hidden → ffn (None: the block's FFN is `moe`)
    up: Linear | None  # hidden → ffn
    down: Linear | None  # ffn → hidden
    q_norm: mx.array | None = None  # [head_dim], Qwen3: RMSNorm of each q head before RoPE
    k_norm: mx.array | None = None  # [head_dim], likewise for k
    moe: MoEWeights | None = None
    post_attn_norm: mx.array | None = None  # [hidden], Gemma: the attention's output normalized
    post_ffw_norm: mx.array | None = None  # [hidden], Gemma: the FFN's output normalized
    sinks: mx.array | None = None  # [n_heads], gpt-oss: a learnt logit per head in every softmax
    gemma4: Gemma4Parts | None = None


@dataclass(frozen=True)
class HybridWeights:
    """One hybrid block: its norms and FFN (dense or MoE), and either the delta-net's or the
    gated attention's matrices."""

    attn_norm: mx.array
    ffn_norm: mx.array  # post_attention_norm: the FFN's input norm
    gate: Linear | None
    up: Linear | None
    down: Linear | None
    moe: MoEWeights | None
    # gated attention
    q: Linear | None = None  # per head D query rows then D gate rows
    k: Linear | None = None
    v: Linear | None = None
    o: Linear | None = None
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None
    # delta net
    qkv: Linear | None = None  # q | k | v channels (qwen3next: or ssm_in, per key head)
    z: Linear | None = None  # attn_gate
    beta: Linear | None = None
    alpha: Linear | None = None
    ba: Linear | None = None  # qwen3next's fused β, α (per key head)
    ssm_in: Linear | None = None  # qwen3next's legacy fused q, k, v, z
    conv: mx.array | None = None  # [C, K]
    dt_bias: mx.array | None = None  # [Hv]
    a: mx.array | None = None  # [Hv]
    ssm_norm: mx.array | None = None  # [S]
    out: Linear | None = None


@dataclass(frozen=True)
class MtpWeights:
    """What a multi-token-prediction block adds to its attention block (backends/gguf/hybrid.py)."""

    eh_proj: Linear  # 2·hidden → hidden
    enorm: mx.array  # [hidden]
    hnorm: mx.array  # [hidden]
    head_norm: mx.array  # nextn.shared_head_norm, else output_norm
    head: Linear  # nextn.shared_head_head, else the model's lm_head


@dataclass(frozen=True)
class ShardWeights:
    blocks: tuple[BlockWeights | HybridWeights, ...]  # blocks first .. last-1, in order
    embedding: Linear | None  # token_embd when it is also the lm_head (tied): rows are looked up
    output_norm: mx.array | None  # [hidden] (head shard)
    lm_head: Linear | None  # output.weight, or token_embd when tied (head shard)
    mtp: MtpWeights | None = None  # the multi-token-prediction block's own part (backends/mlx/mtp.py)
    # gemma4's per-layer embeddings at the first stage: per_layer_model_proj, per_layer_proj_norm
    per_layer: tuple[Linear, mx.array] | None = None



def load_shard_weights(
    path: str, first: int, last: int, embed: bool, head: bool, f32: bool,
    index: ModelIndex | None = None, mtp: bool = False,
) -> ShardWeights:
    """The tensors of blocks [first, last), plus embedding / final norm / lm_head when asked;
    `mtp`: [first, last) is the multi-token-prediction block, with its own part (MtpWeights).

    f32: the f16 scales and biases (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) converted to float32 (exact), so everything
    computes in f32; K-quant scales are f32 either way.
    """
    index = index if index is not None else open_model(path)
    tensors = index.tensors
    made: dict[str, Linear] = {}

    def vec(name: str) -> mx.array:
        return mx.array(index.dequantize(name, np.float32))

    def out_scale(name: str) -> mx.array | None:  # the .scale llama.cpp's graph applies (optional.py)
        scale = applied_scale(index.hparams.arch, name, tensors)
        return vec(scale) if scale else None

    def linear(name: str) -> Linear:
        if name in made:  # a tied embedding and lm_head share one array
            return made[name]
        bias = vec(f"{name}.bias") if f"{name}.bias" in tensors else None
        w = f"{name}.weight"
        extra = dict(out_scale=out_scale(w), bias_first=bias_before_scale(name))
        if tensors[w].qtype in FLOAT_TYPES:  # dense
            made[name] = Linear(vec(w), None, None, bias, **extra)
        else:
            codes, scales, biases, bits, padded = affine(index.blocks_of(w), f32)
            made[name] = Linear(mx.array(pack_codes(codes, bits)), mx.array(scales), mx.array(biases),
                                bias, bits, padded, **extra)
        return made[name]

    def experts(name: str, rows: tuple[int, int] | None = None, scale: str | None = None) -> Experts:
        """A 3-D expert tensor (`rows`: a fused one's part, rows a..z of each expert; `scale`:
        another tensor's .scale, as a fused gate_up takes up's)."""
        t = tensors[name]
        E, out, cols = t.shape
        a, z = rows or (0, out)
        bias_name = name.removesuffix(".weight") + ".bias"
        bias = vec(bias_name).reshape(E, out)[:, a:z] if bias_name in tensors else None
        s = out_scale(scale or name)
        if t.qtype in FLOAT_TYPES:
            w = index.dequantize(name, np.float32).reshape(E, out, cols)[:, a:z]
            return Experts(mx.array(np.ascontiguousarray(w)), None, None, bias=bias, out_scale=s)
        b = split_blocks(t.qtype, index.raw(name), E * out, cols)
        codes, scales, biases, bits, padded = affine(b, f32)
        part = lambda v: mx.array(np.ascontiguousarray(v.reshape(E, out, -1)[:, a:z]))  # noqa: E731
        return Experts(part(pack_codes(codes, bits)), part(scales), part(biases), bits, padded, bias, s)

    def moe(b: int) -> MoEWeights | None:
        p = f"blk.{b}."
        fused = p + FUSED_GATE_UP_EXPS
        if fused in tensors:  # qwen35moe, qwen3next: gate's F rows, then up's, scaled by up's .scale
            F = tensors[fused].shape[1] // 2
            gate_up = (experts(fused, (0, F), f"{p}ffn_up_exps.weight"), experts(fused, (F, 2 * F), f"{p}ffn_up_exps.weight"))
        elif f"{p}ffn_gate_exps.weight" in tensors:
            gate_up = (experts(f"{p}ffn_gate_exps.weight"), experts(f"{p}ffn_up_exps.weight"))
        else:
            return None
        shared = None
        if f"{p}ffn_gate_shexp.weight" in tensors:
            shared = (linear(f"{p}ffn_gate_shexp"), linear(f"{p}ffn_up_shexp"), linear(f"{p}ffn_down_shexp"))
        return MoEWeights(linear(f"{p}ffn_gate_inp"), *gate_up, experts(f"{p}ffn_down_exps.weight"), shared,
                          linear(f"{p}ffn_gate_inp_shexp") if shared else None)  # fmt: skip

    post_norms = index.hparams.family.post_norms

    def optional(name: str) -> mx.array | None:
        return vec(name) if name in tensors else None

    def dense(b: int, kind: str) -> Linear | None:
        return linear(f"blk.{b}.ffn_{kind}") if f"blk.{b}.ffn_{kind}.weight" in tensors else None

    def hybrid(b: int) -> HybridWeights:
        p = f"blk.{b}."
        has = lambda n: p + n in tensors  # noqa: E731
        lin = lambda n: linear(p + n) if has(n + ".weight") else None  # noqa: E731
        common = dict(attn_norm=vec(p + "attn_norm.weight"), ffn_norm=vec(p + "post_attention_norm.weight"),
                      gate=dense(b, "gate"), up=dense(b, "up"), down=dense(b, "down"), moe=moe(b))  # fmt: skip
        if not index.hparams.hybrid.recurrent[b]:
            return HybridWeights(**common, q=lin("attn_q"), k=lin("attn_k"), v=lin("attn_v"), o=lin("attn_output"),
                                 q_norm=vec(p + "attn_q_norm.weight"), k_norm=vec(p + "attn_k_norm.weight"))  # fmt: skip
        return HybridWeights(**common, qkv=lin("attn_qkv"), z=lin("attn_gate"), beta=lin("ssm_beta"),
                             alpha=lin("ssm_alpha"), ba=lin("ssm_ba"), ssm_in=None if has("attn_qkv.weight") else lin("ssm_in"),
                             conv=vec(p + "ssm_conv1d.weight"), dt_bias=vec(p + "ssm_dt.bias"), a=vec(p + "ssm_a"),
                             ssm_norm=vec(p + "ssm_norm.weight"), out=lin("ssm_out"))  # fmt: skip

    def per_layer(b: int) -> dict:
        if f"blk.{b}.inp_gate.weight" not in tensors:
            return {}
        return dict(inp_gate=linear(f"blk.{b}.inp_gate"), proj=linear(f"blk.{b}.proj"), post_norm=vec(f"blk.{b}.post_norm.weight"))

    blocks = tuple(hybrid(b) for b in range(first, last)) if index.hparams.hybrid is not None else tuple(
        BlockWeights(
            attn_norm=vec(f"blk.{b}.attn_norm.weight"),
            q=linear(f"blk.{b}.attn_q"),
            k=linear(f"blk.{b}.attn_k") if f"blk.{b}.attn_k.weight" in tensors else None,
            v=linear(f"blk.{b}.attn_v") if f"blk.{b}.attn_v.weight" in tensors else None,
            o=linear(f"blk.{b}.attn_output"),
            ffn_norm=vec(f"blk.{b}.{index.hparams.family.ffn_norm}"),
            gate=dense(b, "gate"),
            up=dense(b, "up"),
            down=dense(b, "down"),
            q_norm=vec(f"blk.{b}.attn_q_norm.weight") if f"blk.{b}.attn_q_norm.weight" in tensors else None,
            k_norm=vec(f"blk.{b}.attn_k_norm.weight") if f"blk.{b}.attn_k_norm.weight" in tensors else None,
            moe=moe(b),
            # Gemma's output norms (gpt-oss's post_attention_norm is its FFN's input norm, ffn_norm)
            post_attn_norm=optional(f"blk.{b}.post_attention_norm.weight") if post_norms else None,
            post_ffw_norm=optional(f"blk.{b}.post_ffw_norm.weight") if post_norms else None,
            sinks=optional(f"blk.{b}.attn_sinks.weight"),
            gemma4=Gemma4Parts(*(optional(f"blk.{b}.{n}") for n in GEMMA4_PARTS), **per_layer(b))
            if index.hparams.gemma4 else None,
        )
        for b in range(first, last)
    )
    lm_head = None
    if head:
        lm_head = linear("output") if "output.weight" in tensors else linear("token_embd")  # shared when tied
    own = None
    if mtp:
        from backends.gguf.hybrid import mtp_tensor

        p = f"blk.{first}.nextn."
        named = mtp_tensor(index, "shared_head_head.weight", "")
        own = MtpWeights(eh_proj=linear(p + "eh_proj"), enorm=vec(p + "enorm.weight"), hnorm=vec(p + "hnorm.weight"),
                         head_norm=vec(mtp_tensor(index, "shared_head_norm.weight", "output_norm.weight")),
                         head=linear(named.removesuffix(".weight")) if named else lm_head)  # fmt: skip
    weights = ShardWeights(
        mtp=own,
        blocks=blocks,
        # a table that is not also this shard's lm_head is not held: MLXShard reads each step's
        # rows from the file (ModelIndex.rows, exact), as the OpenVINO shard does
        embedding=made.get("token_embd") if embed else None,
        output_norm=vec("output_norm.weight") if head else None,
        lm_head=lm_head,
        per_layer=(linear("per_layer_model_proj"), vec("per_layer_proj_norm.weight"))
        if embed and "per_layer_model_proj.weight" in tensors else None,
    )
    mx.eval(_arrays(weights))
    return weights


def _arrays(weights: ShardWeights) -> list[mx.array]:
    """Every array the weights hold (a tied table once per holder): whatever the dataclasses'
    fields, arrays, Linears, Experts, MoE weights and tuples of them."""
    out: list[mx.array] = []

    def add(value) -> None:
        if isinstance(value, mx.array):
            out.append(value)
        elif isinstance(value, (tuple, list)):
            for v in value:
                add(v)
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                add(getattr(value, f.name))

    add(weights)
    return out


def weight_bytes(weights: ShardWeights) -> int:
    """Bytes the shard's weights occupy in memory (tied lm_head counted once)."""
    seen: set[int] = set()
    total = 0
    for a in _arrays(weights):
        if id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total
