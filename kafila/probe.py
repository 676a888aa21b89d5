"""Measure this machine for the planner: the terms of eq. 2 and the tiers below it (§V-A, §V-D).

`probe_device(quick=False, backend="openvino") -> ProbeResult` measures, with the backend the
member will serve on (a member is priced by what its shards will run, not by numpy):
- memory bandwidth b̄ (GB/s): a streaming read of a buffer far larger than the last-level cache
  (at least 512 MiB and twice the LLC; 128 MiB in quick mode, which trades rigour for a
  sub-two-second start). openvino and reference: numpy reductions on every CPU this process may
  use (the CPU plugin's and numpy's kernels run on all of them); mlx: an MLX reduction on MLX's
  default device, evaluated;
- per-token dispatch overhead o (µs): one forward of a tiny graph ([1, 1, 64] → MatMul
  [64, 64] → result, read back): an OpenVINO infer request on CPU, an MLX matmul evaluated on
  its default device, or a numpy matmul for reference; the cost the backend pays per shard per
  token whatever the shard's size;
- free memory (GB = 1e9 bytes): what the OS reports available, lowered to the room left under
  a cgroup memory limit when one is set;
- arithmetic throughput (TFLOP/s): a float32 matmul in the backend's library (numpy for
  openvino and reference, MLX for mlx);
- openvino only, a block's fixed cost (µs): the serving graph of a transformer block
  (backends/openvino/graph.py's StageBuilder, KV cache state included) at a tiny width, so its
  weights read in no time, timed as BLOCK_PROBE_DEEP blocks against one: the difference a block
  is what each block costs beyond its bytes (the dispatch of its ~40 ops). Small models are
  not bandwidth-bound: for SmolLM2-135M this is most of a stage. Beside it, the rate a block's
  bytes stream at through the shards' compressed 4-bit FullyConnected (GB/s): the same block
  graph at a wide shape (hidden 1024, ~6 MB of 4-bit weights) timed as three blocks against
  one, less the fixed cost; the decompressing matrix-vector product, not a plain read, is what
  a token pays per byte. And the head's fixed cost (µs): a tiny lm_head graph with its top-1,
  one inference as the head's token pick is.
`ProbeResult.backend` names what was measured ("openvino CPU", "mlx CPU", "mlx GPU",
"reference numpy CPU").
Each figure is the median over several runs, with its spread (max − min over the runs, in the
same unit). Every run lasts at least a fixed time, so a figure is a sustained rate: thermal
throttling shows in it rather than hiding between bursts. Under a CPU quota the runs are timed
on the process's CPU time over the quota (kafila/probe_quota.py), what the quota paces them at
whatever its stalls fell on; `cpu_burst` says how much faster it computes while let run.
A measurement that fails is reported as None with the reason in `errors`; the planner then
plans in a lower admission tier.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from backends.cgroups import cgroup_cpu_quota, cgroup_memory_room_bytes, quota_threads, usable_cpus  # noqa: F401 (re-exported)
from kafila.probe_quota import measure_burst, measure_quota_run, sustained_clock

MIB = 1 << 20
BYTES_PER_GB = 1e9
FULL_BUFFER_MIN_BYTES = 512 * MIB
QUICK_BUFFER_BYTES = 128 * MIB
MAX_BUFFER_BYTES = 2048 * MIB
OVERHEAD_WIDTH = 64  # the tiny graph's hidden size
PROBE_BACKENDS = ("openvino", "mlx", "reference")


@dataclass(frozen=True)
class ProbeSettings:
    """How long and how often to measure."""

    runs: int
    run_s: float  # each run repeats its work for at least this long
    buffer_bytes: int  # upper bound; lowered to a quarter of free memory
    matmul_n: int
    clock: Callable[[], float] = time.perf_counter  # seconds; under a CPU quota, sustained_clock's

    @staticmethod
    def for_mode(quick: bool) -> ProbeSettings:
        if quick:
            return ProbeSettings(runs=5, run_s=0.025, buffer_bytes=QUICK_BUFFER_BYTES, matmul_n=512)
        llc = last_level_cache_bytes() or 0
        buffer = min(MAX_BUFFER_BYTES, max(FULL_BUFFER_MIN_BYTES, 2 * llc))
        return ProbeSettings(runs=7, run_s=0.2, buffer_bytes=buffer, matmul_n=1024)


@dataclass(frozen=True)
class ProbeResult:
    """One machine's measurements; medians over `runs`, spreads are max − min."""

    bandwidth_gbps: float | None
    overhead_us: float | None
    memory_gb: float
    tflops: float | None
    bandwidth_spread: float | None  # GB/s
    overhead_spread: float | None  # µs
    tflops_spread: float | None  # TFLOP/s
    runs: int
    quick: bool
    threads: int
    buffer_mib: int
    llc_mib: int | None
    backend: str
    errors: tuple[str, ...] = field(default=())
    block_us: float | None = None  # a block's fixed compute beyond its bytes (openvino)
    block_gbps: float | None = None  # the rate a block's 4-bit weights stream at (openvino)
    head_us: float | None = None  # the head pick's fixed compute (openvino)
    cpu_quota: float | None = None  # CPUs this process's cgroup allows (None: no quota)
    cpu_period_ms: float | None = None  # the quota's period
    cpu_burst: float | None = None  # under a quota: its speed while let run over its sustained speed
    cpu_run_ms: float | None = None  # under a quota: CPU ms it computes after idle before a stall

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["errors"] = list(self.errors)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 4)
        return out

    def fleet_device(self, name: str, **extra: Any) -> dict[str, Any]:
        """This machine as a `devices` entry of the planner's fleet file."""
        entry: dict[str, Any] = {
            "name": name,
            "memory_gb": round(self.memory_gb, 3),
            "bandwidth_gbps": self.bandwidth_gbps,
            "overhead_us": self.overhead_us,
            "tflops": self.tflops,
            "block_us": self.block_us,
            "block_gbps": self.block_gbps,
            "head_us": self.head_us,
            "cpu_quota": self.cpu_quota,
            "cpu_period_ms": self.cpu_period_ms,
            "cpu_burst": self.cpu_burst,
            "cpu_run_ms": self.cpu_run_ms,
        }
        entry.update(extra)
        return entry


def probe_device(quick: bool = False, backend: str = "openvino") -> ProbeResult:
    """Measure this machine with `backend` (quick: under two seconds, for session start)."""
    if backend not in PROBE_BACKENDS:
        choices = ", ".join(PROBE_BACKENDS)
        raise ValueError(f"no probe for backend {backend!r} (choose from {choices})")
    settings = ProbeSettings.for_mode(quick)
    quota = cgroup_cpu_quota()
    if quota is not None:
        settings = replace(settings, clock=sustained_clock(quota[0]))
    errors: list[str] = []
    memory_bytes = free_memory_bytes()  # before the probe's own buffer takes some
    threads = usable_cpus()
    buffer_bytes = max(64 * MIB, min(settings.buffer_bytes, int(memory_bytes // 4)))

    if backend == "mlx":
        label = _attempt_label(mlx_device_label, errors)
        bandwidth = _attempt(
            lambda: measure_bandwidth_mlx(buffer_bytes, settings), errors, "bandwidth"
        )
        overhead = _attempt(lambda: measure_overhead_mlx(settings), errors, "overhead")
        tflops = _attempt(lambda: measure_tflops_mlx(settings), errors, "tflops")
    else:
        label = "openvino CPU" if backend == "openvino" else "reference numpy CPU"
        bandwidth = _attempt(
            lambda: measure_bandwidth(buffer_bytes, threads, settings), errors, "bandwidth"
        )
        measure = measure_overhead if backend == "openvino" else measure_overhead_numpy
        overhead = _attempt(lambda: measure(settings), errors, "overhead")
        tflops = _attempt(lambda: measure_tflops(settings), errors, "tflops")
    block = head = None
    if backend == "openvino":
        block = _attempt(lambda: measure_block_openvino(settings), errors, "block")
        head = _attempt(lambda: measure_head_openvino(settings), errors, "head")
    block_us, block_gbps = block if block is not None else (None, None)
    burst = None
    if backend == "openvino" and quota is not None:
        burst = _attempt(lambda: [measure_burst_openvino(quota[1])], errors, "burst")
    run = None if quota is None else _attempt(lambda: measure_quota_run(quota[1]), errors, "quota run")
    llc = last_level_cache_bytes()
    return ProbeResult(
        bandwidth_gbps=_median(bandwidth),
        overhead_us=_median(overhead),
        memory_gb=memory_bytes / BYTES_PER_GB,
        tflops=_median(tflops),
        bandwidth_spread=_spread(bandwidth),
        overhead_spread=_spread(overhead),
        tflops_spread=_spread(tflops),
        runs=settings.runs,
        quick=quick,
        threads=threads,
        buffer_mib=buffer_bytes // MIB,
        llc_mib=None if llc is None else llc // MIB,
        backend=label,
        errors=tuple(errors),
        block_us=_median(block_us),
        block_gbps=_median(block_gbps),
        head_us=_median(head),
        cpu_quota=None if quota is None else quota[0],
        cpu_period_ms=None if quota is None else quota[1] * 1e3,
        cpu_burst=_median(burst),
        cpu_run_ms=_median(run),
    )


def _attempt(
    measure: Callable[[], list[float]], errors: list[str], what: str
) -> list[float] | None:
    try:
        return measure()
    except (ImportError, MemoryError, OSError, RuntimeError, ValueError) as exc:
        # a failed measurement lowers the planner's tier; the reason travels with the result
        errors.append(f"{what}: {type(exc).__name__}: {exc}")
        return None


def _attempt_label(label: Callable[[], str], errors: list[str]) -> str:
    try:
        return label()
    except ImportError as exc:
        errors.append(f"backend: {type(exc).__name__}: {exc}")
        return "mlx (not importable)"


def _median(values: list[float] | None) -> float | None:
    return None if not values else statistics.median(values)


def _spread(values: list[float] | None) -> float | None:
    return None if not values else max(values) - min(values)


def _timed_runs(work: Callable[[], float], settings: ProbeSettings) -> list[float]:
    """Rates from `settings.runs` runs; `work` does one unit and returns its size.

    Each run repeats `work` for at least `run_s` and reports size / elapsed s; one run before
    them warms caches, pages and thread pools and is discarded.
    """
    rates = []
    for run in range(settings.runs + 1):
        done = 0.0
        start = settings.clock()
        while True:
            done += work()
            elapsed = settings.clock() - start
            if elapsed >= settings.run_s:
                break
        if run > 0:
            rates.append(done / elapsed)
    return rates


def measure_bandwidth(buffer_bytes: int, threads: int, settings: ProbeSettings) -> list[float]:
    """GB/s per run: every thread reads its own slice of the buffer (integer OR-reduction)."""
    words = np.empty(buffer_bytes // 8, dtype=np.uint64)
    words.fill(1)  # touch every page before timing
    slices = np.array_split(words, threads * 4)
    with ThreadPoolExecutor(max_workers=threads) as pool:

        def read_once() -> float:
            # numpy releases the GIL inside the reduction, so the threads read in parallel
            list(pool.map(np.bitwise_or.reduce, slices))
            return float(words.nbytes)

        rates = _timed_runs(read_once, settings)
    return [rate / BYTES_PER_GB for rate in rates]


def measure_overhead(settings: ProbeSettings) -> list[float]:
    """µs per forward of a tiny OpenVINO graph: the backend's fixed cost per stage and token."""
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([1, 1, OVERHEAD_WIDTH], np.float32, name="x")  # (B, T, C)
    weight = np.full((OVERHEAD_WIDTH, OVERHEAD_WIDTH), 0.01, dtype=np.float32)
    y = ops.matmul(x, ops.constant(weight), False, False)  # (B, T, C)
    model = ov.Model([ops.result(y)], [x], "kafila-probe")
    compiled = ov.Core().compile_model(model, "CPU")
    request = compiled.create_infer_request()
    token = np.ones((1, 1, OVERHEAD_WIDTH), dtype=np.float32)  # (B, T, C)

    def forward() -> float:
        # as a shard steps: wrap this token's activations without a copy, infer, read back
        request.set_input_tensor(0, ov.Tensor(token, shared_memory=True))
        request.infer()
        request.get_output_tensor(0).data.sum()
        return 1.0

    calls_per_s = _timed_runs(forward, settings)
    return [1e6 / rate for rate in calls_per_s]


# the tiny block: weights of a few KB, so what it costs is the dispatch of its ops
BLOCK_PROBE_SHAPE = {"hidden": 64, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16, "ffn": 128, "vocab": 256}
BLOCK_PROBE_DEEP = 9  # blocks in the deep graph; the shallow one has 1
BLOCK_PROBE_PAST = 32  # positions of KV before the timed steps (a short conversation)
BLOCK_PROBE_RESET = 256  # steps after which the KV state is reset (it grows a position a step)


# a wide block of 4-bit weights (as Q4_K / Q4_1 files are served): what a block's bytes cost
WIDE_PROBE_SHAPE = {"hidden": 1024, "n_heads": 16, "n_kv_heads": 4, "head_dim": 64, "ffn": 2816, "vocab": 256}
WIDE_PROBE_DEEP = 3
# each block-probe run lasts one CFS period at least (cpu.cfs_period_us = 100 ms by default), so a
# CPU quota shows in it: a 25 ms run fits inside a 25 % quota's share of one period unthrottled
BLOCK_PROBE_RUN_S = 0.1
BLOCK_PROBE_RUNS = 3
Q4_GROUP = 32  # weights a 4-bit group shares its scale and zero point with
Q4_K_BLOCK_BYTES = 144  # a Q4_K super-block: 256 weights


class _ProbeWeights:
    """A WeightBank's calls (vector, project, swiglu) over random constants: the real block graph
    (StageBuilder.block) at a probe's shape; `packed`: 4-bit codes with a scale and zero point a
    group, the compressed FullyConnected the shards build (WeightBank.packed_linear), else f32."""

    def __init__(self, hp: Any, packed: bool) -> None:
        self.hp, self.packed = hp, packed
        q, kv = hp.n_heads * hp.head_dim, hp.n_kv_heads * hp.head_dim
        self.out = {"attn_q": q, "attn_k": kv, "attn_v": kv, "attn_output": hp.hidden,
                    "ffn_gate": hp.ffn, "ffn_up": hp.ffn, "ffn_down": hp.hidden,
                    "token_embd": hp.vocab, "output": hp.vocab}  # fmt: skip
        self.rng = np.random.default_rng(0)
        self.weight_bytes = 0  # what one block's matrices hold, as stored
        # the packed codes' buffers: a u4 Constant points into its numpy array without a copy, so
        # the array must outlive the compiled model (freed early, the CPU plugin read unmapped
        # memory while compiling: a member died silently in its probe, now and then)
        self.keep: list[np.ndarray] = []

    def vector(self, name: str, unpermute_heads: int = 0) -> Any:
        import openvino.opset13 as ops

        width = self.hp.head_dim if "q_norm" in name or "k_norm" in name else self.hp.hidden
        return ops.constant(np.ones(width, np.float32))

    def project(self, y: Any, names: list) -> list:
        import openvino.opset13 as ops

        width = y.get_partial_shape()[-1].get_length()
        out = []
        for name, _ in names:
            rows = self.out[name.split(".")[-2]]
            out.append(self._linear(y, rows, width) if self.packed else ops.matmul(
                y, ops.constant((self.rng.standard_normal((rows, width)) * 0.02).astype(np.float32)), False, True,
            ).output(0))  # fmt: skip
        return out

    def swiglu(self, x: Any, prefix: str, suffix: str = "") -> Any:
        from backends.openvino.weights import swiglu_of_projections

        return swiglu_of_projections(self, x, [prefix + f"ffn_{m}{suffix}.weight" for m in ("gate", "up", "down")])

    def _linear(self, y: Any, rows: int, cols: int) -> Any:
        import openvino as ov
        import openvino.opset13 as ops

        from backends import DEFAULT_KQUANT
        from backends.openvino import ggml_kernels
        from backends.openvino.weights import Packed, WeightBank, pack_u4

        if ggml_kernels.resolve(DEFAULT_KQUANT, "serving") == "ggml":  # what a stage serves with by default
            return self._ggml_linear(y, rows, cols)

        groups = cols // Q4_GROUP
        codes = self.rng.integers(0, 16, (rows, groups, Q4_GROUP), dtype=np.uint8)
        scale = np.full((rows, groups, 1), 0.01, np.float32)
        zero = np.full((rows, groups, 1), 8.0, np.float32)
        packed = pack_u4(codes)
        self.keep.append(packed)
        q = ops.constant(ov.Tensor(packed, codes.shape, ov.Type.u4))
        self.weight_bytes += rows * cols // 2 + 2 * rows * groups * 4
        return WeightBank.packed_linear(y, Packed(q, ops.constant(scale), ops.constant(zero), None, rows, cols))


    def _ggml_linear(self, y: Any, rows: int, cols: int) -> Any:
        """Random Q4_K blocks (small positive d and dmin) through the ggml op, as stages serve."""
        from backends.openvino import ggml_kernels

        raw = self.rng.integers(0, 256, (rows, cols // 256, Q4_K_BLOCK_BYTES), dtype=np.uint8)
        raw[..., 0:4] = np.array([0.01, 0.001], np.float16).view(np.uint8)  # d, dmin
        self.weight_bytes += raw.nbytes
        return ggml_kernels.matmul(y, raw, "Q4_K", rows, cols, self.keep)


def _probe_builder(blocks: int, shape: dict, packed: bool = False) -> Any:
    from backends.gguf.index import Hyperparams
    from backends.openvino.graph import StageBuilder

    hp = Hyperparams(arch="llama", n_blocks=blocks, context_length=4096, rope_base=10000.0, rms_eps=1e-5,
                     tied_embeddings=True, qkv_bias=False, rope_neox=True, **shape)  # fmt: skip

    class _Index:  # what StageBuilder reads of a ModelIndex
        hparams = hp

    return StageBuilder(_Index(), _ProbeWeights(hp, packed))


def _step_timer(blocks: int, shape: dict = BLOCK_PROBE_SHAPE, packed: bool = False) -> tuple[Callable[[], float], int]:
    """One decode step (a token) of a compiled probe stage of `blocks` blocks, KV state and all,
    and the bytes its blocks' matrices hold."""
    from backends.openvino.shard import core

    builder = _probe_builder(blocks, shape, packed)
    compiled = core().compile_model(builder.stage(0, blocks), "CPU")
    request = compiled.create_infer_request()
    hidden = shape["hidden"]
    length = [0]

    def feed(n: int) -> None:
        start = length[0]
        request.infer({"hidden_states": np.full((1, n, hidden), 0.1, np.float32),  # [B, L, H]
                       "attention_mask": np.ones((1, start + n), np.int64),  # [B, S]
                       "position_ids": np.arange(start, start + n, dtype=np.int64)[None],  # [B, L]
                       "beam_idx": np.zeros(1, np.int32)})  # fmt: skip
        length[0] = start + n

    def step() -> float:
        if length[0] == 0 or length[0] > BLOCK_PROBE_RESET:
            request.reset_state()
            length[0] = 0
            feed(BLOCK_PROBE_PAST)
        feed(1)
        return 1.0

    step.buffers = builder.w.keep  # type: ignore[attr-defined]  # the constants' memory lives as long as the request
    return step, builder.w.weight_bytes


def measure_block_openvino(settings: ProbeSettings) -> tuple[list[float], list[float]]:
    """(µs, GB/s) per run: what a transformer block costs beyond its bytes, (deep − shallow) /
    (BLOCK_PROBE_DEEP − 1) of the tiny block's decode step; and the rate its bytes stream at
    through the shards' compressed 4-bit FullyConnected, the wide block's bytes over its time
    less that fixed cost. The graphs are timed run by run in turn, so load falls on all alike."""
    shallow, _ = _step_timer(1)
    deep, _ = _step_timer(BLOCK_PROBE_DEEP)
    wide1, _ = _step_timer(1, WIDE_PROBE_SHAPE, packed=True)
    wide, held = _step_timer(WIDE_PROBE_DEEP, WIDE_PROBE_SHAPE, packed=True)
    block_bytes = held / WIDE_PROBE_DEEP
    one = replace(settings, runs=1, run_s=max(settings.run_s, BLOCK_PROBE_RUN_S))
    fixed, rates = [], []
    for _ in range(min(settings.runs, BLOCK_PROBE_RUNS) if settings.run_s < BLOCK_PROBE_RUN_S else settings.runs):
        t1, t9 = (1e6 / _timed_runs(f, one)[0] for f in (shallow, deep))
        w1, w3 = (1e6 / _timed_runs(f, one)[0] for f in (wide1, wide))
        us = max(0.0, (t9 - t1) / (BLOCK_PROBE_DEEP - 1))
        fixed.append(us)
        streamed_us = (w3 - w1) / (WIDE_PROBE_DEEP - 1) - us
        if streamed_us > 0:
            rates.append(block_bytes / streamed_us / 1e3)  # bytes/µs = MB/s; GB/s
    return fixed, rates


def measure_burst_openvino(period_s: float) -> float:
    """`cpu_burst` of the wide block's decode step, on the threads OpenVINO computes on under the
    quota (backends.openvino.shard.core)."""
    step, _ = _step_timer(1, WIDE_PROBE_SHAPE, packed=True)
    return measure_burst(step, period_s, quota_threads() or usable_cpus())


def measure_head_openvino(settings: ProbeSettings) -> list[float]:
    """µs of the head's token pick at the tiny shape: final norm, lm_head, top-1, one inference
    (what the head's pick pays beyond the lm_head's bytes)."""
    from backends.openvino.shard import core

    request = core().compile_model(_probe_builder(1, BLOCK_PROBE_SHAPE).head(), "CPU").create_infer_request()
    hidden = np.full((1, BLOCK_PROBE_SHAPE["hidden"]), 0.1, np.float32)  # [N, H]

    def pick() -> float:
        request.infer({0: hidden})
        int(request.get_tensor("token").data[0])
        return 1.0

    return [1e6 / rate for rate in _timed_runs(pick, settings)]


def measure_tflops(settings: ProbeSettings) -> list[float]:
    """TFLOP/s of a float32 n×n matmul (2·n³ operations)."""
    n = settings.matmul_n
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)

    def matmul() -> float:
        np.matmul(a, b)
        return 2.0 * n**3

    return [rate / 1e12 for rate in _timed_runs(matmul, settings)]


def measure_overhead_numpy(settings: ProbeSettings) -> list[float]:
    """µs per tiny numpy forward (the reference backend's fixed cost per stage and token)."""
    weight = np.full((OVERHEAD_WIDTH, OVERHEAD_WIDTH), 0.01, dtype=np.float32)
    token = np.ones((1, 1, OVERHEAD_WIDTH), dtype=np.float32)  # (B, T, C)

    def forward() -> float:
        (token @ weight).sum()  # (B, T, C)
        return 1.0

    return [1e6 / rate for rate in _timed_runs(forward, settings)]


# --- MLX: the same three figures, from MLX operations on MLX's default device ------------------


def mlx_device_label() -> str:
    import mlx.core as mx

    return "mlx GPU" if mx.default_device().type == mx.gpu else "mlx CPU"


def measure_bandwidth_mlx(buffer_bytes: int, settings: ProbeSettings) -> list[float]:
    """GB/s per run: an MLX max-reduction over a uint32 buffer, evaluated on the default device."""
    import mlx.core as mx

    words = mx.ones((buffer_bytes // 4,), dtype=mx.uint32)
    mx.eval(words)  # materialise (touch every page) before timing

    def read_once() -> float:
        mx.eval(mx.max(words))
        return float(words.nbytes)

    rates = _timed_runs(read_once, settings)
    return [rate / BYTES_PER_GB for rate in rates]


def measure_overhead_mlx(settings: ProbeSettings) -> list[float]:
    """µs per forward of a tiny MLX graph, evaluated and read back as a shard's step is."""
    import mlx.core as mx

    weight = mx.full((OVERHEAD_WIDTH, OVERHEAD_WIDTH), 0.01, dtype=mx.float32)
    token = np.ones((1, 1, OVERHEAD_WIDTH), dtype=np.float32)  # (B, T, C)
    mx.eval(weight)

    def forward() -> float:
        y = mx.array(token) @ weight  # (B, T, C)
        np.asarray(y).sum()  # evaluates and copies back, as MLXShard.forward hands on its output
        return 1.0

    return [1e6 / rate for rate in _timed_runs(forward, settings)]


def measure_tflops_mlx(settings: ProbeSettings) -> list[float]:
    """TFLOP/s of a float32 n×n MLX matmul (2·n³ operations), evaluated."""
    import mlx.core as mx

    n = settings.matmul_n
    key = mx.random.key(0)
    a = mx.random.normal((n, n), dtype=mx.float32, key=key)
    b = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.split(key)[1])
    mx.eval(a, b)

    def matmul() -> float:
        mx.eval(a @ b)
        return 2.0 * n**3

    return [rate / 1e12 for rate in _timed_runs(matmul, settings)]


def free_memory_bytes() -> float:
    """Available memory, lowered to the room left under this process's cgroup limit."""
    available = float(psutil.virtual_memory().available)
    room = cgroup_memory_room_bytes()
    return available if room is None else min(available, room)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache the kernel reports for cpu0, None if it reports none."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None
