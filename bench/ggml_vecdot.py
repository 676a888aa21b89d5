"""How fast ggml's own K-quant kernels run one matrix of a real file, outside llama.cpp: the inner
loop a compiled OpenVINO op (issue 36 item 3) would run, measured before building it.

    .venv/bin/python -m bench.ggml_vecdot [--file qwen1.5b|PATH] [--tensor blk.0.ffn_gate.weight,blk.0.ffn_down.weight]

The kernels are llama-cpp-python's installed `libggml-cpu.so` (the wheel, built on install, ships
no headers); the headers are the same release's (`ggml/include/ggml.h`, `ggml-cpu.h` from the
llama-cpp-python sdist the suite already caches: tests/llamacpp_files.py). A 20-line C program,
compiled here with the system C compiler, quantizes a vector with the vec_dot type's `from_float`
(Q8_K for Q4_K/Q5_K/Q6_K) and runs `ggml_get_type_traits_cpu(type)->vec_dot` over every row of the
tensor's own blocks, on one thread, best of 20; its answer is compared with the exact f64 product
(the distance is llama.cpp's Q8_K activation rounding). Beside it: Kafila's exact and fast forms
of the same matrix compiled alone by the CPU plugin (f32, one thread), best of 20.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

from bench.kquant_speed import commit, gguf_path
from bench.llamacpp_speed import machine

GGML_TYPES = {"Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "Q4_0": 2}
PROBE_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include "ggml.h"
#include "ggml-cpu.h"
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {  /* weights.bin type rows cols x.bin y.bin */
    int type = atoi(argv[2]); long rows = atol(argv[3]), cols = atol(argv[4]);
    size_t rb = ggml_row_size(type, cols);
    char *w = malloc(rb * rows); float *x = malloc(cols * 4), *y = malloc(rows * 4);
    FILE *f = fopen(argv[1], "rb"); if (fread(w, 1, rb * rows, f) != rb * rows) return 2; fclose(f);
    f = fopen(argv[5], "rb"); if (fread(x, 4, cols, f) != (size_t)cols) return 2; fclose(f);
    ggml_cpu_init();
    const struct ggml_type_traits_cpu *tr = ggml_get_type_traits_cpu(type);
    const struct ggml_type_traits_cpu *act = ggml_get_type_traits_cpu(tr->vec_dot_type);
    void *qx = malloc(ggml_row_size(tr->vec_dot_type, cols));
    double best = 1e9;
    for (int it = 0; it < 20; it++) {
        double t = now();
        act->from_float(x, qx, cols);
        for (long r = 0; r < rows; r++) tr->vec_dot(cols, y + r, 0, w + r * rb, 0, qx, 0, 1);
        t = now() - t; if (t < best) best = t;
    }
    f = fopen(argv[6], "wb"); fwrite(y, 4, rows, f); fclose(f);
    printf("%.6f\n", best * 1e3);
    return 0;
}
"""


def ggml_headers(work: str) -> str:
    """ggml/include of the llama-cpp-python sdist pinned by the suite (downloaded once)."""
    from tests.llamacpp_files import _sdist, cache_root

    with tarfile.open(_sdist(cache_root())) as tar:
        for m in tar.getmembers():
            inner = m.name.partition("/")[2]
            if inner.startswith("vendor/llama.cpp/ggml/include/") and m.isfile():
                m.name = os.path.basename(inner)
                tar.extract(m, os.path.join(work, "include"))
    return os.path.join(work, "include")


def build_probe(work: str) -> str:
    import llama_cpp

    lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    src, exe = os.path.join(work, "probe.c"), os.path.join(work, "probe")
    with open(src, "w") as f:
        f.write(PROBE_C)
    subprocess.run(["cc", "-O2", "-I", ggml_headers(work), src, "-L", lib, "-lggml-cpu", "-lggml-base",
                    f"-Wl,-rpath,{lib}", "-o", exe], check=True)  # fmt: skip
    return exe


def openvino_ms(index, name: str, x: np.ndarray, kquant: str) -> float:
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino.shard import F32_CONFIG, core
    from backends.openvino.weights import WeightBank

    bank = WeightBank(index, kquant=kquant)
    x_in = ops.parameter([1, x.size], ov.Type.f32)
    model = ov.Model([ops.result(bank.project(x_in.output(0), [(name, 0)])[0])], [x_in])
    req = core().compile_model(model, "CPU", {**F32_CONFIG, "INFERENCE_NUM_THREADS": "1"}).create_infer_request()
    times = []
    for _ in range(25):
        t = time.perf_counter()
        req.infer({0: x[None]})
        times.append(time.perf_counter() - t)
    return float(min(times[5:]) * 1e3)  # best, as the ggml column: the least disturbed by other load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.ggml_vecdot", description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="qwen1.5b")
    ap.add_argument("--tensor", default="blk.0.ffn_gate.weight,blk.0.ffn_down.weight")
    args = ap.parse_args(argv)
    from backends.gguf import open_model
    from kafila.cli import import_openvino_without_telemetry

    import_openvino_without_telemetry()
    index = open_model(gguf_path(args.file))
    print(machine())
    print(f"commit: {commit()}; file {os.path.basename(index.path)}; one thread each")
    print("\n| tensor | type | rows × cols | ggml vec_dot ms (best of 20) | error vs exact | OpenVINO exact ms (best of 20) | OpenVINO fast ms |")
    print("|---|---|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="kafila-ggml-") as work:
        try:
            exe = build_probe(work)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"no C compiler or ggml headers here ({exc}): nothing measured", file=sys.stderr)
            return 3
        for name in args.tensor.split(","):
            t = index.tensors[name]
            if t.qtype not in GGML_TYPES:
                print(f"| {name} | {t.qtype} | — | not one of {', '.join(GGML_TYPES)} | | | |")
                continue
            rows, cols = t.shape
            x = np.random.default_rng(0).normal(0.1, 1, cols).astype(np.float32)
            paths = [os.path.join(work, n) for n in ("w.bin", "x.bin", "y.bin")]
            np.asarray(index.raw(name)).tofile(paths[0])
            x.tofile(paths[1])
            out = subprocess.run([exe, paths[0], str(GGML_TYPES[t.qtype]), str(rows), str(cols), paths[1], paths[2]],
                                 check=True, capture_output=True, text=True)  # fmt: skip
            y = np.fromfile(paths[2], np.float32)
            exact = index.dequantize(name, np.float64) @ x.astype(np.float64)
            err = np.abs(y - exact).max() / np.abs(exact).max()
            ov_ms = {k: openvino_ms(index, name, x, k) for k in ("exact", "fast")}
            print(f"| {name} | {t.qtype} | {rows} × {cols} | {float(out.stdout):.3f} | {err:.1e} | "
                  f"{ov_ms['exact']:.3f} | {ov_ms['fast']:.3f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
