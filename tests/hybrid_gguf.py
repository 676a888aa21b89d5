"""A small random-weight F32 `qwen35` GGUF (Qwen3.5 dense: gated delta-net layers beside gated
full-attention layers), written at test time for the llama.cpp comparison (tests/test_arch_hybrid.py).

Shapes (llama.cpp's src/models/qwen35.cpp names): 4 blocks, hidden 64, full_attention_interval 2
(blocks 1 and 3 attend, 0 and 2 are delta-net layers, so every split of 2 or 3 stages holds both
kinds or a recurrent layer alone); attention: 4 query heads of 32 with a per-head output gate
(attn_q rows [q | gate] per head), 2 KV heads, q/k RMSNorm, interleaved M-RoPE over the first 16
dims (partial RoPE; sections [3, 3, 2, 0] cover all 8 frequencies); delta-net: 2 key heads and 4
value heads (so each key head serves two value heads, llama.cpp's tiled mapping) of 16, causal
conv kernel 4. The vocabulary is 512 ids with no tokenizer: prompts are token ids.

`moe=True` writes `qwen35moe` (Qwen3.5 MoE) instead: each block's FFN is 8 experts of 32 (top 2,
renormalised) and a gated shared expert of 48, as llama.cpp's src/models/qwen35moe.cpp reads them.
`arch="qwen3next"` writes Qwen3-Next's layout on the MoE file: no RoPE sections (plain NEOX), and
each delta-net block's legacy fused ssm_in (per key head: q, k, v, z) and ssm_ba (per key head: the
betas, then the alphas) instead of attn_qkv, attn_gate, ssm_beta and ssm_alpha; with 2 key heads
and 4 value heads, its repeat-interleaved head mapping differs from qwen35's tiling.
"""

from __future__ import annotations

import os

import gguf
import numpy as np

ARCH = "qwen35"
SHAPE = dict(blocks=4, hidden=64, heads=4, kv_heads=2, head_dim=32, rope_dims=16, ffn=128,
             interval=2, k_heads=2, v_heads=4, state=16, conv=4, vocab=512)  # fmt: skip
SECTIONS = [3, 3, 2, 0]
MOE_ARCH = "qwen35moe"
EXPERTS = dict(count=8, used=2, ffn=32, shared_ffn=48)


def write_qwen35_gguf(path: str | os.PathLike, *, seed: int = 0, moe: bool = False, arch: str = "",
                      blocks: int = 0, tokenizer: bool = False, shape: dict | None = None,
                      experts: dict | None = None, mtp: bool = False) -> str:
    """The file (module docstring); `blocks`: another block count (attention every second one);
    `tokenizer`: Qwen2's real tokenizer (llama.cpp's ggml-vocab-qwen2.gguf) and its vocabulary
    instead of the 512 ids, for sessions that take text; `shape` / `experts`: SHAPE's and
    EXPERTS' entries replaced (bench.llamacpp_speed's larger file), the matrices' random values
    scaled by sqrt(64 / hidden) so that a wider model's activations stay as tame; `mtp`: one
    multi-token-prediction block after the trunk's (nextn_predict_layers 1, counted in
    block_count): a full-attention block with nextn.eh_proj, enorm, hnorm and shared_head_norm,
    as llama.cpp's qwen35 loader reads it (its main pass never runs it)."""
    s = {**SHAPE, **(shape or {})}
    s["blocks"] = blocks or s["blocks"]
    ex = dict(EXPERTS, **(experts or {}))
    arch = arch or (MOE_ARCH if moe else ARCH)
    widen = float(np.sqrt(SHAPE["hidden"] / s["hidden"]))
    nxt = arch == "qwen3next"
    moe = moe or nxt
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"kafila-test-{arch}")
    w.add_block_count(s["blocks"] + int(mtp))
    if mtp:
        w.add_uint32(f"{arch}.nextn_predict_layers", 1)
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_dimension_count(s["rope_dims"])
    if not nxt:
        w.add_rope_dimension_sections(SECTIONS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_uint32(f"{arch}.full_attention_interval", s["interval"])
    if moe:
        w.add_expert_count(ex["count"])
        w.add_expert_used_count(ex["used"])
        w.add_expert_feed_forward_length(ex["ffn"])
        w.add_expert_shared_feed_forward_length(ex["shared_ffn"])
    w.add_ssm_conv_kernel(s["conv"])
    w.add_ssm_inner_size(s["v_heads"] * s["state"])
    w.add_ssm_state_size(s["state"])
    w.add_ssm_time_step_rank(s["v_heads"])
    w.add_ssm_group_count(s["k_heads"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        from tests.arch_gguf import _copy_tokenizer

        s["vocab"] = _copy_tokenizer(w, "qwen2")
    else:  # llama.cpp's dummy tokenizer (its tests/test-llama-archs.cpp writes the same): ids only
        w.add_tokenizer_model("test")
        w.add_token_list([f"tok_{i}" for i in range(s["vocab"])])
        w.add_token_scores([0.0] * s["vocab"])
    H, D = s["hidden"], s["head_dim"]

    def add(name: str, shape: tuple[int, ...], scale: float, mean: float = 0.0) -> None:
        if len(shape) > 1 and name != "token_embd.weight":
            scale *= widen
        w.add_tensor(name, (mean + rng.standard_normal(shape) * scale).astype(np.float32))

    add("token_embd.weight", (s["vocab"], H), 1.0)  # tied: also the lm_head
    add("output_norm.weight", (H,), 0.1, 1.0)
    key_dim, value_dim = s["k_heads"] * s["state"], s["v_heads"] * s["state"]
    for b in range(s["blocks"] + int(mtp)):
        p = f"blk.{b}."
        add(p + "attn_norm.weight", (H,), 0.1, 1.0)
        add(p + "post_attention_norm.weight", (H,), 0.1, 1.0)
        if b == s["blocks"]:  # the MTP block's own part
            add(p + "nextn.eh_proj.weight", (H, 2 * H), 0.2)
            add(p + "nextn.enorm.weight", (H,), 0.1, 1.0)
            add(p + "nextn.hnorm.weight", (H,), 0.1, 1.0)
            add(p + "nextn.shared_head_norm.weight", (H,), 0.1, 1.0)
        if (b + 1) % s["interval"] == 0 or b == s["blocks"]:  # full attention
            add(p + "attn_q.weight", (s["heads"] * D * 2, H), 0.25)
            add(p + "attn_k.weight", (s["kv_heads"] * D, H), 0.25)
            add(p + "attn_v.weight", (s["kv_heads"] * D, H), 0.3)
            add(p + "attn_q_norm.weight", (D,), 0.5, 1.0)
            add(p + "attn_k_norm.weight", (D,), 0.5, 1.0)
            add(p + "attn_output.weight", (H, s["heads"] * D), 0.3)
        else:  # gated delta net
            if nxt:
                add(p + "ssm_in.weight", (2 * key_dim + 2 * value_dim, H), 0.3)
                add(p + "ssm_ba.weight", (2 * s["v_heads"], H), 0.3)
            else:
                add(p + "attn_qkv.weight", (2 * key_dim + value_dim, H), 0.3)
                add(p + "attn_gate.weight", (value_dim, H), 0.3)
            add(p + "ssm_conv1d.weight", (2 * key_dim + value_dim, s["conv"]), 0.5)
            add(p + "ssm_dt.bias", (s["v_heads"],), 0.5, 1.0)
            w.add_tensor(p + "ssm_a", -np.exp(rng.standard_normal(s["v_heads"]) * 0.5).astype(np.float32))
            if not nxt:
                add(p + "ssm_beta.weight", (s["v_heads"], H), 0.3)
                add(p + "ssm_alpha.weight", (s["v_heads"], H), 0.3)
            add(p + "ssm_norm.weight", (s["state"],), 0.1, 1.0)
            add(p + "ssm_out.weight", (H, value_dim), 0.3)
        if moe:
            E, F, Fs = ex["count"], ex["ffn"], ex["shared_ffn"]
            add(p + "ffn_gate_inp.weight", (E, H), 0.5)
            add(p + "ffn_gate_exps.weight", (E, F, H), 0.2)
            add(p + "ffn_up_exps.weight", (E, F, H), 0.2)
            add(p + "ffn_down_exps.weight", (E, H, F), 0.2)
            add(p + "ffn_gate_inp_shexp.weight", (H,), 0.3)
            add(p + "ffn_gate_shexp.weight", (Fs, H), 0.2)
            add(p + "ffn_up_shexp.weight", (Fs, H), 0.2)
            add(p + "ffn_down_shexp.weight", (H, Fs), 0.2)
        else:
            add(p + "ffn_gate.weight", (s["ffn"], H), 0.2)
            add(p + "ffn_up.weight", (s["ffn"], H), 0.2)
            add(p + "ffn_down.weight", (H, s["ffn"]), 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
