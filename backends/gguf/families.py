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
weights renormalised to sum 1 for qwen3moe and llama (not qwen2moe), × expert_weights_scale when
set; qwen2moe adds a shared expert (ffn_{gate,up,down}_shexp) gated by sigmoid(ffn_gate_inp_shexp · x).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backends.errors import BadInput

GEMMA3_BLOCK_TENSORS = ("post_attention_norm.weight", "post_ffw_norm.weight")
GEMMA3_DEFAULT_SWA_PERIOD = 6
GEMMA3_SWA_ROPE_BASE = 10000.0  # llama_hparams.rope_freq_base_train_swa's default
GEMMA3_27B_BLOCKS = 62
MOE_ARCHITECTURES = ("qwen3moe", "qwen2moe", "llama")
DENSE_FFN_TENSORS = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
MOE_TENSORS = ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
SHARED_EXPERT_TENSORS = ("ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                         "ffn_down_shexp.weight")  # fmt: skip


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

    def windowed(self, block: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[block]


def family_of(path: str, arch: str, hp, n_blocks: int, hidden: int, n_heads: int, head_dim: int) -> Family:
    """The family's parts for `arch` (Llama's for llama/qwen2/qwen3)."""
    experts = int(hp("expert_count", 0))
    if experts:
        used = int(hp("expert_used_count", 0))
        if arch not in MOE_ARCHITECTURES:
            raise BadInput(f"GGUF {path}: {arch} with {experts} experts (MoE) is not served; Kafila serves "
                           f"experts in {', '.join(MOE_ARCHITECTURES)}")
        if not 0 < used <= experts:
            raise BadInput(f"GGUF {path}: {arch}.expert_used_count {used} is not in 1..{experts}")
        return Family(n_experts=experts, n_experts_used=used, experts_renorm=arch != "qwen2moe",
                      experts_scale=float(hp("expert_weights_scale", 0.0)), shared_expert=arch == "qwen2moe")
    if arch in ("qwen3moe", "qwen2moe"):
        raise BadInput(f"GGUF {path}: {arch} without {arch}.expert_count")
    if arch != "gemma3":
        return Family()
    window = int(hp("attention.sliding_window", 0))
    swa: tuple[bool, ...] = ()
    if window > 0:
        pattern = hp("attention.sliding_window_pattern", GEMMA3_DEFAULT_SWA_PERIOD)
        if isinstance(pattern, list):
            if len(pattern) != n_blocks:
                raise BadInput(f"GGUF {path}: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                               f"entries for {n_blocks} blocks")
            swa = tuple(bool(x) for x in pattern)
        else:
            period = int(pattern)
            swa = tuple(period == 0 or b % period < period - 1 for b in range(n_blocks))
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


def ffn_tensors(arch: str, family: Family) -> tuple[str, ...]:
    """The block tensors a family has besides attention's and the two norms (all required)."""
    if family.n_experts:
        return MOE_TENSORS + (SHARED_EXPERT_TENSORS if family.shared_expert else ())
    return DENSE_FFN_TENSORS + (GEMMA3_BLOCK_TENSORS if arch == "gemma3" else ())


def require_llama_blocks(h, backend: str) -> None:
    """BadInput unless the model's blocks are Llama's (llama, qwen2, qwen3 without experts): the
    backends that have not learnt the families' parts refuse them rather than compute them wrong."""
    if h.family != Family():
        kind = f"{h.arch} with {h.family.n_experts} experts" if h.family.n_experts else h.arch
        raise BadInput(f"backend {backend} does not serve {kind} (it serves dense llama, qwen2, qwen3); "
                       "use --backend openvino")
