"""Hybrid models: gated delta-net (linear attention) layers beside gated full-attention layers.

`qwen35` (Qwen3.5 dense) as llama.cpp 0.3.36 reads it (src/models/qwen35.cpp):
- which blocks are recurrent: `attention.recurrent_layers` (bool per block) when present, else
  every block i with (i + 1) % full_attention_interval ≠ 0 (default interval 4);
- a delta-net block: attn_qkv [conv_dim, H] (q | k | v channels, conv_dim = 2·Hk·S + Hv·S),
  attn_gate [Hv·S, H] (z), ssm_conv1d [conv_dim, conv_kernel], ssm_dt.bias [Hv], ssm_a [Hv]
  (−exp(A_log), stored negated), ssm_beta / ssm_alpha [Hv, H], ssm_norm [S], ssm_out [H, Hv·S];
  S = ssm.state_size is both the key and the value head size (llama.cpp asserts they are equal),
  Hk = ssm.group_count, Hv = ssm.time_step_rank, Hv·S = ssm.inner_size;
- a full-attention block: attn_q [nh·2D, H] (per head: D query rows then D output-gate rows),
  attn_k/attn_v, q/k RMSNorm, attn_output; interleaved M-RoPE (IMROPE) over the first
  rope.dimension_count dims with rope.dimension_sections;
- every block: attn_norm, post_attention_norm (before the FFN), SwiGLU ffn_gate/up/down.
`qwen35moe` (Qwen3.5 MoE, src/models/qwen35moe.cpp) is the same but for its FFN: softmax over the
E router logits, top k renormalised, and a shared expert gated by sigmoid(ffn_gate_inp_shexp · x)
(as qwen2moe's; families.py); llama.cpp reads no expert_weights_scale for it.
`qwen3next` (Qwen3-Next, src/models/qwen3next.cpp) is qwen35moe's older sibling, with these
differences: plain NEOX RoPE over the first rope.dimension_count dims (no sections); β and α come
from one fused ssm_ba [2·Hv, H] laid out per key head (its r = Hv/Hk betas, then its r alphas);
value head j reads key head j // r (llama.cpp's repeat-interleave, not qwen35's tiling); q|k|v and z
come from attn_qkv and attn_gate, or from the legacy fused ssm_in [Hk·(2S + 2rS), H] laid out per
key head (q S, k S, v r·S, z r·S); llama.cpp applies no .scale of the delta-net matrices.
A file may carry multi-token-prediction blocks (`nextn_predict_layers` = 1, counted in
block_count, after the trunk's): llama.cpp's main pass never runs them, and `n_blocks` is the
trunk's. Each is a gated full-attention block (a qwen35moe one with its experts) plus nextn.enorm,
nextn.hnorm and nextn.eh_proj [2H → H], and optionally nextn.shared_head_norm,
nextn.shared_head_head and nextn.embed_tokens (else the model's output_norm, output and
token_embd): `--speculate mtp` drafts with it (backends/openvino/mtp.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from backends.errors import BadInput
from backends.gguf.families import DENSE_FFN_TENSORS, FUSED_GATE_UP_EXPS, MOE_TENSORS, SHARED_EXPERT_TENSORS
from backends.gguf.optional import optional_block_tensors

QWEN3NEXT = "qwen3next"
HYBRID_MOE = ("qwen35moe", QWEN3NEXT)
HYBRID_ARCHITECTURES = ("qwen35", *HYBRID_MOE)
NORM_TENSORS = ("attn_norm.weight", "post_attention_norm.weight")
ATTENTION_TENSORS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_q_norm.weight",
                     "attn_k_norm.weight", "attn_output.weight")  # fmt: skip
DELTA_NET_TENSORS = ("attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a",
                     "ssm_beta.weight", "ssm_alpha.weight", "ssm_norm.weight", "ssm_out.weight")  # fmt: skip
QWEN3NEXT_DELTA_NET_TENSORS = ("ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_ba.weight", "ssm_norm.weight",
                               "ssm_out.weight")  # fmt: skip; and attn_qkv + attn_gate, or ssm_in
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's default for qwen35
MTP_TENSORS = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight")
MTP_OPTIONAL = ("nextn.shared_head_norm.weight", "nextn.shared_head_head.weight", "nextn.embed_tokens.weight")


@dataclass(frozen=True)
class HybridParams:
    recurrent: tuple[bool, ...]  # per block, the MTP blocks' too: a gated delta-net layer (else attention)
    rope_dims: int  # RoPE rotates the first rope_dims of each head (NEOX halves), the rest pass
    rope_sections: tuple[int, int, int, int] | None  # IMROPE sections (text: every section sees the
    #                                                  position); None: plain NEOX (qwen3next)
    conv_kernel: int
    k_heads: int  # Hk
    v_heads: int  # Hv (a multiple of Hk; value head j reads key head j mod Hk, as llama.cpp tiles)
    state: int  # S: key and value head size of the delta rule
    interleaved: bool = False  # qwen3next: value head j reads key head j // (Hv/Hk); β, α from ssm_ba
    mtp_blocks: int = 0  # multi-token-prediction blocks after the trunk's (block_count − n_blocks)

    @property
    def trunk(self) -> tuple[bool, ...]:
        """`recurrent` of the trunk's blocks (the model's n_blocks)."""
        return self.recurrent[: len(self.recurrent) - self.mtp_blocks]

    def rope_inv_freq(self, base: float) -> np.ndarray:
        """[rope_dims/2] the gated attention's RoPE frequencies: IMROPE's (imrope_inv_freq), or
        plain NEOX's base^(−2i/rope_dims) without sections (qwen3next)."""
        R = self.rope_dims
        if self.rope_sections is None:
            return base ** (-np.arange(0, R, 2, dtype=np.float64) / R)
        return imrope_inv_freq(R, base, self.rope_sections)

    @property
    def conv_channels(self) -> int:
        return (2 * self.k_heads + self.v_heads) * self.state

    def state_bytes_per_request(self, block: int, bytes_per_value: int = 4) -> int:
        """A recurrent block's per-request state: (conv_kernel − 1) × conv_channels for the
        convolution plus Hv × S × S for the matrix state; 0 for an attention block."""
        if not self.recurrent[block]:
            return 0
        return bytes_per_value * ((self.conv_kernel - 1) * self.conv_channels + self.v_heads * self.state ** 2)


def mtp_block_count(path: str, arch: str, hp, block_count: int) -> int:
    """The file's multi-token-prediction blocks (`nextn_predict_layers`): 0 or 1 (llama.cpp runs
    one), and never every block (a trunk to draft for)."""
    mtp = int(hp("nextn_predict_layers", 0))
    if mtp and (arch not in ("qwen35", "qwen35moe") or mtp != 1 or mtp >= block_count):
        raise BadInput(f"GGUF {path}: {arch} with {mtp} multi-token-prediction (nextn) layers of {block_count} "
                       "blocks is not served (Kafila serves one, on qwen35 and qwen35moe, as llama.cpp)")
    return mtp


def hybrid_params(path: str, arch: str, hp, tensors: dict, n_blocks: int, head_dim: int,
                  mtp: int = 0) -> HybridParams:
    """The hybrid part of a `qwen35` file of `n_blocks` trunk blocks and `mtp` multi-token-
    prediction blocks after them, checked against its tensors (BadInput on a mismatch)."""
    moe = arch in HYBRID_MOE
    if bool(int(hp("expert_count", 0))) != moe:
        raise BadInput(f"GGUF {path}: {arch} {'without' if moe else 'with'} experts is not a model llama.cpp reads")
    ffn = MOE_TENSORS + SHARED_EXPERT_TENSORS if moe else DENSE_FFN_TENSORS
    nxt = arch == QWEN3NEXT
    flags = hp("attention.recurrent_layers", []) or []
    n_all = n_blocks + mtp
    if flags:
        recurrent = tuple(bool(f) for f in flags)
    else:
        interval = int(hp("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL))
        if interval < 1:
            raise BadInput(f"GGUF {path}: {arch}.full_attention_interval {interval} is not positive")
        recurrent = tuple(i < n_blocks and (i + 1) % interval != 0 for i in range(n_all))  # MTP blocks attend
    if len(recurrent) != n_all:
        raise BadInput(f"GGUF {path}: {arch}.attention.recurrent_layers has {len(recurrent)} entries, "
                       f"not block_count {n_all}")
    if any(recurrent[n_blocks:]):
        raise BadInput(f"GGUF {path}: {arch}.attention.recurrent_layers marks a multi-token-prediction block "
                       "recurrent; llama.cpp reads them as attention blocks")
    sections = None if nxt else tuple(int(s) for s in (list(hp("rope.dimension_sections", [])) + [0, 0, 0, 0])[:4])
    h = HybridParams(recurrent=recurrent, rope_dims=int(hp("rope.dimension_count", head_dim)),
                     rope_sections=sections, conv_kernel=int(hp("ssm.conv_kernel")),
                     k_heads=int(hp("ssm.group_count")), v_heads=int(hp("ssm.time_step_rank")),
                     state=int(hp("ssm.state_size")), interleaved=nxt, mtp_blocks=mtp)  # fmt: skip
    inner = int(hp("ssm.inner_size"))
    if h.k_heads < 1 or h.v_heads % h.k_heads or inner != h.v_heads * h.state:
        raise BadInput(f"GGUF {path}: {arch} ssm heads {h.k_heads}/{h.v_heads} of {h.state} with inner size "
                       f"{inner}: Kafila serves Hv a multiple of Hk and inner size Hv × state_size")
    if not 0 < h.rope_dims <= head_dim or h.rope_dims % 2:
        raise BadInput(f"GGUF {path}: {arch} RoPE over {h.rope_dims} of {head_dim} dims with sections "
                       f"{sections} is not served")
    for b in range(n_all):
        delta = DELTA_NET_TENSORS
        if nxt:  # its q|k|v and z: attn_qkv + attn_gate where present (llama.cpp prefers them), else ssm_in
            fused = f"blk.{b}.attn_qkv.weight" not in tensors
            inputs = ("ssm_in.weight",) if fused else ("attn_qkv.weight", "attn_gate.weight")
            delta = QWEN3NEXT_DELTA_NET_TENSORS + inputs
            if not fused and f"blk.{b}.ssm_in.weight" in tensors:  # loaded, unused
                delta += ("ssm_in.weight",)
        names = NORM_TENSORS + ffn + (delta if recurrent[b] else ATTENTION_TENSORS)
        if b >= n_blocks:
            names += MTP_TENSORS
        if f"blk.{b}.{FUSED_GATE_UP_EXPS}" in tensors and moe:  # gate and up experts in one
            names = tuple(n for n in names if n not in ("ffn_gate_exps.weight", "ffn_up_exps.weight"))
            names += (FUSED_GATE_UP_EXPS,)
        missing = [n for n in names if f"blk.{b}.{n}" not in tensors]
        if missing:
            raise BadInput(f"GGUF {path} lacks tensor blk.{b}.{missing[0]} (a {arch} "
                           f"{'delta-net' if recurrent[b] else 'attention'} block)")
        allowed = set(names) | optional_block_tensors(arch, names) | (set(MTP_OPTIONAL) if b >= n_blocks else set())
        extra = [n for n in tensors if n.startswith(f"blk.{b}.") and n[len(f"blk.{b}."):] not in allowed]
        if extra:
            raise BadInput(f"GGUF {path}: tensor {extra[0]} is not part of the {arch} model Kafila serves")
        t = tensors[f"blk.{b}.ssm_conv1d.weight" if recurrent[b] else f"blk.{b}.attn_q.weight"]
        want = (h.conv_channels, h.conv_kernel) if recurrent[b] else None
        if want is not None and tuple(t.shape) != want:
            raise BadInput(f"GGUF {path}: tensor {t.name} is {t.shape}, expected {want}")
    return h


def imrope_inv_freq(rope_dims: int, base: float, sections: tuple[int, ...]) -> np.ndarray:
    """[rope_dims/2] frequencies base^(−2i/rope_dims), 0 where llama.cpp's IMROPE reads the 4th
    (extra) position, which is 0 for text tokens (llm_graph_input_pos::set_input)."""
    inv = base ** (-np.arange(0, rope_dims, 2, dtype=np.float64) / rope_dims)
    s0, s1, s2, s3 = sections
    total = s0 + s1 + s2 + s3
    for i in range(len(inv)):
        sector = i % total if total else i
        if not ((sector % 3 == 1 and sector < 3 * s1) or (sector % 3 == 2 and sector < 3 * s2)
                or (sector % 3 == 0 and sector < 3 * s0)):  # fmt: skip
            inv[i] = 0.0
    return inv


def has_mtp(index) -> bool:
    """Whether `index` carries a multi-token-prediction block."""
    return index.hparams.hybrid is not None and index.hparams.hybrid.mtp_blocks > 0


def mtp_block(index) -> int:
    """The block index of `index`'s multi-token-prediction block (after the trunk's); BadInput
    when it has none."""
    if not has_mtp(index):
        raise BadInput(f"{index.name} has no multi-token-prediction (nextn) layer: --speculate mtp needs a "
                       "Qwen3.5 file converted with its MTP layer; use --speculate ngram or draft")
    return index.hparams.n_blocks


def mtp_tensor(index, own: str, fallback: str) -> str:
    """The MTP block's own tensor `nextn.<own>` where the file has it, else the model's `fallback`."""
    name = f"blk.{mtp_block(index)}.nextn.{own}"
    return name if name in index.tensors else fallback


def mtp_inputs(index, tokens, prev: np.ndarray) -> np.ndarray:
    """The MTP block's input rows [e_q | h_{q−1}] f32 [n, 2H]: each token's embedding row
    (nextn.embed_tokens or token_embd) beside `prev` [n, H], the hiddens before them."""
    e = index.rows(mtp_tensor(index, "embed_tokens.weight", "token_embd.weight"), np.asarray(tokens, dtype=np.int64))
    return np.concatenate([np.asarray(e, np.float32), np.asarray(prev, np.float32).reshape(len(e), -1)], axis=1)


def final_norm(index, hidden: np.ndarray) -> np.ndarray:
    """The model's final hidden [n, H] after output_norm (llama.cpp's h_nextn, the MTP input), in
    f32 with the mean square in f64."""
    x = np.asarray(hidden, np.float32)
    weight = index.dequantize("output_norm.weight", np.float32)
    inv = 1.0 / np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=-1, keepdims=True) + index.hparams.rms_eps)
    return (x * inv.astype(np.float32)) * weight
