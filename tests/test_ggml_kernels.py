"""`--kquant ggml`: quantized matrices computed by ggml's own CPU kernels inside the OpenVINO stage
(backends/openvino/ggml_kernels.py, the GgmlMatMul op); `auto` takes it at serving precision where
it builds.

The yardstick is llama.cpp itself on the same quantized file: with the same functions of the same
library (llama-cpp-python's libggml-cpu), the logits llama.cpp gives for a token equal Kafila's to
float rounding wherever the rest of the graph is the same arithmetic (the first two positions: no
softmax over three or more keys yet). Beyond that, llama.cpp's activation rounding (Q8_K) turns
1e-7 differences in attention into different roundings, as it does between llama.cpp's own builds.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import DEFAULT_KQUANT, KQUANTS, ShardSpec, status
from backends.gguf import open_model
from tests.synthetic_gguf import write_llama_gguf
from tests.test_kquants import SMALL, random_raw
from tests.test_llamacpp_arch import kafila_greedy, needs_llamacpp
from tests.test_run_cli import assert_bad_input, kafila

needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)


def _ggml_available() -> str:
    if not status("openvino").available:
        return status("openvino").reason
    from backends.openvino import ggml_kernels

    return ggml_kernels.available()[1]


needs_ggml = pytest.mark.skipif(bool(_ggml_available()), reason=_ggml_available() or "available")


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """A Q4_K_M file quantized by llama.cpp's own quantizer (Q4_K, Q6_K, Q5_K... as it chooses)."""
    from tests.llamacpp_ref import quantize

    root = tmp_path_factory.mktemp("ggml")
    src = write_llama_gguf(root / "f32.gguf", blocks=3, hidden=256, heads=4, kv_heads=2, ffn=512,
                           qtype="F32", embed_qtype="F32", tied=False, seed=5)  # fmt: skip
    return quantize(src, str(root / "q4km.gguf"), "Q4_K_M")


def _op(qtype: str, raw: np.ndarray, rows: int, cols: int, x: np.ndarray, repack: bool = False) -> np.ndarray:
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino import ggml_kernels
    from backends.openvino.shard import SERVING_CONFIG, core

    keep: list = []
    x_in = ops.parameter([-1, cols], ov.Type.f32)
    y = ggml_kernels.matmul(x_in.output(0), raw.copy(), qtype, rows, cols, keep, repack=repack)
    compiled = core().compile_model(ov.Model([ops.result(y)], [x_in]), "CPU", SERVING_CONFIG)
    return compiled.create_infer_request().infer({0: x})[0].copy()


def ggml_reference(qtype: str, raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """x @ Wᵀ as llama.cpp's CPU mul_mat computes it, called straight from its libggml-cpu
    (ctypes): each row of x through the vec_dot type's from_float, then vec_dot per weight row."""
    import ctypes as C

    import llama_cpp  # noqa: F401  (loads libggml-base and libggml-cpu)

    from backends.openvino.ggml_kernels import _ggml_lib, type_id

    lib_dir = _ggml_lib()[0]
    cpu, base = C.CDLL(str(lib_dir / "libggml-cpu.so")), C.CDLL(str(lib_dir / "libggml-base.so"))

    class Traits(C.Structure):
        _fields_ = [("from_float", C.c_void_p), ("vec_dot", C.c_void_p), ("vec_dot_type", C.c_int), ("nrows", C.c_int64)]

    cpu.ggml_get_type_traits_cpu.restype = C.POINTER(Traits)
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = C.c_size_t, [C.c_int, C.c_int64]
    cpu.ggml_cpu_init()
    w = cpu.ggml_get_type_traits_cpu(type_id(qtype)).contents
    act = cpu.ggml_get_type_traits_cpu(w.vec_dot_type).contents
    from_float = C.CFUNCTYPE(None, C.POINTER(C.c_float), C.c_void_p, C.c_int64)(act.from_float)
    vec_dot = C.CFUNCTYPE(None, C.c_int, C.POINTER(C.c_float), C.c_size_t, C.c_void_p, C.c_size_t,
                          C.c_void_p, C.c_size_t, C.c_int)(w.vec_dot)  # fmt: skip
    raw = np.ascontiguousarray(raw, np.uint8).reshape(rows, -1)
    q = np.zeros(base.ggml_row_size(w.vec_dot_type, cols), np.uint8)
    y = np.zeros((len(x), rows), np.float32)
    for i, row in enumerate(np.ascontiguousarray(x, np.float32)):
        from_float(row.ctypes.data_as(C.POINTER(C.c_float)), q.ctypes.data, cols)
        for r in range(rows):
            out = y[i, r:].ctypes.data_as(C.POINTER(C.c_float))
            vec_dot(cols, out, 0, raw[r].ctypes.data, 0, q.ctypes.data, 0, 1)
    return y


def _ggml_graph(build, outputs: int, out_shape: tuple[int, int], nbytes: int) -> np.ndarray:
    """Runs `build(lib, ctx, tensor)` (which adds nodes through libggml's public API and returns
    the last) as llama.cpp's CPU backend computes a graph on plain (not repacked) weights; returns
    that node's values [out_shape]. `tensor(type, cols, rows, array, planes=0)` makes a tensor
    [planes,] rows × cols holding array."""
    import ctypes as C

    import llama_cpp  # noqa: F401  (loads libggml-base and libggml-cpu)

    from backends.openvino.ggml_kernels import _ggml_lib

    lib_dir = _ggml_lib()[0]
    cpu, base = C.CDLL(str(lib_dir / "libggml-cpu.so")), C.CDLL(str(lib_dir / "libggml-base.so"))

    class InitParams(C.Structure):
        _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", C.c_void_p), ("no_alloc", C.c_bool)]

    base.ggml_init.restype, base.ggml_init.argtypes = C.c_void_p, [InitParams]
    base.ggml_new_tensor_2d.restype = C.c_void_p
    base.ggml_new_tensor_2d.argtypes = [C.c_void_p, C.c_int, C.c_int64, C.c_int64]
    base.ggml_new_tensor_3d.restype = C.c_void_p
    base.ggml_new_tensor_3d.argtypes = [C.c_void_p, C.c_int, C.c_int64, C.c_int64, C.c_int64]
    for binary in ("ggml_mul_mat", "ggml_swiglu_split", "ggml_mul", "ggml_add"):
        getattr(base, binary).restype, getattr(base, binary).argtypes = C.c_void_p, [C.c_void_p] * 3
    for ternary in ("ggml_mul_mat_id", "ggml_add_id"):
        getattr(base, ternary).restype, getattr(base, ternary).argtypes = C.c_void_p, [C.c_void_p] * 4
    base.ggml_swiglu_oai.restype = C.c_void_p
    base.ggml_swiglu_oai.argtypes = [C.c_void_p, C.c_void_p, C.c_void_p, C.c_float, C.c_float]
    base.ggml_view_2d.restype = C.c_void_p
    base.ggml_view_2d.argtypes = [C.c_void_p, C.c_void_p, C.c_int64, C.c_int64, C.c_size_t, C.c_size_t]
    base.ggml_cont.restype, base.ggml_cont.argtypes = C.c_void_p, [C.c_void_p, C.c_void_p]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = C.c_void_p, [C.c_void_p]
    base.ggml_build_forward_expand.argtypes = [C.c_void_p, C.c_void_p]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = C.c_void_p, [C.c_void_p]
    base.ggml_free.argtypes = [C.c_void_p]
    cpu.ggml_graph_compute_with_ctx.argtypes = [C.c_void_p, C.c_void_p, C.c_int]
    cpu.ggml_cpu_init()
    ctx = base.ggml_init(InitParams(nbytes + (64 << 20), None, False))
    try:
        def tensor(type_: int, cols: int, rows: int, array: np.ndarray, planes: int = 0):
            t = (base.ggml_new_tensor_3d(ctx, type_, cols, rows, planes) if planes
                 else base.ggml_new_tensor_2d(ctx, type_, cols, rows))  # fmt: skip
            array = np.ascontiguousarray(array)
            C.memmove(base.ggml_get_data(t), array.ctypes.data, array.nbytes)
            return t

        y = build(base, ctx, tensor)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        cpu.ggml_graph_compute_with_ctx(ctx, graph, 1)
        return np.ctypeslib.as_array(C.cast(base.ggml_get_data(y), C.POINTER(C.c_float)), out_shape).copy()
    finally:
        base.ggml_free(ctx)


def ggml_mul_mat_reference(qtype: str, raw: np.ndarray, rows: int, cols: int, x: np.ndarray) -> np.ndarray:
    """x @ Wᵀ as llama.cpp's CPU backend computes a mul_mat node on plain (not repacked) weights:
    a one-node graph through libggml's public API (ctypes), so ggml picks its kernel as llama.cpp
    does (vec_dot below 8 rows of x, its tiled K-quant GEMM from 8)."""
    from backends.openvino.ggml_kernels import type_id

    def build(lib, ctx, tensor):
        return lib.ggml_mul_mat(ctx, tensor(type_id(qtype), cols, rows, raw), tensor(0, cols, len(x), x.astype(np.float32)))

    return _ggml_graph(build, 1, (len(x), rows), raw.nbytes + 2 * x.nbytes + len(x) * rows * 4)


@needs_ggml
@needs_llamacpp
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_a_prompts_rows_get_llamacpps_own_mul_mat(qtype):
    """Prefill's many rows go through the kernel llama.cpp's mul_mat picks for them (its tiled
    K-quant GEMM from 8 rows), so a prompt's products are llama.cpp's bit for bit, as a decode
    step's are."""
    rows, cols = 48, 512
    raw = random_raw(qtype, rows, cols, seed=3)
    x = np.random.default_rng(5).normal(0.2, 1, (16, cols)).astype(np.float32)
    ours = _op(qtype, raw, rows, cols, x)
    assert np.array_equal(ours, ggml_mul_mat_reference(qtype, raw, rows, cols, x))
    assert np.array_equal(_op(qtype, raw, rows, cols, x[:3]), ggml_mul_mat_reference(qtype, raw, rows, cols, x[:3]))


@needs_ggml
@needs_llamacpp
@pytest.mark.parametrize("n", [1, 3, 16])
def test_a_feed_forward_is_llamacpps_build_ffn(n):
    """GgmlFfn is llama.cpp's SwiGLU feed-forward (gate and up in parallel, ggml_swiglu_split,
    down) bit for bit on the blocks as the file holds them, for a decode step's row, a few rows
    and a prompt's (the tiled GEMM); repacked (the default), that answer to float rounding."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino import ggml_kernels
    from backends.openvino.shard import SERVING_CONFIG, core
    from backends.openvino.ggml_kernels import type_id

    hidden, ffn, types = 256, 512, ("Q4_K", "Q5_K", "Q6_K")
    raws = [random_raw(types[0], ffn, hidden, seed=11), random_raw(types[1], ffn, hidden, seed=12),
            random_raw(types[2], hidden, ffn, seed=13)]  # fmt: skip
    # scaled so the SiLU sees values of both signs and every size
    x = (np.random.default_rng(14).normal(0, 1, (n, hidden)) * 1e-3).astype(np.float32)

    def build(lib, ctx, tensor):
        xt = tensor(0, hidden, n, x)
        g = lib.ggml_mul_mat(ctx, tensor(type_id(types[0]), hidden, ffn, raws[0]), xt)
        u = lib.ggml_mul_mat(ctx, tensor(type_id(types[1]), hidden, ffn, raws[1]), xt)
        return lib.ggml_mul_mat(ctx, tensor(type_id(types[2]), ffn, hidden, raws[2]), lib.ggml_swiglu_split(ctx, g, u))

    want = _ggml_graph(build, 1, (n, hidden), sum(r.nbytes for r in raws) + 8 * n * (ffn + hidden))
    got = {}
    for repack in (False, True):
        keep: list = []
        x_in = ops.parameter([-1, hidden], ov.Type.f32)
        y = ggml_kernels.swiglu_ffn(x_in.output(0), [r.copy() for r in raws], list(types), ffn, hidden, keep, repack=repack)
        model = ov.Model([ops.result(y)], [x_in])
        got[repack] = core().compile_model(model, "CPU", SERVING_CONFIG).create_infer_request().infer({0: x})[0].copy()
    assert np.array_equal(got[False], want)
    assert np.abs(got[True] - want).max() <= 1e-5 * np.abs(want).max()


@needs_ggml
@needs_llamacpp
@pytest.mark.parametrize("T, k, oai", [(1, 2, False), (3, 4, True), (16, 2, False), (32, 4, True)])
def test_the_experts_are_llamacpps_build_moe_ffn(T, k, oai):
    """GgmlMoe is llama.cpp's build_moe_ffn after the router, bit for bit: mul_mat_id of gate and
    up, add_id of their biases, the GLU (swiglu_split, or gpt-oss's swiglu_oai), down, its bias,
    × the weights, the slots summed in order; for a decode row, a few rows and a prompt's (8 rows
    an expert and more: the tiled GEMM)."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino import ggml_kernels
    from backends.openvino.ggml_kernels import type_id
    from backends.openvino.shard import SERVING_CONFIG, core

    E, hidden, ffn, types = 8, 256, 512, ("Q4_K", "Q5_K", "Q6_K")
    raws = [random_raw(types[0], E * ffn, hidden, seed=21), random_raw(types[1], E * ffn, hidden, seed=22),
            random_raw(types[2], E * hidden, ffn, seed=23)]  # fmt: skip
    rng = np.random.default_rng(24)
    x = (rng.normal(0, 1, (T, hidden)) * 1e-3).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)
    w = rng.uniform(0, 1, (T, k)).astype(np.float32)
    biases = [rng.normal(0, 1, (E, n)).astype(np.float32) for n in (ffn, ffn, hidden)]

    def build(lib, ctx, tensor):
        xt, it = tensor(0, hidden, 1, x, planes=T), tensor(26, k, T, ids.astype(np.int32))  # f32, i32
        g = lib.ggml_add_id(ctx, lib.ggml_mul_mat_id(ctx, tensor(type_id(types[0]), hidden, ffn, raws[0], planes=E), xt, it),
                            tensor(0, ffn, E, biases[0]), it)  # fmt: skip
        u = lib.ggml_add_id(ctx, lib.ggml_mul_mat_id(ctx, tensor(type_id(types[1]), hidden, ffn, raws[1], planes=E), xt, it),
                            tensor(0, ffn, E, biases[1]), it)  # fmt: skip
        a = lib.ggml_swiglu_oai(ctx, g, u, 1.702, 7.0) if oai else lib.ggml_swiglu_split(ctx, g, u)
        d = lib.ggml_add_id(ctx, lib.ggml_mul_mat_id(ctx, tensor(type_id(types[2]), ffn, hidden, raws[2], planes=E), a, it),
                            tensor(0, hidden, E, biases[2]), it)  # fmt: skip
        e = lib.ggml_mul(ctx, d, tensor(0, 1, k, w, planes=T))
        out = lib.ggml_view_2d(ctx, e, hidden, T, 4 * hidden * k, 0)
        for j in range(1, k):
            out = lib.ggml_add(ctx, out, lib.ggml_view_2d(ctx, e, hidden, T, 4 * hidden * k, 4 * hidden * j))
        return out

    want = _ggml_graph(build, 1, (T, hidden), sum(r.nbytes for r in raws) + 64 * T * k * (ffn + hidden) + (8 << 20))
    keep: list = []
    x_in, ids_in, w_in = ops.parameter([-1, hidden], ov.Type.f32), ops.parameter([-1, k], ov.Type.i64), ops.parameter([-1, k], ov.Type.f32)
    y = ggml_kernels.moe(x_in.output(0), ids_in.output(0), w_in.output(0), [r.copy() for r in raws], list(types), E, ffn,
                         hidden, keep, oai=oai, biases=[ops.constant(b).output(0) for b in biases])  # fmt: skip
    model = ov.Model([ops.result(y)], [x_in, ids_in, w_in])
    got = core().compile_model(model, "CPU", SERVING_CONFIG).create_infer_request().infer({0: x, 1: ids, 2: w})[0]
    assert np.array_equal(got, want)


@needs_ggml
@needs_llamacpp
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_op_computes_what_ggmls_own_kernels_compute(qtype):
    """Rows as the file holds them: bit for bit what llama.cpp's libggml-cpu gives, called
    directly, for one row of x and for five at once (prefill and batched users read what a decode
    step reads); within the activations' 8-bit rounding of the exact product, which it is not.
    Repacked (the default): that answer to float rounding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, cols = 40, 512
    raw = random_raw(qtype, rows, cols, seed=2)
    x = np.random.default_rng(4).normal(0.2, 1, (5, cols)).astype(np.float32)
    batched = _op(qtype, raw, rows, cols, x)
    assert np.array_equal(batched, ggml_reference(qtype, raw, rows, cols, x))
    assert np.array_equal(batched[2:3], _op(qtype, raw, rows, cols, x[2:3]))
    exact = x.astype(np.float64) @ dequantize(raw, GGMLQuantizationType[qtype]).reshape(rows, cols).astype(np.float64).T
    assert np.abs(batched - exact).max() < 0.02 * np.abs(exact).max(), qtype
    assert not np.array_equal(batched, exact.astype(np.float32))  # the activations were rounded
    # llama.cpp's default, repacked rows and its GEMM kernels (where this CPU has them for the
    # type): the same integer dot products summed in another order
    repacked = _op(qtype, raw, rows, cols, x, repack=True)
    assert np.abs(repacked - batched).max() <= 1e-5 * np.abs(batched).max(), qtype


def _first_positions_are_llamacpps(path: str, prompt: list[int], n: int = 8) -> None:
    """At --precision f32 (llama.cpp's f32 KV, as the reference runs) with --kquant ggml: greedy
    ids equal llama.cpp's on the same file, and the first two positions' logits are 10× nearer
    llama.cpp's than the exact form's."""
    from backends.openvino.shard import OpenVINOShard
    from tests.llamacpp_ref import greedy_run

    index = open_model(path)
    ref_ids, ref_logits = greedy_run(path, prompt, n)
    spec = ShardSpec(index.path, 0, index.hparams.n_blocks, embed=True, head=True)
    first = {}
    for kquant in ("ggml", "exact"):
        ids, logits = kafila_greedy(OpenVINOShard(spec, "f32", index=index, kquant=kquant), prompt, n)
        first[kquant] = float(np.abs(logits[:2] - ref_logits[:2]).max())
        if kquant == "ggml":
            assert ids == ref_ids
    assert first["ggml"] < first["exact"] / 10, first


@needs_ggml
@needs_llamacpp
def test_the_default_model_answers_with_llamacpps_logits(tmp_path):
    """The real default model (Q4_1 blocks, a Q8_0 head), at --precision f32 (llama.cpp's f32 KV
    cache, as the reference runs): greedy ids equal llama.cpp's on the same file; the first
    positions' logits are llama.cpp's to float rounding (0.0 on an AVX-512 EPYC),
    where the exact form is off by llama.cpp's activation rounding (0.7). Later positions: 1e-7
    differences elsewhere in the graph (softmax, norms) flip an activation's 8-bit rounding now
    and then, as between two llama.cpp builds, so only the ids are held there."""
    from tests.default_model import MODEL

    if MODEL is None:
        pytest.skip("the default model is not installed")
    _first_positions_are_llamacpps(MODEL, [1234])


@needs_ggml
def test_a_split_chain_computes_what_one_stage_computes(k_quant_file):
    """1 stage and 3 uneven stages at serving precision give the same 24 ids (the op is the same
    per row wherever the rows are), and auto is the ggml form there."""
    from kafila.engine.chain import LocalChain

    index = open_model(k_quant_file)
    prompt = [int(i) for i in np.random.default_rng(7).integers(3, 200, 20)]
    one = list(LocalChain.build(k_quant_file, 1, "openvino", "serving", index=index, kquant="auto").generate(prompt, 24))
    three = LocalChain.build(k_quant_file, 3, "openvino", "serving", index=index, kquant="auto")
    assert all(s._bank.kquant == "ggml" for s in three.shards)
    assert list(three.generate(prompt, 24)) == one


@needs_openvino
def test_auto_is_exact_at_f32_and_ggml_only_where_it_builds(monkeypatch):
    from backends.openvino import ggml_kernels

    assert DEFAULT_KQUANT == "exact" and {"auto", "ggml"} <= set(KQUANTS)
    assert ggml_kernels.resolve("auto", "f32") == "exact"
    assert ggml_kernels.resolve("fast", "serving") == "fast"

    def missing():
        raise ggml_kernels.KernelsMissing("no libggml-cpu.so in /nowhere: use --kquant exact")

    monkeypatch.setattr(ggml_kernels, "require", missing)
    assert ggml_kernels.resolve("auto", "serving") == "exact"


@needs_openvino
def test_kquant_ggml_without_a_ggml_build_is_refused_in_one_line(tmp_path, monkeypatch):
    path = write_llama_gguf(tmp_path / "m.gguf", blocks=2, **SMALL, qtype="Q4_K", embed_qtype="Q4_K")
    monkeypatch.setenv("KAFILA_GGML_LIB", str(tmp_path))  # a directory without libggml-cpu.so
    assert_bad_input(kafila("run", "--model", path, "--kquant", "ggml", "Hello"), "libggml-cpu.so", "--kquant exact")
    auto = kafila("run", "--model", path, "--kquant", "auto", "--max-tokens", "2", "--raw", "Hello")  # exact, said once
    assert auto.returncode == 0 and auto.stderr.count("exact form") == 1, auto.stderr


@needs_ggml
@needs_llamacpp
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_expert_rows_are_ggmls_products_of_each_rows_own_experts(qtype):
    """GgmlMatMulId (llama.cpp's mul_mat_id): row t, slot j is x[t] (or x[t, j]) through expert
    ids[t, j], bit for bit what libggml-cpu's own kernels give for that expert's matrix."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino import ggml_kernels
    from backends.openvino.shard import SERVING_CONFIG, core

    experts, rows, cols, T, k = 4, 24, 512, 3, 2
    raw = random_raw(qtype, experts * rows, cols, seed=6)
    ids = np.array([[2, 0], [3, 2], [2, 1]], np.int64)
    rng = np.random.default_rng(8)
    for x in (rng.normal(0, 1, (T, 1, cols)), rng.normal(0, 1, (T, k, cols))):
        x = x.astype(np.float32)
        keep: list = []
        x_in = ops.parameter([-1, x.shape[1], cols], ov.Type.f32)
        ids_in = ops.parameter([-1, k], ov.Type.i64)
        y = ggml_kernels.matmul_id(x_in.output(0), ids_in.output(0), raw.copy(), qtype, experts, rows, cols, keep)
        model = ov.Model([ops.result(y)], [x_in, ids_in])
        got = core().compile_model(model, "CPU", SERVING_CONFIG).create_infer_request().infer({0: x, 1: ids})[0]
        assert got.shape == (T, k, rows)
        per_expert = raw.reshape(experts, rows, -1)
        for t in range(T):
            for j in range(k):
                want = ggml_reference(qtype, per_expert[ids[t, j]], rows, cols, x[t, j if x.shape[1] == k else 0][None])
                assert np.array_equal(got[t, j], want[0]), (t, j)


@needs_ggml
@needs_llamacpp
@pytest.mark.parametrize("kind, ftype", [("qwen3moe", "Q4_K_M"), ("gpt-oss", "MXFP4_MOE")])
def test_moe_files_get_llamacpps_logits_from_the_expert_op(tmp_path, kind, ftype):
    """qwen3moe (Q4_K/Q6_K/... experts) and gpt-oss (MXFP4 experts, biases) quantized by llama.cpp:
    with --kquant ggml (f32 KV, as the reference runs) the first positions' logits are llama.cpp's
    own on the same file to float rounding, 10× nearer than the exact form's; greedy ids equal."""
    from tests.arch_gguf import write_arch_gguf
    from tests.llamacpp_ref import quantize

    options = {"hidden": 256, "ffn": 512, "experts": (8, 2, 256)} if kind == "qwen3moe" else {}
    src = write_arch_gguf(tmp_path / "f32.gguf", kind, blocks=4, **options)
    path = quantize(src, str(tmp_path / "q.gguf"), ftype)
    _first_positions_are_llamacpps(path, [7])


@needs_ggml
def test_a_machine_without_a_compiler_serves_in_the_exact_form_and_says_why_once(tmp_path, monkeypatch):
    """No op built for this ggml yet (another path to it: another key) and no cmake or compiler on
    PATH: `kafila run --kquant auto` answers (exact form) and says why in one line."""
    from backends.openvino.ggml_kernels import _ggml_lib

    path = write_llama_gguf(tmp_path / "m.gguf", blocks=2, **SMALL, qtype="Q4_K", embed_qtype="Q4_K")
    (tmp_path / "ggml").symlink_to(_ggml_lib()[0], target_is_directory=True)
    monkeypatch.setenv("KAFILA_GGML_LIB", str(tmp_path / "ggml"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    proc = kafila("run", "--model", path, "--kquant", "auto", "--max-tokens", "2", "--raw", "Hello")
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "exact form" in line]
    assert len(said) == 1 and "needs cmake" in said[0] and "Traceback" not in proc.stderr, proc.stderr


@needs_ggml
def test_why_the_default_stays_exact(default_model_path):
    """A prompt fed as prefix + rest against the same prompt in one step, at serving precision: the
    exact form's last logits agree to the f16 cache's rounding; the ggml form's 8-bit activation
    rounding (llama.cpp's) amplifies the cuts' 1e-7 differences (measured 1.06 on an AVX-512 EPYC),
    so a cached or chunked prompt may answer otherwise at a near-tie. Printed, held only for exact."""
    from kafila.engine.chain import LocalChain
    from tests.test_prompt_cache import feed_through

    index = open_model(default_model_path)
    ids = [int(i) for i in np.random.default_rng(3).integers(100, 20000, 40)]
    gaps = {}
    for kquant in ("exact", "ggml"):
        chain = LocalChain.build(default_model_path, 1, "openvino", "serving", index=index, kquant=kquant)
        one, two = [s.open_slot() for s in chain.shards], [s.open_slot() for s in chain.shards]
        want = chain.logits(feed_through(chain.shards, one, ids, 0)[-1:])[0]
        feed_through(chain.shards, two, ids[:24], 0)
        got = chain.logits(feed_through(chain.shards, two, ids[24:], 24)[-1:])[0]
        gaps[kquant] = float(np.abs(got - want).max())
    print(f"prefix + rest against one step, max |Δlogit|: {gaps}")
    assert gaps["exact"] < 0.05, gaps


@needs_ggml
@pytest.mark.parametrize("L", [1, 7])
def test_the_delta_rule_op_computes_what_the_loop_computes(L):
    """KafilaDeltaRule (a hybrid layer's gated delta rule as one node) against the OpenVINO Loop it
    replaces, on the same random step: outputs and final state equal to f32 rounding."""
    import openvino as ov
    import openvino.opset13 as ops

    from backends.openvino import ggml_kernels
    from backends.openvino.delta_net import _delta_rule_loop
    from backends.openvino.shard import F32_CONFIG, core

    B, H, S = 2, 3, 16
    rng = np.random.default_rng(3)
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731 (L2-normalised, as the layer feeds)
    data = [unit(rng.normal(0, 1, (B, L, H, S))), unit(rng.normal(0, 1, (B, L, H, S))),
            rng.normal(0, 1, (B, L, H, S)), -rng.uniform(0, 2, (B, L, H)), rng.uniform(0, 1, (B, L, H)),
            rng.normal(0, 0.5, (B, H, S, S))]  # fmt: skip
    data = [a.astype(np.float32) for a in data]
    got = {}
    for name in ("op", "loop"):
        params = [ops.parameter(list(a.shape), ov.Type.f32) for a in data]
        outs = [p.output(0) for p in params]
        o, m = ggml_kernels.delta_rule(*outs) if name == "op" else _delta_rule_loop(*outs, H, S)
        model = ov.Model([ops.result(o), ops.result(m)], params)
        got[name] = core().compile_model(model, "CPU", F32_CONFIG).create_infer_request().infer(data)
    for i in range(2):
        want = got["loop"][i]
        assert np.abs(got["op"][i] - want).max() <= 1e-5 * max(1.0, np.abs(want).max()), i
