"""A shard's weights for MLX, straight from the GGUF with `mlx.core.load`.

`mx.load` returns Q4_0 / Q4_1 / Q8_0 tensors natively as MLX quantized arrays (group 32):
a uint32 `weight` of packed codes, `scales` and `biases` (f16), with w = scale·q + bias. That is
exact for every type Kafila serves: Q4_1 is d·q + m, Q4_0 is d·q − 8d, Q8_0 is d·q_u − 128d with
q_u = q + 128. F32/F16 tensors arrive as plain arrays.

`mx.load` reads the whole file (the GGUF reader is not lazy); only the shard's tensors are kept
and the rest is released before this module returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

GROUP_SIZE = 32  # every GGUF quant type Kafila serves has 32-weight blocks


@dataclass(frozen=True)
class Linear:
    """y = x·Wᵀ (+ bias): W either quantized (weight uint32 + scales + biases) or dense."""

    weight: mx.array  # uint32 [out, in·bits/32] when quantized, float [out, in] when dense
    scales: mx.array | None  # [out, in/32]
    biases: mx.array | None  # [out, in/32]
    bias: mx.array | None = None  # [out], Qwen2 q/k/v only

    @property
    def bits(self) -> int:
        # codes per row (in·bits/32 words) over groups per row (in/32)
        return self.weight.shape[1] // self.scales.shape[1] if self.scales is not None else 0

    def __call__(self, x: mx.array) -> mx.array:
        if self.scales is None:
            y = x @ self.weight.T
        else:
            y = mx.quantized_matmul(
                x, self.weight, self.scales, self.biases,
                transpose=True, group_size=GROUP_SIZE, bits=self.bits,
            )  # fmt: skip
        return y if self.bias is None else y + self.bias

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` of W, dequantized: the embedding lookup. ids [n] → [n, in]."""
        if self.scales is None:
            return self.weight[ids]
        return mx.dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids],
            group_size=GROUP_SIZE, bits=self.bits,
        )  # fmt: skip


@dataclass(frozen=True)
class BlockWeights:
    attn_norm: mx.array  # [hidden]
    q: Linear  # hidden → n_heads·head_dim, rows in GGUF (interleaved-RoPE) order
    k: Linear  # hidden → n_kv_heads·head_dim, likewise
    v: Linear  # hidden → n_kv_heads·head_dim
    o: Linear  # n_heads·head_dim → hidden
    ffn_norm: mx.array  # [hidden]
    gate: Linear  # hidden → ffn
    up: Linear  # hidden → ffn
    down: Linear  # ffn → hidden


@dataclass(frozen=True)
class ShardWeights:
    blocks: tuple[BlockWeights, ...]  # blocks first .. last-1, in order
    embedding: Linear | None  # token_embd (head shard); rows are looked up
    output_norm: mx.array | None  # [hidden] (head shard)
    lm_head: Linear | None  # output.weight, or token_embd when tied (head shard)


def load_shard_weights(
    path: str, first: int, last: int, embed: bool, head: bool, f32: bool
) -> ShardWeights:
    """The tensors of blocks [first, last), plus embedding / final norm / lm_head when asked.

    f32: scales and biases converted to float32 (exact), so everything computes in f32.
    """
    everything = mx.load(path)
    wanted = [f"blk.{b}." for b in range(first, last)]
    if embed or head:
        wanted += ["token_embd.", "output_norm.", "output."]
    tensors = {k: v for k, v in everything.items() if k.startswith(tuple(wanted))}
    del everything  # release the other shards' tensors now

    def vec(name: str) -> mx.array:
        return tensors[name].astype(mx.float32)

    def linear(name: str) -> Linear:
        w = tensors[f"{name}.weight"]
        bias = tensors.get(f"{name}.bias")
        bias = None if bias is None else bias.astype(mx.float32)
        if f"{name}.scales" not in tensors:  # F32 / F16: dense
            return Linear(w.astype(mx.float32), None, None, bias)
        scales, biases = tensors[f"{name}.scales"], tensors[f"{name}.biases"]
        if f32:
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        return Linear(w, scales, biases, bias)

    blocks = tuple(
        BlockWeights(
            attn_norm=vec(f"blk.{b}.attn_norm.weight"),
            q=linear(f"blk.{b}.attn_q"),
            k=linear(f"blk.{b}.attn_k"),
            v=linear(f"blk.{b}.attn_v"),
            o=linear(f"blk.{b}.attn_output"),
            ffn_norm=vec(f"blk.{b}.ffn_norm.weight"),
            gate=linear(f"blk.{b}.ffn_gate"),
            up=linear(f"blk.{b}.ffn_up"),
            down=linear(f"blk.{b}.ffn_down"),
        )
        for b in range(first, last)
    )
    lm_head = None
    if head:
        lm_head = linear("output") if "output.weight" in tensors else linear("token_embd")
    weights = ShardWeights(
        blocks=blocks,
        embedding=linear("token_embd") if embed else None,
        output_norm=vec("output_norm.weight") if head else None,
        lm_head=lm_head,
    )
    mx.eval(_arrays(weights))  # materialize the casts; the file's copy is dropped with `tensors`
    return weights


def _arrays(weights: ShardWeights) -> list[mx.array]:
    out: list[mx.array] = []

    def add_linear(lin: Linear | None) -> None:
        if lin is not None:
            out.extend(a for a in (lin.weight, lin.scales, lin.biases, lin.bias) if a is not None)

    for b in weights.blocks:
        out += [b.attn_norm, b.ffn_norm]
        for lin in (b.q, b.k, b.v, b.o, b.gate, b.up, b.down):
            add_linear(lin)
    add_linear(weights.embedding)
    add_linear(weights.lm_head)
    if weights.output_norm is not None:
        out.append(weights.output_norm)
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
