"""Gemma 4 (`gemma4`) as llama.cpp 0.3.36 reads and computes it (src/models/gemma4.cpp).

Its blocks differ from each other, unlike the other families' (per block b: `Gemma4Params`):
- windowed or full attention: `attention.sliding_window_pattern` (a bool per block, required);
  windowed blocks have `attention.key_length_swa` head sizes (value the same), rotate the first
  `rope.dimension_count_swa` dims (default: the full blocks') with `rope.freq_base_swa`
  (default 10000) at scale 1; full blocks have `attention.key_length` heads, rotate the first
  `rope.dimension_count` dims with `rope.freq_base`, the file's linear scaling and the frequency
  factors `rope_freqs.weight` (θ_i / factor_i: Gemma 4's proportional RoPE);
- `attention.head_count` and `attention.head_count_kv` may be a number per block;
- a full block may have no attn_v: its values are then its key projection (before k's norm);
- the experts' gate and up may be one fused ffn_gate_up_exps [E, 2F, H] (gate's F rows, then
  up's: what llama.cpp's converter writes from Gemma 4's gate_up_proj) or two tensors.

Every block, as llama.cpp computes it:
    y = RMSNorm(x; attn_norm)
    q = RMSNorm(y·attn_q per head; attn_q_norm) → NEOX RoPE
    k = RMSNorm(y·attn_k per head; attn_k_norm) → NEOX RoPE;  v = RMSNorm(y·attn_v per head) (no weight)
    attention with q·k scale 1 (Gemma 4 folds the scale into the norms) → attn_output
    a = x + RMSNorm(attention; post_attention_norm)
    dense block: f = GeGLU FFN(RMSNorm(a; ffn_norm))
    MoE block (ffn_gate_inp present): f = RMSNorm(GeGLU FFN(RMSNorm(a; ffn_norm)); post_ffw_norm_1)
        + RMSNorm(experts(RMSNorm(a; pre_ffw_norm_2)); post_ffw_norm_2), the router's logits
        ffn_gate_inp · (RMSNorm(a) / sqrt(hidden) ⊙ ffn_gate_inp.scale) (no weight), softmax over
        all E, the top k renormalised; each expert a GeGLU FFN, its down output × the optional
        ffn_down_exps.scale of that expert (families.ffn_tensors' .scale rules)
    x' = (a + RMSNorm(f; post_ffw_norm)) × layer_output_scale (optional, one number)
Around the blocks: the embedding's rows × sqrt(hidden); final RMSNorm, lm_head (tied unless
output.weight), logits soft-capped by `final_logit_softcapping` when set.

Per-layer embeddings (`embedding_length_per_layer_input` P > 0: the E2B/E4B models), as llama.cpp
computes them: each position's per-layer inputs, for every block l a P-vector,
    pl = (RMSNorm((per_layer_model_proj · x0) / sqrt(hidden) per block; per_layer_proj_norm)
          + per_layer_token_embd[token] × sqrt(P)) / sqrt(2)      (x0: the scaled embedding)
and after block l's residual (before its output scale)
    x = x + RMSNorm(proj · (GELU(tanh)(inp_gate · x) ⊙ pl_l); post_norm).
Layers that share KV (`attention.shared_kv_layers` n > 0): the last n blocks compute no keys or
values of their own; each attends over the KV of block L − n − 2 (a windowed one) or L − n − 1 (a
full one), whichever has its kind (llama.cpp's reuse callback).

On the ring both are carried with the hidden state (`Gemma4Params.carried`): a row is
[hidden | every block's per-layer input | each shared source's new K and V]. The first stage
computes the per-layer inputs (it reads per_layer_token_embd's rows from the file, as the
embedding's); a shared source's stage writes its step's K and V there, and a later stage whose
sharing blocks lack their source keeps a KV cache of its own for it from those columns.

Not served (refused in one line): a fused attn_qkv.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from backends.errors import BadInput
from backends.gguf.families import DENSE_FFN_TENSORS, FUSED_GATE_UP_EXPS, Family
from backends.gguf.optional import optional_block_tensors

GEMMA4 = "gemma4"
GEMMA4_SWA_ROPE_BASE = 10000.0  # llama_hparams.rope_freq_base_train_swa's default
ATTENTION = ("attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_k_norm.weight",
             "attn_output.weight", "post_attention_norm.weight")  # fmt: skip
DENSE = ("ffn_norm.weight", *DENSE_FFN_TENSORS, "post_ffw_norm.weight")
MOE = ("ffn_gate_inp.weight", "ffn_gate_inp.scale", "pre_ffw_norm_2.weight", "post_ffw_norm_1.weight",
       "post_ffw_norm_2.weight", "ffn_down_exps.weight")  # fmt: skip; and gate and up, fused or not
SPLIT_GATE_UP = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
OPTIONAL = ("attn_v.weight", "layer_output_scale.weight")
OWN_KV = ("attn_k.weight", "attn_k_norm.weight")  # what a block that shares an earlier one's KV lacks
HEAD = ("token_embd.weight", "output_norm.weight")
PLE_HEAD = ("per_layer_token_embd.weight", "per_layer_model_proj.weight", "per_layer_proj_norm.weight")
PLE_BLOCK = ("inp_gate.weight", "proj.weight", "post_norm.weight")
OUTSIDE_BLOCKS = (*HEAD, "output.weight", "rope_freqs.weight", *PLE_HEAD)


@dataclass(frozen=True)
class Gemma4Block:
    windowed: bool
    n_heads: int
    n_kv_heads: int
    head_dim: int  # keys and values alike
    rope_dims: int  # the first rope_dims of each head rotate (NEOX halves)
    own_values: bool  # attn_v present (else the values are the key projection)
    moe: bool  # experts beside the dense FFN
    kv_from: int  # the block whose KV it attends over: itself, or a shared source

@dataclass(frozen=True)
class Gemma4Params:
    blocks: tuple[Gemma4Block, ...]
    per_layer: int = 0  # P: each block's per-layer input (0: none)

    def kv_values_per_token(self, b: int) -> int:
        """K and V values one position holds for block b: its own; for the first block sharing a
        source's, one copy of it (a stage holding the sharer apart from its source keeps one: the
        plan prices it once); 0 for the other sharers."""
        g = self.blocks[b]
        first_sharer = g.kv_from != b and all(o.kv_from != g.kv_from for o in self.blocks[g.kv_from + 1 : b])
        return 2 * self.kv_width(b) if g.kv_from == b or first_sharer else 0

    @property
    def shared_sources(self) -> tuple[int, ...]:
        """The blocks whose KV later blocks read, in order."""
        return tuple(sorted({g.kv_from for b, g in enumerate(self.blocks) if g.kv_from != b}))

    def carried(self, hidden: int) -> int:
        """The width of a row on the ring (module docstring): hidden, the per-layer inputs, the
        shared sources' K and V."""
        return self.kv_columns(hidden, None)

    def ple_columns(self, hidden: int, b: int) -> tuple[int, int]:
        """[start, end) of block b's per-layer input in a carried row."""
        return hidden + b * self.per_layer, hidden + (b + 1) * self.per_layer

    def kv_width(self, s: int) -> int:
        """K (or V) values of one position of block s: its KV heads × head size."""
        return self.blocks[s].n_kv_heads * self.blocks[s].head_dim

    def kv_columns(self, hidden: int, source: int | None) -> int:
        """Where shared source `source`'s K columns start in a carried row (its V follow them);
        with None, the row's width."""
        at = hidden + len(self.blocks) * self.per_layer
        for s in self.shared_sources:
            if s == source:
                return at
            at += 2 * self.kv_width(s)
        if source is not None:
            raise ValueError(f"block {source} is not a shared KV source")
        return at


def _per_block(path: str, hp, key: str, n_blocks: int, default) -> list[int]:
    value = hp(key, default)
    if isinstance(value, list):
        if len(value) != n_blocks:
            raise BadInput(f"GGUF {path}: {GEMMA4}.{key} has {len(value)} entries for {n_blocks} blocks")
        return [int(v) for v in value]
    return [int(value)] * n_blocks


def gemma4_params(path: str, hp, tensors: dict, n_blocks: int, hidden: int) -> tuple[Gemma4Params, Family]:
    """The per-block geometry and the family's parts of a gemma4 file (module docstring); BadInput
    for what llama.cpp would compute but Kafila does not, or a file llama.cpp would refuse."""
    per_layer = int(hp("embedding_length_per_layer_input"))
    shared = int(hp("attention.shared_kv_layers", 0))
    if not 0 <= shared <= n_blocks - 2 or per_layer < 0:
        raise BadInput(f"GGUF {path}: {GEMMA4}.attention.shared_kv_layers {shared} or embedding_length_per_layer_input "
                       f"{per_layer} is out of range for {n_blocks} blocks")
    pattern = hp("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_blocks:
        raise BadInput(f"GGUF {path}: {GEMMA4}.attention.sliding_window_pattern must be a bool per block "
                       f"({n_blocks})")
    swa = tuple(bool(x) for x in pattern)
    window = int(hp("attention.sliding_window"))
    if window < 1:
        raise BadInput(f"GGUF {path}: {GEMMA4}.attention.sliding_window {window} is not positive")
    heads = _per_block(path, hp, "attention.head_count", n_blocks, None)
    kv_heads = _per_block(path, hp, "attention.head_count_kv", n_blocks, hp("attention.head_count"))
    d_full = int(hp("attention.key_length", hidden // heads[0]))
    d_swa = int(hp("attention.key_length_swa"))
    if int(hp("attention.value_length", d_full)) != d_full or int(hp("attention.value_length_swa")) != d_swa:
        raise BadInput(f"GGUF {path}: {GEMMA4} key and value head sizes differ (llama.cpp requires them equal)")
    rot_full = int(hp("rope.dimension_count", d_full))
    rot_swa = int(hp("rope.dimension_count_swa", rot_full))
    experts = int(hp("expert_count", 0))
    missing = [n for n in HEAD + (PLE_HEAD if per_layer else ()) if n not in tensors]
    outside = OUTSIDE_BLOCKS if per_layer else tuple(n for n in OUTSIDE_BLOCKS if n not in PLE_HEAD)
    stray = [n for n in tensors if not n.startswith("blk.") and n not in outside]
    stray += [n for n in tensors if (m := re.match(r"blk\.(\d+)\.", n)) and int(m.group(1)) >= n_blocks]
    if missing or stray:
        raise BadInput(f"GGUF {path} lacks tensor {missing[0]}" if missing else
                       f"GGUF {path}: tensor {stray[0]} is not part of the {GEMMA4} model Kafila serves")
    blocks = []
    own_kv = n_blocks - shared  # llama.cpp's n_layer_kv_from_start
    for b in range(n_blocks):
        p = f"blk.{b}."
        d, rot = (d_swa, rot_swa) if swa[b] else (d_full, rot_full)
        if not (0 < rot <= d and rot % 2 == 0 and heads[b] > 0 and 0 < kv_heads[b] and heads[b] % kv_heads[b] == 0):
            raise BadInput(f"GGUF {path}: block {b} has {heads[b]} heads, {kv_heads[b]} KV heads of {d} with {rot} "
                           "rotated dims, which llama.cpp would not run")
        moe = p + "ffn_gate_inp.weight" in tensors
        kv_from = b if b < own_kv else own_kv - (2 if swa[b] else 1)
        if kv_from != b and (swa[kv_from] != swa[b] or kv_heads[kv_from] != kv_heads[b]):
            raise BadInput(f"GGUF {path}: block {b} shares block {kv_from}'s KV, which is of another kind or KV "
                           "head count; Kafila serves a shared KV of the sharing block's own geometry")
        blocks.append(Gemma4Block(swa[b], heads[b], kv_heads[b], d, rot, p + "attn_v.weight" in tensors, moe, kv_from))
        _check_block(path, tensors, blocks[-1], b, hidden, experts, per_layer)
    if any(g.moe for g in blocks) and not 0 < int(hp("expert_used_count", 0)) <= experts:
        raise BadInput(f"GGUF {path}: {GEMMA4} experts need expert_count and expert_used_count in 1..expert_count")
    factors = tensors.get("rope_freqs.weight")
    if not all(swa) and factors is None:
        raise BadInput(f"GGUF {path} lacks tensor rope_freqs.weight ({GEMMA4}'s full-attention blocks read it)")
    if factors is not None and (factors.qtype != "F32" or factors.shape[0] < rot_full // 2):
        raise BadInput(f"GGUF {path}: rope_freqs.weight is {factors.qtype} {factors.shape}, expected F32 with at "
                       f"least {rot_full // 2} factors")
    family = Family(
        ffn_act="gelu_tanh",
        post_norms=True,
        embed_scale=math.sqrt(hidden),
        attn_scale=1.0,
        sliding_window=window,
        swa_layers=swa,
        rope_base_swa=float(hp("rope.freq_base_swa", GEMMA4_SWA_ROPE_BASE)),
        logit_softcap=float(hp("final_logit_softcapping", 0.0)),
        n_experts=experts if any(g.moe for g in blocks) else 0,
        n_experts_used=int(hp("expert_used_count", 0)) if any(g.moe for g in blocks) else 0,
        experts_renorm=True,
    )
    if per_layer:
        vocab = tensors["token_embd.weight"].shape[0]
        want = {"per_layer_token_embd.weight": (vocab, n_blocks * per_layer),
                "per_layer_model_proj.weight": (n_blocks * per_layer, hidden), "per_layer_proj_norm.weight": (per_layer,)}
        for n, shape in want.items():
            if tuple(tensors[n].shape) != shape:
                raise BadInput(f"GGUF {path}: tensor {n} has shape {tensors[n].shape}, expected {shape}")
    return Gemma4Params(tuple(blocks), per_layer), family


def _check_block(path: str, tensors: dict, g: Gemma4Block, b: int, hidden: int, experts: int,
                 per_layer: int) -> None:  # fmt: skip
    """Block b's tensors: the required ones present, none unknown, the attention's shapes."""
    p = f"blk.{b}."
    gate_up = (FUSED_GATE_UP_EXPS,) if p + FUSED_GATE_UP_EXPS in tensors else SPLIT_GATE_UP
    attention = ATTENTION if g.kv_from == b else tuple(n for n in ATTENTION if n not in OWN_KV)
    required = attention + DENSE + (MOE + gate_up if g.moe else ()) + (PLE_BLOCK if per_layer else ())
    missing = [n for n in required if p + n not in tensors]
    if missing:
        raise BadInput(f"GGUF {path} lacks tensor {p}{missing[0]} ({len(missing)} missing in block {b})")
    known = set(required) | set(OPTIONAL) | set(OWN_KV)  # a sharing block's own K, V are not read
    known |= optional_block_tensors(GEMMA4, known)
    for name in tensors:
        if name.startswith(p) and name[len(p):] not in known:
            raise BadInput(f"GGUF {path}: tensor {name} is not part of the {GEMMA4} model Kafila serves")
    want = {"attn_q.weight": (g.n_heads * g.head_dim, hidden), "attn_k.weight": (g.n_kv_heads * g.head_dim, hidden),
            "attn_v.weight": (g.n_kv_heads * g.head_dim, hidden), "attn_q_norm.weight": (g.head_dim,),
            "attn_k_norm.weight": (g.head_dim,), "attn_output.weight": (hidden, g.n_heads * g.head_dim),
            "layer_output_scale.weight": (1,), "inp_gate.weight": (per_layer, hidden), "proj.weight": (hidden, per_layer),
            "post_norm.weight": (hidden,)}  # fmt: skip
    if g.moe:
        want |= {"ffn_gate_inp.weight": (experts, hidden), "ffn_gate_inp.scale": (hidden,)}
    for n, shape in want.items():
        t = tensors.get(p + n)
        if t is not None and tuple(t.shape) != shape:
            raise BadInput(f"GGUF {path}: tensor {t.name} has shape {t.shape}, expected {shape}")
    for n in (*gate_up, "ffn_down_exps.weight") if g.moe else ():
        t = tensors[p + n]
        if len(t.shape) != 3 or t.shape[0] != experts:
            raise BadInput(f"GGUF {path}: tensor {t.name} has shape {t.shape}, expected {experts} experts first")


def first_rows(index, ids) -> np.ndarray:
    """A first stage's input rows for token `ids` [n]: the embedding's rows, then `carried_tail`'s
    columns for a carried row: [n, carried]. Both tables' rows are read from the file, not held."""
    rows = index.rows("token_embd.weight", ids)
    h = index.hparams
    return rows if h.carried == h.hidden else np.concatenate([rows, carried_tail(index, ids)], axis=1)


def carried_tail(index, ids) -> np.ndarray:
    """What follows the hidden state in a first stage's carried row (Gemma4Params.carried) for
    token `ids` [n]: the per_layer_token_embd rows in the per-layer columns (the stage graph scales
    and adds their projection), zeros for the shared sources' K and V: [n, carried − hidden]."""
    h, g = index.hparams, index.hparams.gemma4
    out = np.zeros((len(np.asarray(ids).reshape(-1)), h.carried - h.hidden), np.float32)
    if g.per_layer:
        out[:, : len(g.blocks) * g.per_layer] = index.rows("per_layer_token_embd.weight", ids)
    return out
