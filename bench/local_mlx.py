"""MLX rows of the local benchmark: our MLX chains against a monolithic MLX peer and openvino_genai.

All on the same GGUF, same chat prompt, greedy, NEW_TOKENS new tokens with EOS ignored,
WARMUPS warm-ups each, then REPEATS rounds in which every row runs once in turn (A B C A B C …);
each row's tok/s is the median over rounds, its ratio to the mlx-lm peer the median over rounds
of row / peer in the same round (as bench/local.py), with the spread (min–max) of those ratios,
so load from elsewhere falls on both sides of every ratio alike.
tok/s is decode throughput: the tokens after the first over the time from the first token to
the last (prefill excluded, for every row).

- mlx-lm peer: mlx-lm's own `llama.Model` holding the same weights (nn.quantize to 4-bit group 32,
  8-bit embedding, GGUF tensors loaded as they come from `mx.load`), driven by
  `mlx_lm.generate.generate_step` (one graph per token, asynchronous evaluation).
- kafila MLX k-stage: MLXShard chains at "serving" precision (the file's f16 scales, as the
  peer), one forward per stage per token and the head's greedy top-1.
- openvino_genai: LLMPipeline(gguf, "CPU") with its defaults.

Run: `.venv/bin/python -m bench.local_mlx` (ratios to the mlx-lm peer); bench/local.py adds the
mlx-lm peer and MLX 1-stage rows through `extra_rows` (ratios there are to openvino_genai).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np

NEW_TOKENS = 128
WARMUPS = 2
REPEATS = 5
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
PEER = "mlx-lm monolithic"
GGUF_TO_MLX_LM = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}  # fmt: skip


def decode_tok_s(stamps: list[float]) -> float:
    """Tokens after the first over the time from the first to the last."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def interleaved_medians(
    runs: dict[str, Callable[[], list[float]]], warmups: int, repeats: int
) -> dict[str, list[float]]:
    """Warm every configuration up, then sample them in turn (A B C A B C …) so that load from
    elsewhere on the machine falls on all of them alike. Returns each one's tok/s samples."""
    for run in runs.values():
        for _ in range(warmups):
            run()
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            samples[name].append(decode_tok_s(run()))
    return samples


# --- the monolithic MLX peer -----------------------------------------------------------------


def mlx_lm_model(index):
    """mlx-lm's llama Model with the GGUF's weights (4-bit blocks, 8-bit embedding, group 32)."""
    import mlx.core as mx
    from mlx import nn
    from mlx_lm.models import llama

    h = index.hparams
    args = llama.ModelArgs(
        model_type="llama", hidden_size=h.hidden, num_hidden_layers=h.n_blocks,
        intermediate_size=h.ffn, num_attention_heads=h.n_heads, rms_norm_eps=h.rms_eps,
        vocab_size=h.vocab, head_dim=h.head_dim, num_key_value_heads=h.n_kv_heads,
        rope_theta=h.rope_base, rope_traditional=True,  # GGUF's q/k rows are permuted for it
        tie_word_embeddings=h.tied_embeddings, attention_bias=h.qkv_bias,
    )  # fmt: skip
    model = llama.Model(args)

    def bits(path, module):
        if not hasattr(module, "to_quantized"):
            return False
        return {"group_size": 32, "bits": 8} if path.endswith("embed_tokens") else True

    nn.quantize(model, group_size=32, bits=4, class_predicate=bits)
    weights = []
    for key, value in mx.load(index.path).items():
        parts = key.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{GGUF_TO_MLX_LM[parts[2]]}.{parts[3]}"
        elif parts[0] == "token_embd":
            name = f"model.embed_tokens.{parts[1]}"
        elif parts[0] == "output_norm":
            name = f"model.norm.{parts[1]}"
        else:
            name = f"lm_head.{parts[1]}"
        weights.append((name, value))
    model.load_weights(weights, strict=True)
    mx.eval(model.parameters())
    return model


def run_mlx_lm(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    tokens, stamps = [], []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens):
        tokens.append(int(token))
        stamps.append(time.perf_counter())
    return tokens, stamps


# --- our chains --------------------------------------------------------------------------------


def run_chain(shards, prompt: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy decode through shards in ring order (the first is the head)."""
    head = shards[0]
    slots = [s.open_slot() for s in shards]
    tokens, stamps = [], []
    try:
        x = np.asarray(prompt, dtype=np.int64)
        cache_len = 0
        while len(tokens) < new_tokens:
            n = len(x)
            positions = np.arange(cache_len, cache_len + n, dtype=np.int64)
            mask = np.ones(cache_len + n, dtype=np.int64)
            for shard, slot in zip(shards, slots):
                x = shard.forward(slot, x, positions, mask)
            tokens.append(int(head.greedy(x)))
            stamps.append(time.perf_counter())
            cache_len += n
            x = np.array(tokens[-1:], dtype=np.int64)
    finally:
        for shard, slot in zip(shards, slots):
            shard.close_slot(slot)
    return tokens, stamps


def mlx_chain(index, stages: int, precision: str = "serving"):
    from backends import ShardSpec, load_shard

    shards = []
    for i, (first, last) in enumerate(even_cuts(index.hparams.n_blocks, stages)):
        spec = ShardSpec(index.path, first, last, embed=i == 0, head=i == 0)
        shards.append(load_shard("mlx", spec, precision, index=index))
    return shards


def even_cuts(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    edges = [round(i * n_blocks / stages) for i in range(stages + 1)]
    return list(itertools.pairwise(edges))


# --- openvino_genai ----------------------------------------------------------------------------


def genai_runner(index, prompt_text: str, new_tokens: int) -> Callable[[], list[float]]:
    import openvino_genai as ov_genai

    pipe = ov_genai.LLMPipeline(index.path, "CPU")
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = new_tokens
    config.min_new_tokens = new_tokens
    config.ignore_eos = True
    config.do_sample = False
    config.apply_chat_template = False  # the prompt is already rendered with the template

    def run() -> list[float]:
        result = pipe.generate([prompt_text], config)
        m = result.perf_metrics
        tpot_s = m.get_tpot().mean / 1e3  # mean time per output token after the first
        n = m.get_num_generated_tokens()
        return [i * tpot_s for i in range(n)]  # evenly spaced stamps: decode_tok_s = 1 / tpot

    return run


def extra_rows(index, prompt_text: str, prompt: list[int], new_tokens: int) -> list[tuple]:
    """The rows bench/local.py adds: (name, run → timestamps, tokens → ids) for the mlx-lm peer
    and our MLX 1-stage chain."""
    peer = mlx_lm_model(index)
    shards = mlx_chain(index, 1)
    return [
        (PEER, lambda: run_mlx_lm(peer, prompt, new_tokens)[1], lambda: run_mlx_lm(peer, prompt, new_tokens)[0]),
        ("kafila MLX 1-stage", lambda: run_chain(shards, prompt, new_tokens)[1],
         lambda: run_chain(shards, prompt, new_tokens)[0]),
    ]  # fmt: skip


# --- rows ----------------------------------------------------------------------------------------


def rows(
    model: str = "smollm2-135m",
    stages: tuple[int, ...] = (1,),
    new_tokens: int = NEW_TOKENS,
    warmups: int = WARMUPS,
    repeats: int = REPEATS,
    genai: bool = True,
) -> list[dict]:
    """One dict per configuration: name, tok_s (median), samples, ratio to the mlx-lm peer."""
    from backends.gguf import open_model
    from kafila.models import load_tokenizer, resolve_model

    index = open_model(resolve_model(model))
    tok = load_tokenizer(index)
    prompt_text = tok.render_chat([{"role": "user", "content": PROMPT}])
    prompt = tok.encode(prompt_text)

    peer = mlx_lm_model(index)
    runs: dict[str, Callable[[], list[float]]] = {
        PEER: lambda: run_mlx_lm(peer, prompt, new_tokens)[1]
    }
    same: dict[str, bool | None] = {PEER: True}
    peer_tokens, _ = run_mlx_lm(peer, prompt, new_tokens)
    for k in stages:
        shards = mlx_chain(index, k)
        name = f"kafila MLX {k}-stage"
        runs[name] = lambda s=shards: run_chain(s, prompt, new_tokens)[1]
        same[name] = run_chain(shards, prompt, new_tokens)[0] == peer_tokens
    if genai:
        runs["openvino_genai LLMPipeline"] = genai_runner(index, prompt_text, new_tokens)
        same["openvino_genai LLMPipeline"] = None

    samples = interleaved_medians(runs, warmups, repeats)
    out = [
        {"name": name, "tok_s": statistics.median(s), "samples": s, "same_tokens": same[name]}
        for name, s in samples.items()
    ]
    peer = samples[PEER]
    for row in out:
        ratios = [x / p for x, p in zip(row["samples"], peer, strict=True)]  # same round
        row["ratios_to_mlx_peer"] = ratios
        row["ratio_to_mlx_peer"] = statistics.median(ratios)
    return out


def table(result: list[dict]) -> str:
    n = len(result[0]["samples"])
    lines = [
        f"| configuration | tok/s (median of {n}) | × mlx-lm peer (median of per-round ratios) "
        "| per-round ratio min–max | same tokens as peer |",
        "|---|---:|---:|---:|---|",
    ]
    for r in result:
        same = {True: "yes", False: "no", None: "n/a"}[r["same_tokens"]]
        ratios = r["ratios_to_mlx_peer"]
        lines.append(
            f"| {r['name']} | {r['tok_s']:.2f} | {r['ratio_to_mlx_peer']:.2f} "
            f"| {min(ratios):.2f}–{max(ratios):.2f} | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--stages", default="1", help="MLX chain lengths, comma separated")
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--warmups", type=int, default=WARMUPS, help="warm-ups per row")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="rounds (every row once each)")
    parser.add_argument("--no-genai", action="store_true")
    args = parser.parse_args(argv)
    stages = tuple(int(s) for s in args.stages.split(","))
    result = rows(
        args.model, stages, args.tokens, args.warmups, args.repeats, genai=not args.no_genai
    )
    print(table(result))
    print("samples (tok/s):", {r["name"]: [round(s, 2) for s in r["samples"]] for r in result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
