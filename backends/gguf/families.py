"""What each architecture family adds to the Llama block, read from GGUF metadata as llama.cpp
reads it (src/models/<arch>.cpp, llama-model.cpp, llama-hparams.cpp of llama-cpp-python 0.3.36).

Gemma 3 (`gemma3`), as llama.cpp computes it:
- the embedding's rows × sqrt(hidden) (in f32) before block 0; tied lm_head;
- NEOX RoPE; RMSNorm of each q and k head; q × attention scale 1/sqrt(head size)
  (27B, the 62-block model: 1/sqrt(hidden / heads));
- an RMSNorm of the attention output (post_attention_norm) before its residual add, and of the
  FFN output (post_ffw_norm) before its own; FFN = GELU(tanh)(gate) · up;
- RMSNorm weights used as stored: the converter has already added Gemma's 1 (norm = x·w);
- sliding-window layers: with `attention.sliding_window` n > 0, a layer is windowed per
  `attention.sliding_window_pattern` (a bool per layer, or a period P: layer l is windowed
  unless l % P = P − 1; default 6). A windowed layer's query at position p sees keys at
  positions q with p − q < n, and rotates with `rope.freq_base_swa` (default 10000) and scale 1;
  the other layers with `rope.freq_base` and the file's linear scaling;
- optional `final_logit_softcapping` c: logits = c·tanh(logits / c).

Mixture of experts (`qwen3moe`, `qwen2moe`, `llama` with `expert_count` > 0, Mixtral's layout):
the FFN is ffn_gate_inp [E, H] (router) and 3-D ffn_gate_exps / ffn_up_exps [E, F, H],
ffn_down_exps [E, H, F]; softmax over the E router logits, the top `expert_used_count`, their
weights renormalised to sum 1 for qwen3moe, qwen35moe and llama (not qwen2moe; none of them
reads expert_weights_scale); qwen2moe and qwen35moe add a shared expert (ffn_{gate,up,down}_shexp)
gated by sigmoid(ffn_gate_inp_shexp · x).

gpt-oss (`gpt-oss`, llama.cpp's LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp), as llama.cpp computes it:
- RMSNorm (attn_norm) → q/k/v (biases optional, as on llama) → NEOX RoPE with YaRN → attention
  with q·k scale 1/sqrt(head size) and a learnt sink per head (attn_sinks [heads]: one more logit
  in each query's softmax denominator, with no value) → attn_output + its bias → residual;
- RMSNorm with `post_attention_norm` (the FFN's input norm: the file has no ffn_norm) → MoE →
  residual; output_norm, an untied output.weight;
- sliding window `attention.sliding_window` (required) on the layers of pattern period 2 by
  default (layer l windowed unless l % 2 = 1: the even layers; a bool per layer when the pattern
  is an array), windowed layers rotate with `rope.freq_base_swa` (default: rope.freq_base) and
  the same scaling as the full ones;
- YaRN when `rope.scaling.type` is yarn: the factor s = `rope.scaling.factor` (freq_scale 1/s),
  original context `rope.scaling.original_context_length` (default context_length), beta_fast 32
  and beta_slow 1 (llama.cpp's context defaults: it reads no beta keys for this architecture),
  ext_factor 1; frequency i mixes the interpolated θ/s and the original θ by a ramp over the
  pair index between the correction dims, and cos/sin are × (1 + 0.1·ln s) (s > 1) ×
  `rope.scaling.attn_factor` (default 1);
- MoE: router ffn_gate_inp + its bias; the top `expert_used_count` of the raw logits, softmax over
  those k only (SOFTMAX_WEIGHT), not renormalised nor scaled (expert_weights_scale is not read);
  each expert's gate/up/down add their bias rows (ffn_{gate,up,down}_exps.bias [E, rows]);
  activation swiglu_oai: x = min(gate, 7), y = clamp(up, −7, 7), x·sigmoid(1.702·x)·(y + 1).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from backends.errors import BadInput

GEMMA3_BLOCK_TENSORS = ("post_attention_norm.weight", "post_ffw_norm.weight")
GEMMA3_DEFAULT_SWA_PERIOD = 6
GEMMA3_SWA_ROPE_BASE = 10000.0  # llama_hparams.rope_freq_base_train_swa's default
GEMMA3_27B_BLOCKS = 62
MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama", "qwen35moe", "qwen3next")
SHARED_EXPERT_ARCHITECTURES = ("qwen2moe", "qwen35moe", "qwen3next")
DENSE_FFN_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
FUSED_GATE_UP_EXPS = "ffn_gate_up_exps.weight"  # [E, 2F, H]: gate's F rows then up's (qwen35moe, qwen3next)
MOE_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
SHARED_EXPERT_TENSORS = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                         "ffn_down_shexp.weight")  # fmt: skip
GPT_OSS = "gpt-oss"
GPT_OSS_DEFAULT_SWA_PERIOD = 2
GPT_OSS_TENSORS = ("attn_output.bias", "attn_sinks.weight", "ffn_gate_inp.bias", "ffn_gate_exps.bias",
                   "ffn_up_exps.bias", "ffn_down_exps.bias")  # fmt: skip
# llama_context_params' YaRN defaults (llama-cpp-python passes the same): gpt-oss reads no beta keys
YARN_BETA_FAST = 32.0
YARN_BETA_SLOW = 1.0
SWIGLU_OAI_ALPHA = 1.702  # build_moe_ffn's constants for LLM_FFN_SWIGLU_OAI_MOE
SWIGLU_OAI_LIMIT = 7.0


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling as llama.cpp applies it with ext_factor 1 (backends/openvino/attention.py
    turns it into per-frequency multipliers and a cos/sin magnitude)."""

    freq_scale: float  # 1 / rope.scaling.factor (1 when no factor)
    n_ctx_orig: int  # rope.scaling.original_context_length (default: context_length)
    attn_factor: float = 1.0  # rope.scaling.attn_factor
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW


def yarn_multipliers(yarn: Yarn, head_dim: int, base: float) -> np.ndarray:
    """[D/2]: frequency pair i's angle × this under YaRN: 1 below the low correction dim,
    freq_scale above the high one, a linear ramp over the pair index between."""
    low, high = _yarn_correction_dims(yarn, head_dim, base)
    i = np.arange(head_dim // 2, dtype=np.float64)
    extrapolated = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1: keeps θ_i
    return yarn.freq_scale * (1.0 - extrapolated) + extrapolated


def _yarn_correction_dims(yarn: Yarn, head_dim: int, base: float) -> tuple[float, float]:
    """The pair indices where the ramp starts and ends: D·ln(n_ctx_orig / (2π·β)) / (2·ln base) for
    β = beta_fast (floored, ≥ 0) and beta_slow (ceiled, ≤ D − 1), in f32 as ggml computes them
    (a floor or ceil can turn on the last bit)."""
    f = np.float32

    def dim(beta: float) -> np.float32:
        ratio = f(yarn.n_ctx_orig) / (f(beta) * f(2.0) * f(math.pi))
        return f(head_dim) * np.log(ratio, dtype=np.float32) / (f(2.0) * np.log(f(base), dtype=np.float32))

    return max(0.0, float(np.floor(dim(yarn.beta_fast)))), min(head_dim - 1.0, float(np.ceil(dim(yarn.beta_slow))))


def yarn_magnitude(yarn: Yarn) -> float:
    """cos and sin × this: mscale(s)·rope.scaling.attn_factor, s = 1 / freq_scale, mscale(s) =
    1 + 0.1·ln s for s > 1, else 1. (llama.cpp's context sets attn_factor = mscale(s) / (1 + 0.1·ln s)
    · rope.scaling.attn_factor, and ggml's rope multiplies that by 1 + 0.1·ln s again.)"""
    s = 1.0 / yarn.freq_scale
    return (1.0 + 0.1 * math.log(s) if s > 1.0 else 1.0) * yarn.attn_factor


@dataclass(frozen=True)
class Family:
    """The parts of a block that differ from Llama's (defaults: Llama's)."""

    ffn_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    post_norms: bool = False  # post_attention_norm / post_ffw_norm before each residual add
    embed_scale: float = 1.0  # the embedding's rows × this before block 0
    attn_scale: float = 0.0  # q·k scale; 0: 1/sqrt(head size)
    sliding_window: int = 0  # positions a windowed layer's query sees (itself included); 0: none
    swa_layers: tuple[bool, ...] = ()  # per block: windowed
    rope_base_swa: float = 0.0  # RoPE base of windowed layers (scale 1)
    logit_softcap: float = 0.0  # c: logits = c·tanh(logits / c); 0: none
    n_experts: int = 0  # E: experts per block (0: a dense FFN)
    n_experts_used: int = 0  # k: experts each token goes through
    experts_renorm: bool = False  # the k weights divided by their sum
    experts_scale: float = 0.0  # the k weights × this (0 or 1: unscaled)
    shared_expert: bool = False  # qwen2moe's gated shared expert
    ffn_norm: str = "ffn_norm.weight"  # the FFN's input RMSNorm (gpt-oss: post_attention_norm.weight)
    swa_rope_scaled: bool = False  # windowed layers take the file's RoPE scaling too (else scale 1)
    yarn: Yarn | None = None  # YaRN RoPE scaling of every layer
    attn_out_bias: bool = False  # attn_output.bias added after the output projection
    attn_sinks: bool = False  # attn_sinks.weight [heads]: an extra softmax logit per head, no value
    experts_gating: str = "softmax"  # "softmax": over all E, then top-k; "softmax_weight": top-k of
    #                                  the raw logits, softmax over those k
    expert_biases: bool = False  # ffn_gate_inp.bias, ffn_{gate,up,down}_exps.bias [E, rows]

    def windowed(self, block: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[block]


def family_of(path: str, arch: str, hp, n_blocks: int, hidden: int, n_heads: int, head_dim: int) -> Family:
    """The family's parts for `arch` (Llama's for llama/qwen2/qwen3)."""
    if arch == GPT_OSS:
        return _gpt_oss(path, hp, n_blocks)
    experts = int(hp("expert_count", 0))
    if experts:
        used = int(hp("expert_used_count", 0))
        if arch not in MOE_ARCHITECTURES:
            raise BadInput(f"GGUF {path}: {arch} with {experts} experts (MoE) is not served; Kafila serves "
                           f"experts in {', '.join(MOE_ARCHITECTURES)}")
        if not 0 < used <= experts:
            raise BadInput(f"GGUF {path}: {arch}.expert_used_count {used} is not in 1..{experts}")
        # llama.cpp reads no expert_weights_scale for these architectures (a file's key is ignored)
        return Family(n_experts=experts, n_experts_used=used, experts_renorm=arch != "qwen2moe",
                      shared_expert=arch in SHARED_EXPERT_ARCHITECTURES)
    if arch in ("qwen3moe", "qwen2moe"):
        raise BadInput(f"GGUF {path}: {arch} without {arch}.expert_count")
    if arch != "gemma3":
        return Family()
    window = int(hp("attention.sliding_window", 0))
    swa = _swa_layers(path, arch, hp, n_blocks, GEMMA3_DEFAULT_SWA_PERIOD) if window > 0 else ()
    scale = hidden / n_heads if n_blocks == GEMMA3_27B_BLOCKS else head_dim
    return Family(
        ffn_act="gelu_tanh",
        post_norms=True,
        embed_scale=math.sqrt(hidden),
        attn_scale=1.0 / math.sqrt(float(int(scale))),
        sliding_window=window,
        swa_layers=swa,
        rope_base_swa=float(hp("rope.freq_base_swa", GEMMA3_SWA_ROPE_BASE)),
        logit_softcap=float(hp("final_logit_softcapping", 0.0)),
    )


def _swa_layers(path: str, arch: str, hp, n_blocks: int, default_period: int) -> tuple[bool, ...]:
    """Which blocks are windowed, as llama.cpp's load_swa_pattern reads it: a bool per block, or a
    period P (layer l windowed unless l % P = P − 1; P = 0: every layer)."""
    pattern = hp("attention.sliding_window_pattern", default_period)
    if isinstance(pattern, list):
        if len(pattern) != n_blocks:
            raise BadInput(f"GGUF {path}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                           f"entries for {n_blocks} blocks")
        return tuple(bool(x) for x in pattern)
    period = int(pattern)
    return tuple(period == 0 or b % period < period - 1 for b in range(n_blocks))


def _gpt_oss(path: str, hp, n_blocks: int) -> Family:
    """gpt-oss's parts (module docstring), each key read as llama.cpp reads it; the keys llama.cpp
    requires are required here too (hp raises BadInput naming the missing one)."""
    experts, used = int(hp("expert_count")), int(hp("expert_used_count"))
    if not 0 < used <= experts:
        raise BadInput(f"GGUF {path}: {GPT_OSS}.expert_used_count {used} is not in 1..{experts}")
    hp("expert_feed_forward_length")  # llama.cpp refuses the file without it (the tensors give F)
    window = int(hp("attention.sliding_window"))
    if window < 1:
        raise BadInput(f"GGUF {path}: {GPT_OSS}.attention.sliding_window {window} is not positive")
    swa = _swa_layers(path, GPT_OSS, hp, n_blocks, GPT_OSS_DEFAULT_SWA_PERIOD)
    if not any(swa):  # llama.cpp's windowed KV cache asserts one (is_swa_any)
        raise BadInput(f"GGUF {path}: {GPT_OSS}.attention.sliding_window_pattern leaves no windowed layer")
    yarn = None
    if str(hp("rope.scaling.type", "linear")) == "yarn":
        factor = float(hp("rope.scaling.factor", 0.0)) or float(hp("rope.scale_linear", 0.0))
        yarn = Yarn(freq_scale=1.0 / factor if factor else 1.0,
                    n_ctx_orig=int(hp("rope.scaling.original_context_length", hp("context_length"))),
                    attn_factor=float(hp("rope.scaling.attn_factor", 1.0)))  # fmt: skip
    return Family(
        ffn_act="swiglu_oai",
        sliding_window=window,
        swa_layers=swa,
        rope_base_swa=float(hp("rope.freq_base_swa", hp("rope.freq_base", 10000.0))),
        n_experts=experts,
        n_experts_used=used,
        ffn_norm="post_attention_norm.weight",
        swa_rope_scaled=True,
        yarn=yarn,
        attn_out_bias=True,
        attn_sinks=True,
        experts_gating="softmax_weight",
        expert_biases=True,
    )


def ffn_tensors(arch: str, family: Family) -> tuple[str, ...]:
    """The block tensors a family has besides attention's projections and attn_norm: the FFN's
    input norm, the FFN's and the family's own (all required)."""
    norm = (family.ffn_norm,)
    if arch == GPT_OSS:
        return norm + MOE_TENSORS + GPT_OSS_TENSORS
    if family.n_experts:
        return norm + MOE_TENSORS + (SHARED_EXPERT_TENSORS if family.shared_expert else ())
    return norm + DENSE_FFN_TENSORS + (GEMMA3_BLOCK_TENSORS if arch == "gemma3" else ())


def require_llama_blocks(h, backend: str, experts: bool = False, gemma: bool = False, gpt_oss: bool = False,
                         biases: bool = False, scales: bool = False, gemma4: bool = False) -> None:
    """BadInput unless the model's blocks are Llama's (llama, qwen2, qwen3), or with `experts`
    also Llama's with a softmax-gated mixture of experts (qwen3moe, qwen2moe, Mixtral's layout):
    the backends that have not learnt the families' parts refuse them rather than compute them wrong."""
    f = h.family
    if (gemma and h.arch == "gemma3") or (gpt_oss and h.arch == GPT_OSS) or (gemma4 and h.arch == "gemma4"):
        f = Family()  # the backend computes their parts (MLX)
    if experts and f.n_experts and f.experts_gating == "softmax" and not f.expert_biases:
        f = dataclasses.replace(f, n_experts=0, n_experts_used=0, experts_renorm=False, experts_scale=0.0,
                                shared_expert=False)  # fmt: skip
    if f != Family():
        kind = f"{h.arch} with {h.family.n_experts} experts" if h.family.n_experts else h.arch
        serves = ("dense llama, qwen2, qwen3" + (", gemma3" if gemma else "") + (", gemma4" if gemma4 else "")
                  + (", gpt-oss" if gpt_oss else "")
                  + (", qwen3moe, qwen2moe and Mixtral-layout llama" if experts else ""))  # fmt: skip
        raise BadInput(f"backend {backend} does not serve {kind} (it serves {serves}); use --backend openvino")
    # `biases`, `scales`: the backend applies them
    extras = [n for n in h.extras if not (biases and n.endswith(".bias")) and not (scales and n.endswith(".scale"))]
    if extras:
        raise BadInput(f"backend {backend} does not apply tensor {extras[0]} ({len(extras)} output scales or "
                       f"biases in all; backends/gguf/optional.py); use --backend openvino")
