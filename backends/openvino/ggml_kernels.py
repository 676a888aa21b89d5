"""ggml's own CPU matmul kernels inside an OpenVINO graph: `--kquant ggml` (issue 36 item 3).

A quantized matrix becomes one `GgmlMatMul` node (backends/openvino/ggml_op/ggml_matmul.cpp) over
the GGUF file's own blocks (u8 bytes mapped from the file, read in place). Each step computes it as
a ggml mul_mat node, a slice of the weight rows on each of the CPU plugin's threads, so ggml picks
the kernel llama.cpp's CPU backend would pick for the same matrix and rows: x quantized to the
type's vec_dot type by `from_float` (Q8_K for the K-quants, Q8_0/Q8_1 for the others), then its
repacked GEMM/GEMV where ggml has an interleaved layout for the type on this CPU (the op repacks
the matrix at the first step, as llama.cpp does by default: REPACK, below), its tiled K-quant GEMM
for 8 rows of x or more (a prompt's chunk), `vec_dot` per weight row otherwise. A mixture-of-
experts block's rows go through `GgmlMatMulId`, each row through its own k experts (llama.cpp's
mul_mat_id, by vec_dot). Where llama.cpp's graph puts a few ggml nodes together the stage has them
as one node too, so the plugin's own ops (and their cost at each step) sit only between them:
`GgmlFfn`, a SwiGLU feed-forward (llama.cpp's build_ffn: gate and up, ggml_swiglu_split, down), and
`GgmlMoe`, a mixture-of-experts feed-forward after its router (build_moe_ffn: mul_mat_id, add_id,
the GLU, down, the weights, the slots summed in order). That is the arithmetic llama.cpp runs (the
same functions of the same library), with its activation rounding. The same library
holds KafilaDeltaRule, a hybrid layer's gated delta rule as one node (`delta_rule`; every form
uses it where the library loads).

Which ggml: llama-cpp-python's (`llama_cpp/lib/libggml-cpu.so`, `libggml-base.so`). It is the
maintained, pip-installable build of ggml that the suite already uses as its reference; pip builds
it on install for the machine's own ISA (GGML_NATIVE), the kernels llama.cpp would pick here. Its
wheel carries no headers, so the same release's `ggml/include` comes from its sdist (pip download,
cached). The op is compiled once per (source, OpenVINO, llama-cpp-python) with the wheel's
OpenVINOConfig.cmake into ~/.cache/kafila/ops/ (`python -m backends.openvino.ggml_kernels` does it
ahead, as scripts/bootstrap.sh runs it); where that cannot happen (no compiler, no cmake, no
llama-cpp-python) `--kquant ggml` fails in one line that says why, and `exact` is the fallback.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from backends.errors import BadInput

# ggml runs its threads with OpenMP; by default an OpenMP team spins for a while after each
# matmul, on the cores the CPU plugin's next ops want: on 2 cores decode ran at 0.06× llama.cpp
# spinning and 1.0× passive. Read once, when libgomp loads (with llama_cpp or the op): so here,
# before either, unless the person set it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SOURCE_DIR = Path(__file__).with_name("ggml_op")
# GGUF block types with a ggml CPU dot product; F16/BF16/F32 matrices keep their f32 form.
GGML_QTYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS", "MXFP4")  # fmt: skip
BUILD_TIMEOUT_S = 900


class KernelsMissing(BadInput):
    """The ggml kernels cannot be had here (the message says why and what to do)."""


def type_id(qtype: str) -> int:
    """ggml's enum value of a GGUF block type (gguf-py mirrors ggml.h's enum ggml_type)."""
    from gguf import GGMLQuantizationType

    return int(GGMLQuantizationType[qtype].value)


def _ggml_lib() -> tuple[Path, str]:
    """(the directory holding libggml-cpu.so and libggml-base.so, their release): $KAFILA_GGML_LIB
    names another ggml build of llama-cpp-python's release (its headers are that release's)."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise KernelsMissing(f"--kquant ggml needs llama-cpp-python's ggml ({exc}); "
                             "pip install llama-cpp-python, or use --kquant exact") from None  # fmt: skip
    lib = Path(os.environ.get("KAFILA_GGML_LIB") or Path(llama_cpp.__file__).parent / "lib")
    if not (lib / "libggml-cpu.so").exists():
        raise KernelsMissing(f"no libggml-cpu.so in {lib}: this llama-cpp-python has no CPU ggml; use --kquant exact")
    return lib, llama_cpp.__version__


def build_dirs() -> list[Path]:
    """Where the built op is looked for, in order, and built into (the first writable): beside
    this module (inside the installed package or the checkout: found by every process of that
    install whatever its $HOME or $XDG_CACHE_HOME), else the user's cache."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return [SOURCE_DIR.with_name("ggml_op_build"), Path(base) / "kafila" / "ops"]


def _key(version: str, lib: Path) -> str:
    import openvino

    h = hashlib.sha256()
    for f in sorted(SOURCE_DIR.iterdir()):
        h.update(f.name.encode() + f.read_bytes())
    h.update(f"{openvino.__version__} {version} {sys.platform} {lib}".encode())
    return h.hexdigest()[:16]


def _headers(version: str, work: Path) -> Path:
    """ggml/include of llama-cpp-python `version`'s sdist (pip download: cached by pip)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"llama-cpp-python=={version}", "-d", str(work)],
                   check=True, timeout=BUILD_TIMEOUT_S, capture_output=True)  # fmt: skip
    sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
    include = work / "include"
    include.mkdir()
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            inner = m.name.partition("/")[2]
            if inner.startswith("vendor/llama.cpp/ggml/include/") and m.isfile() and inner.endswith(".h"):
                m.name = os.path.basename(inner)
                tar.extract(m, include, filter="data")
    return include


def build(quiet: bool = True) -> Path:
    """Compile the op for this OpenVINO and llama-cpp-python (once); returns the library's path."""
    lib, version = _ggml_lib()
    key = _key(version, lib)
    for d in build_dirs():
        if (d / key / "libkafila_ggml.so").exists():
            return d / key / "libkafila_ggml.so"
    out = next((d for d in build_dirs() if _writable(d)), build_dirs()[-1]) / key / "libkafila_ggml.so"
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise KernelsMissing(f"building the ggml op needs {tool} (apt-get install cmake g++); or use --kquant exact")
    import openvino.utils

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kafila-ggml-op-") as tmp:
        work = Path(tmp)
        try:
            include = _headers(version, work)
            run = functools.partial(subprocess.run, check=True, timeout=BUILD_TIMEOUT_S, capture_output=quiet)
            run(["cmake", "-S", str(SOURCE_DIR), "-B", str(work / "build"), "-DCMAKE_BUILD_TYPE=Release",
                 f"-DOpenVINO_DIR={openvino.utils.get_cmake_path()}", f"-DGGML_INCLUDE={include}", f"-DGGML_LIB={lib}"])  # fmt: skip
            run(["cmake", "--build", str(work / "build"), "-j", str(os.cpu_count() or 1)])
        except (OSError, subprocess.SubprocessError, StopIteration) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            tail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else [str(exc)]
            raise KernelsMissing(f"could not build the ggml op ({tail[0] if tail else exc}); use --kquant exact") from None
        built = work / "build" / "libkafila_ggml.so"
        partial = out.with_suffix(".tmp")
        shutil.copyfile(built, partial)
        os.replace(partial, out)  # whole or absent: a build cut short leaves nothing half-written
    for old in out.parent.parent.iterdir():  # builds for an older source or release
        if old != out.parent and (old / out.name).exists():
            shutil.rmtree(old, ignore_errors=True)
    return out


def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(d, os.W_OK)


@functools.lru_cache(maxsize=1)
def _factory():
    from openvino.utils.node_factory import NodeFactory

    from backends.openvino.shard import core

    path = str(build())
    core().add_extension(path)  # compile_model must know the op too
    factory = NodeFactory()
    factory.add_extension(path)
    return factory


_missing: list[KernelsMissing] = []  # the first failure, kept: a process tries the build once


def require() -> None:
    """Raises KernelsMissing (one line: why, and what to do) unless `--kquant ggml` works here.
    A failed build is not retried in this process (every stage of `--kquant auto` asks)."""
    if _missing:
        raise _missing[0]
    try:
        _factory()
    except KernelsMissing as exc:
        _missing.append(exc)
        raise


def available() -> tuple[bool, str]:
    """(True, "") where `--kquant ggml` works here; else (False, why)."""
    try:
        require()
    except KernelsMissing as exc:
        return False, str(exc)
    return True, ""


def resolve(kquant: str, precision: str) -> str:
    """The form an OpenVINO stage builds for `--kquant kquant` at `precision` (see backends.KQUANTS)."""
    if kquant != "auto":
        return kquant
    if precision != "serving":
        return "exact"
    ok, why = available()
    if not ok:
        _say_once(f"kafila: K-quant matrices in the exact form: {why.removesuffix('; use --kquant exact')}")
    return "ggml" if ok else "exact"


@functools.lru_cache(maxsize=None)
def _say_once(line: str) -> None:
    print(line, file=sys.stderr)


# llama.cpp's repacked layout and its GEMM/GEMV kernels (llama.cpp's default), run on the plugin's
# own threads, each over a slice of the rows (ggml_matmul.cpp). Through a ggml graph on ggml's own
# OpenMP team it was slower than vec_dot (the team and the plugin's threads shared the cores);
# on the plugin's threads, prefill of the real Qwen2.5-Coder-1.5B Q4_K_M went from 0.51x to 0.83x
# llama.cpp and decode from 0.80x to 0.85x (docs/BENCHMARKS.md, "Speed against llama.cpp").
REPACK = True


def matmul(x, weights: np.ndarray, qtype: str, rows: int, cols: int, keep: list, repack: bool | None = None):
    """x [..., cols] @ W[rows, cols]ᵀ → [..., rows], W as the file's blocks `weights` (uint8, any
    shape holding rows × row bytes); `keep` holds the buffer while the model lives. repack: in
    llama.cpp's repacked layout and its GEMM/GEMV kernels where ggml has them for the type on this
    CPU (llama.cpp's default; a copy of the matrix made at the first step), else every row by
    vec_dot on the blocks as they are."""
    import openvino as ov
    flat = np.ascontiguousarray(weights).reshape(-1)
    keep.append(flat)
    w = ov.op.Constant(ov.Tensor(flat, shared_memory=True))
    repack = REPACK if repack is None else repack
    node = _factory().create("GgmlMatMul", [x, w.output(0)], {"type": type_id(qtype), "rows": rows, "cols": cols, "repack": repack})
    return node.output(0)


def swiglu_ffn(x, weights: list[np.ndarray], qtypes: list[str], ffn: int, hidden: int, keep: list,
               repack: bool | None = None):
    """x [..., hidden] through a SwiGLU feed-forward as llama.cpp's build_ffn computes it:
    W_down · (silu(W_gate · x) ⊙ (W_up · x)), with ggml_swiglu_split, as one GgmlFfn node;
    `weights` the file's blocks of gate, up [ffn rows] and down [hidden rows] (see matmul)."""
    import openvino as ov

    consts = []
    for raw in weights:
        flat = np.ascontiguousarray(raw).reshape(-1)
        keep.append(flat)
        consts.append(ov.op.Constant(ov.Tensor(flat, shared_memory=True)).output(0))
    repack = REPACK if repack is None else repack
    attrs = {"gate_type": type_id(qtypes[0]), "up_type": type_id(qtypes[1]), "down_type": type_id(qtypes[2]),
             "ffn": ffn, "hidden": hidden, "repack": repack}  # fmt: skip
    return _factory().create("GgmlFfn", [x, *consts], attrs).output(0)


def geglu(gate, up):
    """GELU(gate) ⊙ up as ggml computes it (f16-table GELU, llama.cpp's), one GgmlGeglu node:
    gate, up f32 [..., n] → [..., n]."""
    return _factory().create("GgmlGeglu", [gate, up], {}).output(0)


def moe(x, ids, weights, experts: list[np.ndarray], qtypes: list[str], n_experts: int, ffn: int, hidden: int,
        keep: list, oai: bool = False, biases: list | None = None, gelu: bool = False, down_scales=None,
        fused: bool = False):
    """A mixture-of-experts feed-forward as llama.cpp's build_moe_ffn computes it once routed, one
    GgmlMoe node: x [T, hidden], ids and weights [T, k] (the router's picks and their weights) →
    [T, hidden] = Σ_j weights[t, j] · down_i(act(gate_i · x_t + b, up_i · x_t + b) + b), i = ids[t, j],
    summed in slot order; act ggml_swiglu_split, ggml_swiglu_oai (`oai`: gpt-oss) or
    ggml_geglu_split (`gelu`: Gemma 4); `experts` the file's blocks of gate, up [E, ffn, hidden] and
    down [E, hidden, ffn]; `biases` f32 outputs [E, ffn], [E, ffn], [E, hidden] where the file has
    them; `down_scales` f32 [T, k]: the down matrix's per-expert scale of each slot's expert, which
    multiplies its output before the bias (llama.cpp's build_lora_mm_id); `fused`: gate and up
    are both the one [E, 2·ffn, hidden] tensor (each expert's gate rows, then its up rows)."""
    import openvino as ov

    consts, made = [], {}
    for raw in experts:
        if id(raw) not in made:  # a fused gate_up given twice: one constant
            flat = np.ascontiguousarray(raw).reshape(-1)
            keep.append(flat)
            made[id(raw)] = ov.op.Constant(ov.Tensor(flat, shared_memory=True)).output(0)
        consts.append(made[id(raw)])
    attrs = {"gate_type": type_id(qtypes[0]), "up_type": type_id(qtypes[1]), "down_type": type_id(qtypes[2]),
             "experts": n_experts, "ffn": ffn, "hidden": hidden, "oai": oai, "bias": biases is not None,
             "gelu": gelu, "scaled": down_scales is not None, "fused": fused}  # fmt: skip
    scales = [] if down_scales is None else [down_scales]
    return _factory().create("GgmlMoe", [x, ids, weights, *consts, *(biases or []), *scales], attrs).output(0)


def main() -> int:
    """Build ahead (scripts/bootstrap.sh): prints the library, or why not (exit 1)."""
    try:
        print(build(quiet=False))
    except KernelsMissing as exc:
        print(f"kafila: {exc}", file=sys.stderr)
        return 1
    return 0


def delta_rule(q, k, v, g, beta, m0):
    """The gated delta rule as one KafilaDeltaRule node (ggml_op/delta_rule.hpp): q, k, v
    [B, L, H, S], g, β [B, L, H], m0 [B, H, S, S] → (o [B, L, H, S], final M [B, H, S, S]).
    Raises KernelsMissing where the op library cannot be had (the caller builds a Loop)."""
    require()
    node = _factory().create("KafilaDeltaRule", [q, k, v, g, beta, m0], {})
    return node.output(0), node.output(1)


def matmul_id(x, ids, weights: np.ndarray, qtype: str, experts: int, rows: int, cols: int, keep: list):
    """Mixture-of-experts rows, as llama.cpp's mul_mat_id: x [T, 1 | k, cols], ids [T, k] (i64) →
    [T, k, rows], y[t, j] = x[t, j or 0] · W[ids[t, j]]ᵀ for W [experts, rows, cols] held as the
    file's blocks `weights`: only the picked experts' bytes are read. (Not repacked: llama.cpp's
    repacked mul_mat_id, run as matmul runs its GEMM, agreed with vec_dot to f32 rounding op by op
    yet moved a random qwen3moe file's logits off llama.cpp's, failing
    tests/test_ggml_kernels.py::test_moe_files_get_llamacpps_logits_from_the_expert_op; not
    understood, so left out.)"""
    import openvino as ov

    flat = np.ascontiguousarray(weights).reshape(-1)
    keep.append(flat)
    w = ov.op.Constant(ov.Tensor(flat, shared_memory=True))
    attrs = {"type": type_id(qtype), "experts": experts, "rows": rows, "cols": cols}
    return _factory().create("GgmlMatMulId", [x, ids, w.output(0)], attrs).output(0)

