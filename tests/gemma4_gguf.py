"""Small random-weight F32 Gemma 4 GGUFs with llama.cpp's gemma-4 tokenizer, written at test time
(never committed) for the llama.cpp comparison (tests/test_arch_gemma4.py).

Four blocks (`blocks`: more repeat the four's pattern), hidden 64, 4 query heads everywhere
(backends/gguf/gemma4.py names the parts):
- blocks 0 and 2 windowed (window 8): 2 KV heads of 16, all 16 dims rotated, RoPE base 10000;
- blocks 1 and 3 full: heads of 32 with 24 dims rotated by base 1e6 and rope_freqs factors
  (1, then 4, then 1e30: dims that barely turn, as Gemma 4's proportional RoPE writes them);
  block 1 has 2 KV heads and its own attn_v, block 3 one KV head whose values are its keys;
- block-wide output scales (layer_output_scale), logits soft-capped at 30, tied embeddings;
- `moe`: every block also has 8 experts of FFN 32 (top 2) beside its dense FFN, with the router's
  input scale and a down scale per expert; `fused`: their gate and up as one ffn_gate_up_exps (as
  llama.cpp's converter writes Gemma 4's).
`per_layer` P > 0: per-layer embeddings of P per block (the E2B/E4B models); `shared_kv` n: the
last n blocks read an earlier block's KV and have no attn_k, attn_v or attn_k_norm (their KV heads
are their source's), as E2B/E4B have them.
`extra_kv` adds {key: (value, GGUFValueType)} (the refusal tests).
"""

from __future__ import annotations

import os

import gguf
import numpy as np

from tests.arch_gguf import _copy_tokenizer

ARCH = "gemma4"
BLOCKS = 4
HIDDEN = 64
HEADS = 4
WINDOW = 8
SWA = SWA_4 = [True, False, True, False]
KV_HEADS = KV_HEADS_4 = [2, 2, 2, 1]
HEAD_SWA, HEAD_FULL = 16, 32
ROT_FULL = 24
OWN_VALUES = OWN_VALUES_4 = [True, True, True, False]
FFN = 64
EXPERTS = (8, 2, 32)  # E, k, expert FFN
EMBED_SCALE = 0.06


def rope_factors() -> np.ndarray:
    """[HEAD_FULL / 2]: the first 4 pairs turn as is, the next 4 four times slower, the rest not at all."""
    return np.array([1.0] * 4 + [4.0] * 4 + [1e30] * (HEAD_FULL // 2 - 8), np.float32)


def write_gemma4_gguf(path: str | os.PathLike, moe: bool = False, seed: int = 0, extra_kv: dict | None = None,
                      hidden: int = HIDDEN, ffn: int = FFN, experts: tuple[int, int, int] = EXPERTS,
                      blocks: int = BLOCKS, fused: bool = False, per_layer: int = 0, shared_kv: int = 0) -> str:
    """The file (module docstring); `hidden`, `ffn`, `experts` (E, k, expert FFN) resize it (rows
    of 256 let llama.cpp's quantizer put K-quants on the matrices)."""
    HIDDEN, FFN, EXPERTS = hidden, ffn, experts  # noqa: N806 (the module's shape, resized)
    SWA, KV_HEADS, OWN_VALUES = ([a[b % BLOCKS] for b in range(blocks)] for a in (SWA_4, KV_HEADS_4, OWN_VALUES_4))  # noqa: N806
    own_kv = blocks - shared_kv
    source = [b if b < own_kv else own_kv - (2 if SWA[b] else 1) for b in range(blocks)]
    KV_HEADS = [KV_HEADS[source[b]] for b in range(blocks)]  # noqa: N806 (a sharing block: its source's)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("kafila-test-gemma4" + ("-moe" if moe else ""))
    w.add_block_count(blocks)
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_array(f"{ARCH}.attention.head_count_kv", KV_HEADS)
    w.add_key_length(HEAD_FULL)
    w.add_value_length(HEAD_FULL)
    w.add_uint32(f"{ARCH}.attention.key_length_swa", HEAD_SWA)
    w.add_uint32(f"{ARCH}.attention.value_length_swa", HEAD_SWA)
    w.add_rope_dimension_count(ROT_FULL)
    w.add_uint32(f"{ARCH}.rope.dimension_count_swa", HEAD_SWA)
    w.add_rope_freq_base(1e6)
    w.add_float32(f"{ARCH}.rope.freq_base_swa", 10000.0)
    w.add_sliding_window(WINDOW)
    w.add_array(f"{ARCH}.attention.sliding_window_pattern", SWA)
    w.add_uint32(f"{ARCH}.embedding_length_per_layer_input", per_layer)
    if shared_kv:
        w.add_uint32(f"{ARCH}.attention.shared_kv_layers", shared_kv)
    w.add_float32(f"{ARCH}.final_logit_softcapping", 30.0)
    w.add_layer_norm_rms_eps(1e-6)
    if moe:
        n_exp, n_used, exp_ffn = EXPERTS
        w.add_expert_count(n_exp)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(exp_ffn)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, (value, vtype) in (extra_kv or {}).items():
        w.add_key_value(key, value, vtype)
    vocab = _copy_tokenizer(w, "gemma-4")

    def add(name: str, shape: tuple[int, ...], scale: float, mean: float = 0.0) -> None:
        w.add_tensor(name, (mean + rng.standard_normal(shape) * scale).astype(np.float32))

    add("token_embd.weight", (vocab, HIDDEN), EMBED_SCALE)  # tied: also the lm_head
    add("output_norm.weight", (HIDDEN,), 0.1, 1.0)
    w.add_tensor("rope_freqs.weight", rope_factors())
    if per_layer:
        add("per_layer_token_embd.weight", (vocab, blocks * per_layer), 0.5)
        add("per_layer_model_proj.weight", (blocks * per_layer, HIDDEN), 0.3)
        add("per_layer_proj_norm.weight", (per_layer,), 0.1, 1.0)
    for b in range(blocks):
        p = f"blk.{b}."
        d = HEAD_SWA if SWA[b] else HEAD_FULL
        add(p + "attn_norm.weight", (HIDDEN,), 0.1, 1.0)
        add(p + "attn_q.weight", (HEADS * d, HIDDEN), 0.25)
        if source[b] == b:  # (the random draws in the order files without shared KV were written)
            add(p + "attn_k.weight", (KV_HEADS[b] * d, HIDDEN), 0.25)
            if OWN_VALUES[b]:
                add(p + "attn_v.weight", (KV_HEADS[b] * d, HIDDEN), 0.3)
        add(p + "attn_q_norm.weight", (d,), 0.1, 0.4)
        if source[b] == b:
            add(p + "attn_k_norm.weight", (d,), 0.1, 0.4)
        add(p + "attn_output.weight", (HIDDEN, HEADS * d), 0.3)
        add(p + "post_attention_norm.weight", (HIDDEN,), 0.1, 1.0)
        add(p + "ffn_norm.weight", (HIDDEN,), 0.1, 1.0)
        add(p + "ffn_gate.weight", (FFN, HIDDEN), 0.3)
        add(p + "ffn_up.weight", (FFN, HIDDEN), 0.3)
        add(p + "ffn_down.weight", (HIDDEN, FFN), 0.3)
        add(p + "post_ffw_norm.weight", (HIDDEN,), 0.1, 1.0)
        w.add_tensor(p + "layer_output_scale.weight", np.array([0.6 + 0.2 * b], np.float32))
        if per_layer:
            add(p + "inp_gate.weight", (per_layer, HIDDEN), 0.3)
            add(p + "proj.weight", (HIDDEN, per_layer), 0.3)
            add(p + "post_norm.weight", (HIDDEN,), 0.1, 1.0)
        if moe:
            n_exp, _, exp_ffn = EXPERTS
            add(p + "ffn_gate_inp.weight", (n_exp, HIDDEN), 0.5)
            add(p + "ffn_gate_inp.scale", (HIDDEN,), 0.2, 1.0)
            add(p + "pre_ffw_norm_2.weight", (HIDDEN,), 0.1, 1.0)
            add(p + "post_ffw_norm_1.weight", (HIDDEN,), 0.1, 1.0)
            add(p + "post_ffw_norm_2.weight", (HIDDEN,), 0.1, 1.0)
            if fused:
                add(p + "ffn_gate_up_exps.weight", (n_exp, 2 * exp_ffn, HIDDEN), 0.3)
            else:
                add(p + "ffn_gate_exps.weight", (n_exp, exp_ffn, HIDDEN), 0.3)
                add(p + "ffn_up_exps.weight", (n_exp, exp_ffn, HIDDEN), 0.3)
            add(p + "ffn_down_exps.weight", (n_exp, HIDDEN, exp_ffn), 0.3)
            add(p + "ffn_down_exps.scale", (n_exp,), 0.2, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
