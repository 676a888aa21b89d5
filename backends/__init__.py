"""Shard runtimes behind one interface (backends.base.Shard), chosen by name.

Backends import their heavy libraries only when a shard is built, so a machine without MLX
(or OpenVINO) can still use the others; `status(name)` says why one is unavailable.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from backends.base import HeadOps, Shard, ShardSpec

# name -> (module, class, the import that must work, how to install it)
_BACKENDS = {
    "reference": ("backends.reference", "ReferenceShard", "numpy", "pip install numpy"),
    "openvino": ("backends.openvino", "OpenVINOShard", "openvino", "pip install openvino"),
    "mlx": ("backends.mlx", "MLXShard", "mlx.core", "pip install 'mlx[cpu]' mlx-lm (Linux) or mlx mlx-lm (macOS)"),
}
NAMES = tuple(_BACKENDS)
PRECISIONS = ("serving", "f32")  # serving: the backend's fast defaults; f32: f32 compute and KV
# The OpenVINO stage's form of K-quant (Q4_K, Q5_K) matrices (backends/openvino/weights.py): exact
# (the file's weights to f32 rounding), fast (integer zero points, the CPU plugin's fused kernel)
# or ggml (every quantized matrix by ggml's own kernels, llama.cpp's arithmetic:
# backends/openvino/ggml_kernels.py)
# auto: ggml at serving precision where its kernels build here, else exact (and always exact at
# --precision f32, whose yardstick is the file's exact weights). The default stays exact: ggml
# decodes 1.8x and prefills 1.3x faster (0.85x and 0.83x llama.cpp on the real 1.5B file,
# docs/BENCHMARKS.md) and holds the file's blocks (backends.memory), but its 8-bit activation rounding, llama.cpp's,
# makes an answer depend on how its prompt was cut into steps and on the slot's past at near-ties
# (tests/test_ggml_kernels.py), where the exact form's answers do not.
KQUANTS = ("auto", "exact", "fast", "ggml")
DEFAULT_KQUANT = "exact"


@dataclass(frozen=True)
class BackendStatus:
    name: str
    available: bool
    reason: str  # why not, with the install hint; "" when available


def status(name: str) -> BackendStatus:
    if name not in _BACKENDS:
        return BackendStatus(name, False, f"unknown backend {name!r} (choose from {', '.join(NAMES)})")
    _, _, probe, hint = _BACKENDS[name]
    try:
        importlib.import_module(probe)
    except Exception as exc:  # ImportError, or a library that fails to initialise here
        return BackendStatus(name, False, f"backend {name} is unavailable ({type(exc).__name__}: {exc}); install with: {hint}")
    return BackendStatus(name, True, "")


def load_shard(name: str, spec: ShardSpec, precision: str = "serving", **options) -> Shard:
    """Build a shard of `spec` on backend `name` (raises BadInput when it is unavailable)."""
    from backends.errors import BadInput  # backends depend on nothing of the app but its error type

    st = status(name)
    if not st.available:
        raise BadInput(st.reason)
    if precision not in PRECISIONS:
        raise BadInput(f"unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    if name not in ("openvino", "mlx"):  # delta-net (hybrid) layers: OpenVINO and MLX (issue 35)
        from backends.gguf import open_model

        index = options.get("index") or open_model(spec.model_path)
        if index.hparams.hybrid is not None:
            raise BadInput(f"{index.hparams.arch} (gated delta-net layers) is served on the openvino and mlx backends "
                           "only; choose one of them")
    module, cls, _, _ = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(spec, precision=precision, **options)


__all__ = ["DEFAULT_KQUANT", "KQUANTS", "NAMES", "PRECISIONS", "BackendStatus", "HeadOps", "Shard", "ShardSpec", "load_shard", "status"]
