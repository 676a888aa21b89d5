"""Where the CPU plugin's decode time goes on K-quant weights: one matrix, then a whole model, by config.

    .venv/bin/python -m bench.ov_kernels [--rows 14336] [--cols 4096] [--model GGUF] [--tokens 24] [--context 30]

1. One Q4_K-shaped matrix-vector product (u4 codes, a scale and an offset per 32 weights, random
   values), compiled alone, in exact forms (backends/openvino/weights.py):
   - `zero point`: (Convert(q) − z)·s with an f32 zero point z = −offset / scale, which the plugin
     folds into one compressed FullyConnected (Kafila's form for small matrices);
   - `split`: Convert(q)·s as a compressed FullyConnected without a zero point, plus the offsets
     times each group's sum of x (a matrix 1/32 the size): the same product, summed in another order;
     `split i4` the same with signed codes q − 8 and offsets o + 8s (Kafila's form for large
     matrices), `split f16` with f16 scales (not exact).
   - `integer zero point` (`--kquant fast`): the zero point z rounded to a u8 constant (not exact:
     each weight off by up to s/2), `… f16` with f16 scales (openvino_genai's and the GGUF frontend's).
   Weights are centred like a trained model's (offset ≈ −7.5 scales), so the u4 split form's two
   products nearly cancel. A matrix that fits the CPU's last-level cache (the 1B shape's do on a
   large-cache EPYC) times the kernels, not memory: `--model` is the whole-model answer.
   Each at `serving` (the plugin's defaults: bf16 where the CPU has it, dynamic quantization of
   activations in groups of 32) and `f32`; median ms of 40 calls after 5, the GB/s that is over
   the matrix's bytes, and the error against float64 (x is N(0.3, 1): activations are rarely
   centred, and at bf16 the split form rounds each group's sum of x, which then grows with the mean).
2. `--model GGUF`: Kafila's 1-stage chain on that file under several plugin configs (serving,
   dynamic quantization off, groups of 128, f32 inference) and with the offset types' matrices in
   the zero point form however large they are (`zero point form`: what Kafila built before the
   split form) or in the split form however small (`split form`), decode tok/s of `--tokens`
   greedy tokens: every chain is built first, then `--rounds` rounds run each once in turn, so
   load from elsewhere falls on all alike (`--configs` picks some: an 8B-shape chain holds ~7 GB).
   `--context N`: the prompt's length (default 30); `u8 KV cache` is the plugin's own default KV
   type, where serving keeps an f16 cache (backends/openvino/shard.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

PLUGIN_CONFIGS = {
    "serving": {},
    "zero point form": {},  # serving, with weights.SPLIT_MIN_WEIGHTS out of reach
    "split form": {},  # serving, with every offset-type matrix in the split form
    "dynamic quantization off": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"},
    "dynamic quantization 128": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "128"},
    "f32 inference": {"INFERENCE_PRECISION_HINT": "f32"},
    "u8 KV cache": {"KV_CACHE_PRECISION": "u8"},  # the plugin's default; serving keeps f16 (shard.py)
}
GROUP = 32


def _matrix_model(form: str, q: np.ndarray, s: np.ndarray, o: np.ndarray, keep: list):
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino.weights import pack_u4

    rows, groups, _ = q.shape
    cols = groups * GROUP
    f32 = ov.Type.f32
    x = ops.parameter([1, 1, cols], f32)
    signed = form == "split i4"
    codes = np.ascontiguousarray(pack_u4(q ^ 8 if signed else q))  # i4 q − 8: the nibble with its top bit flipped
    keep.append(codes)
    w = ops.convert(ov.op.Constant(ov.Tensor(codes, ov.Shape(list(q.shape)), ov.Type.i4 if signed else ov.Type.u4)), f32)
    flat = ops.constant(np.array([rows, cols], np.int64))
    if form == "zero point":  # w = (q − z)·s, z = −o/s
        w = ops.reshape(ops.multiply(ops.subtract(w, ops.constant(-o / s)), ops.constant(s)), flat, False)
        y = ops.matmul(x, w, False, True)
    elif form.startswith("integer zero point"):  # --kquant fast: w = (q − round(z))·s, z a u8 constant
        z = ops.convert(ops.constant(np.clip(np.rint(-o / s), 0, 255).astype(np.uint8)), f32)
        scale = ops.constant(s) if not form.endswith("f16") else ops.convert(ops.constant(s.astype(np.float16)), f32)
        w = ops.reshape(ops.multiply(ops.subtract(w, z), scale), flat, False)
        y = ops.matmul(x, w, False, True)
    else:  # w·x = (q·s)·x + o·(group sums of x); i4: ((q − 8)·s)·x + (o + 8s)·(group sums)
        scale = ops.constant(s) if form != "split f16" else ops.convert(ops.constant(s.astype(np.float16)), f32)
        w = ops.reshape(ops.multiply(w, scale), flat, False)
        sums = ops.reduce_sum(ops.reshape(x, ops.constant(np.array([1, 1, groups, GROUP], np.int64)), False),
                              ops.constant(np.array([3], np.int64)), False)  # fmt: skip
        off = (o + 8 * s) if signed else o
        y = ops.add(ops.matmul(x, w, False, True), ops.matmul(sums, ops.constant(off[..., 0]), False, True))
    return ov.Model([y], [x])


def matrix(rows: int, cols: int, calls: int = 40) -> list[dict]:
    from backends.openvino.shard import CONFIGS as PRECISIONS
    from backends.openvino.shard import core

    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (rows, cols // GROUP, GROUP), dtype=np.uint8)
    s = (rng.random((rows, cols // GROUP, 1), dtype=np.float32) + 0.5) * 0.01
    # a trained Q4_K group is centred: its offset −dmin·m is about −7.5 scales, w = s·q + o in ±7.5 s
    o = -s * rng.uniform(6.0, 9.0, s.shape).astype(np.float32)
    x = (rng.standard_normal((1, 1, cols)) + 0.3).astype(np.float32)  # activations are rarely centred
    exact = (q.astype(np.float64) * s + o).reshape(rows, cols) @ x[0, 0].astype(np.float64)
    out = []
    for form in ("zero point", "split", "split i4", "split f16", "integer zero point", "integer zero point f16"):
        mb = (q.size / 2 + s.nbytes // (2 if form == "split f16" else 1) + o.nbytes) / 1e6
        for precision in ("serving", "f32"):
            keep: list = []
            req = core().compile_model(_matrix_model(form, q, s, o, keep), "CPU", PRECISIONS[precision]).create_infer_request()
            times = []
            for i in range(calls + 5):
                t = time.perf_counter()
                req.infer({0: x})
                times.append(time.perf_counter() - t)
            y = req.get_output_tensor(0).data.reshape(-1)
            ms = statistics.median(times[5:]) * 1000
            err = np.abs(y - exact)
            out.append({"form": form, "precision": precision, "ms": ms, "GB_s": mb / ms,
                        "max_rel_err": float(err.max() / np.abs(exact).max()),
                        "mean_abs_err": float(err.mean()), "mean_abs_out": float(np.abs(exact).mean())})  # fmt: skip
    return out


def model(path: str, tokens: int, configs: list[str], rounds: int = 3, context: int = 30) -> list[dict]:
    import backends.openvino.shard as shard_mod
    from backends.openvino import weights
    from kafila.engine.chain import LocalChain

    serving, split_min = dict(shard_mod.CONFIGS["serving"]), weights.SPLIT_MIN_WEIGHTS
    chains = {}
    try:
        for name in configs:
            shard_mod.CONFIGS["serving"] = {**serving, **PLUGIN_CONFIGS[name]}
            weights.SPLIT_MIN_WEIGHTS = {"zero point form": 1 << 62, "split form": 0}.get(name, split_min)
            chains[name] = LocalChain.build(path, 1)
    finally:
        shard_mod.CONFIGS["serving"], weights.SPLIT_MIN_WEIGHTS = serving, split_min
    rates: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, chain in chains.items():
            times = [time.perf_counter() for _ in chain.generate(list(range(1000, 1000 + context)), tokens)]
            rates[name].append((len(times) - 1) / (times[-1] - times[0]))
    return [{"config": name, "plugin": PLUGIN_CONFIGS[name], "tok_s": rates[name]} for name in configs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=14336, help="the matrix's rows (default: Llama-3-8B's FFN)")
    ap.add_argument("--cols", type=int, default=4096, help="its columns, a multiple of 32 (default: hidden 4096)")
    ap.add_argument("--model", help="also time Kafila's 1-stage chain on this GGUF under each config")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--context", type=int, default=30, help="the --model rows' prompt length (positions)")
    ap.add_argument("--configs", default=",".join(PLUGIN_CONFIGS), help=f"some of: {', '.join(PLUGIN_CONFIGS)}")
    ap.add_argument("--skip-matrix", action="store_true", help="only the --model rows")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from bench.llamacpp_speed import machine

    if not 1 <= a.context <= 4096:
        ap.error("--context: 1..4096 prompt positions")
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    if unknown := [c for c in configs if c not in PLUGIN_CONFIGS]:
        ap.error(f"--configs: unknown {', '.join(unknown)} (choose from {', '.join(PLUGIN_CONFIGS)})")
    res = {"machine": machine(), "matrix": [] if a.skip_matrix else matrix(a.rows, a.cols)}
    if a.model:
        res["model"] = model(a.model, a.tokens, configs, a.rounds, a.context)
    if a.json:
        print(json.dumps(res))
        return 0
    print(res["machine"])
    if res["matrix"]:
        print(f"one {a.rows} × {a.cols} Q4_K-shaped matrix × vector:")
    for r in res["matrix"]:
        print(f"  {r['form']:10s} {r['precision']:8s} {r['ms']:6.2f} ms  {r['GB_s']:5.1f} GB/s  "
              f"max error {r['max_rel_err']:.1e} of the largest output, mean error {r['mean_abs_err']:.3f} "
              f"(outputs {r['mean_abs_out']:.1f})")  # fmt: skip
    for r in res.get("model", []):
        print(f"  model, {r['config']:26s} tok/s {', '.join(f'{x:.2f}' for x in r['tok_s'])}"
              f"  (median {statistics.median(r['tok_s']):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
