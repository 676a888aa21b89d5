"""The optional tensors llama.cpp loads beside a model's matrices (create_tensor with
TENSOR_NOT_REQUIRED), and what each means, so a file that carries them is computed as llama.cpp
computes it rather than refused. llama.cpp's own random models (tests/test-llama-archs.cpp) carry
every one of them.

- `<matrix>.scale`: a factor on the matrix's output, {1} for a matrix, {E} (one per expert) for a
  3-D expert tensor (NVFP4-style files): build_lora_mm / build_lora_mm_id compute (W·x)·s;
- `<matrix>.input_scale`: loaded and never read by llama.cpp's graphs (an activation scale of the
  files that carry it): accepted, unused;
- biases added after the scale: attn_q/k/v.bias on every architecture (build_qkv), and
  attn_output.bias and ffn_{gate,up,down}.bias where the architecture's loader asks for them
  (llama; gpt-oss's attn_output.bias is its own), output.bias after qwen2's lm_head;
- qwen3's cls.output.weight: a reranker's classifier head, unused when generating.
"""

from __future__ import annotations

# the matrices llama.cpp multiplies through build_lora_mm(_id) with their optional .scale
SCALED_MATRICES = (
    "attn_q", "attn_k", "attn_v", "attn_output", "attn_qkv", "attn_gate", "ssm_in", "ssm_out", "ssm_alpha",
    "ssm_beta", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
    "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
)  # fmt: skip
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
# block biases an architecture's loader reads besides q/k/v's (llama.cpp's src/models/<arch>.cpp)
BLOCK_BIASES = {"llama": ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")}
HEAD_EXTRAS = {"qwen2": ("output.bias",), "qwen3": ("cls.output.weight",)}
UNUSED_HEAD_TENSORS = ("cls.output.weight",)


def optional_block_tensors(arch: str, names) -> set[str]:
    """The optional tensors a block of `arch` with tensors `names` (suffixes after blk.N.) may
    also hold: each scaled matrix's .scale and .input_scale, and the architecture's biases."""
    out = set(QKV_BIASES) | set(BLOCK_BIASES.get(arch, ()))
    for n in names:
        base = n.removesuffix(".weight")
        if base in SCALED_MATRICES:
            out |= {base + ".scale", base + ".input_scale"}
    return out


def output_extras(tensors) -> list[str]:
    """The tensors of a file that change what a matrix computes beyond W·x and that only the
    OpenVINO backend applies: .scale factors and biases besides q/k/v's (sorted names)."""
    return sorted(n for n in tensors if n.endswith(".scale") or (
        n.endswith(".bias") and not n.endswith(QKV_BIASES) and n.rsplit(".", 2)[-2] in
        ("attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")))  # fmt: skip
