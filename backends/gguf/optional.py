"""The optional tensors llama.cpp loads beside a model's matrices (create_tensor with
TENSOR_NOT_REQUIRED), and what each means, so a file that carries them is computed as llama.cpp
computes it rather than refused. llama.cpp's own random models (tests/test-llama-archs.cpp) carry
every one of them.

- `<matrix>.scale`: a factor on the matrix's output, {1} for a matrix, {E} (one per expert) for a
  3-D expert tensor (NVFP4-style files): build_lora_mm / build_lora_mm_id compute (W·x)·s, but
  only where the architecture's graph passes it (APPLIED_SCALES; every loader reads them all):
  q/k/v and attn_output everywhere, the rest per architecture (e.g. qwen2's FFN scales are read
  and never used);
- `<matrix>.input_scale`: loaded and never read by llama.cpp's graphs (an activation scale of the
  files that carry it): accepted, unused;
- biases added after the scale: attn_q/k/v.bias on every architecture (build_qkv), and
  attn_output.bias and ffn_{gate,up,down}.bias where the architecture's loader asks for them
  (llama; gpt-oss's attn_output.bias is its own), output.bias after qwen2's lm_head;
- qwen3's cls.output.weight: a reranker's classifier head, unused when generating.
"""

from __future__ import annotations

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")  # build_qkv and build_attn, every architecture
DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")
EXPERTS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SHARED = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
DELTA_NET = ("attn_qkv", "attn_gate", "ssm_alpha", "ssm_beta", "ssm_out")
# the matrices llama.cpp multiplies through build_lora_mm(_id) with their optional .scale
SCALED_MATRICES = (*ATTENTION, *DELTA_NET, "ssm_in", *DENSE_FFN, *EXPERTS, *SHARED)
# the scales each architecture's graph applies besides ATTENTION's (src/models/<arch>.cpp's *_s)
APPLIED_SCALES = {"llama": DENSE_FFN + EXPERTS, "qwen3": DENSE_FFN, "qwen3moe": EXPERTS, "gemma4": DENSE_FFN + EXPERTS,
                  "qwen35": DENSE_FFN + DELTA_NET, "qwen35moe": EXPERTS + SHARED + DELTA_NET,
                  "qwen3next": EXPERTS + SHARED}  # fmt: skip
QKV_BIASES = ("attn_q.bias", "attn_k.bias", "attn_v.bias")
# block biases an architecture's loader reads besides q/k/v's (llama.cpp's src/models/<arch>.cpp)
BLOCK_BIASES = {"llama": ("attn_output.bias", "ffn_gate.bias", "ffn_up.bias", "ffn_down.bias")}
HEAD_EXTRAS = {"qwen2": ("output.bias",), "qwen3": ("cls.output.weight",)}


def optional_block_tensors(arch: str, names) -> set[str]:
    """The optional tensors a block of `arch` with tensors `names` (suffixes after blk.N.) may
    also hold: each scaled matrix's .scale and .input_scale, and the architecture's biases."""
    out = set(QKV_BIASES) | set(BLOCK_BIASES.get(arch, ()))
    for n in names:
        base = n.removesuffix(".weight")
        if base in SCALED_MATRICES:
            out |= {base + ".scale", base + ".input_scale"}
    return out


def applies_scale(arch: str, matrix: str) -> bool:
    """Whether llama.cpp's `arch` graph multiplies `matrix`'s output (e.g. "ffn_up_exps") by its .scale."""
    return matrix in ATTENTION or matrix in APPLIED_SCALES.get(arch, ())


def applied_scale(arch: str, name: str, tensors) -> str | None:
    """The .scale tensor llama.cpp's `arch` graph applies to matrix `name` ("blk.0.ffn_up.weight"
    or "blk.0.ffn_up"), None when the file has none or the graph ignores it."""
    base = name.removesuffix(".weight")
    scale = base + ".scale"
    return scale if scale in tensors and applies_scale(arch, base.rpartition(".")[2]) else None


def bias_before_scale(name: str) -> bool:
    """Whether matrix `name`'s bias is added before its scale: a feed-forward's (build_ffn,
    dense and shared expert), (W·x + b)·s; elsewhere (W·x)·s + b."""
    return name.removesuffix(".weight").rpartition(".")[2].startswith(DENSE_FFN)


def output_extras(arch: str, tensors) -> list[str]:
    """The tensors of a file that change what a matrix computes beyond W·x and that only the
    OpenVINO backend applies: the .scale factors llama.cpp applies and the biases besides q/k/v's."""
    def extra(name: str) -> bool:
        base, _, kind = name.rpartition(".")
        matrix = base.rpartition(".")[2]
        if kind == "scale":
            return applies_scale(arch, matrix)
        return kind == "bias" and matrix in ("attn_output", *DENSE_FFN, "output")

    return sorted(n for n in tensors if extra(n))
