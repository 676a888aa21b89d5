"""OpenVINOShard: one compiled stage model, one InferRequest (one stateful KV) per slot.

The head shard compiles a second small model (final norm + lm_head + top-1) used by `logits`
and `greedy`; when it also holds the last block, the greedy top-1 is a second output of the stage
graph itself and the head model is compiled only if `logits` (or greedy on other states) is asked. Weight constants live in an unlinked spill file (WeightBank(spill=True)); once the plugin has
repacked them, their pages are dropped from the resident set (`release_weight_pages`), so a
shard's memory is about the plugin's own copy of the weights, not twice the model.
Inputs are wrapped as shared-memory tensors and outputs read in place, so a decode
step costs one `infer()` per shard plus a few microseconds of Python.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import openvino as ov

from backends.base import ShardSpec
from backends.openvino.graph import StageBuilder
from backends.openvino.weights import WeightBank
from kafila.models import ModelIndex, open_model

# serving: the CPU plugin's defaults, exactly what openvino_genai.LLMPipeline(gguf) compiles with
# on CPU (bf16 inference where the CPU has it, u8 KV cache, dynamic quantization group 32).
SERVING_CONFIG: dict[str, str] = {}
# f32: for numerical comparison with the float64 reference.
F32_CONFIG = {
    "INFERENCE_PRECISION_HINT": "f32",
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
}
CONFIGS = {"serving": SERVING_CONFIG, "f32": F32_CONFIG}


# The CPU plugin prepares (repacks) weights at the first inferences of each shape kind
# (prefill, decode); after this many forwards the original constants' pages are released.
RELEASE_AFTER = 3


def _trim_heap() -> None:
    """Give freed heap memory (build-time temporaries) back to the system (glibc only)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


@functools.lru_cache(maxsize=1)
def core() -> ov.Core:
    """The process's one OpenVINO Core (created on first use, never at import)."""
    return ov.Core()


class OpenVINOShard:
    """A block range of a GGUF model compiled with OpenVINO (see backends.base.Shard)."""

    def __init__(self, spec: ShardSpec, precision: str = "serving", device: str = "CPU",
                 index: ModelIndex | None = None, config: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.precision = precision
        self.index = index if index is not None else open_model(spec.model_path)
        self.index.check_range(spec.first, spec.last)
        cfg = dict(CONFIGS[precision]) if config is None else dict(config)
        bank = WeightBank(self.index, spill=True)
        builder = StageBuilder(self.index, bank)
        # A shard with the head and the last block computes the greedy token in its stage graph;
        # its separate head graph (logits, or greedy on other hidden states) is compiled lazily.
        self._fold = spec.head and spec.last == self.index.hparams.n_blocks
        self.compiled = core().compile_model(builder.stage(spec.first, spec.last, spec.embed, self._fold), device, cfg)
        self._head = None
        self._head_build = (builder, device, cfg) if spec.head else None
        if spec.head and not self._fold:
            self._head_request()
        self._last: tuple[np.ndarray, int] | None = None  # (hidden returned by forward, its greedy token)
        # Constants point into these buffers; the compiled models may too. Keep them alive. They
        # live in a spill file whose pages are dropped from the resident set once the plugin has
        # repacked the weights (after the first forwards, RELEASE_AFTER), see WeightBank.spill.
        self._bank = bank
        self._forwards = 0
        _trim_heap()
        self._reqs: dict[int, ov.InferRequest] = {}
        self._spare: list[ov.InferRequest] = []
        self._beam = ov.Tensor(np.zeros(1, dtype=np.int32))
        self._x_dtype = np.int64 if spec.embed else np.float32

    # --- slots -------------------------------------------------------------------------

    def open_slot(self) -> int:
        req = self._spare.pop() if self._spare else self.compiled.create_infer_request()
        req.reset_state()
        req.set_input_tensor(3, self._beam)
        slot = next(i for i in range(len(self._reqs) + 1) if i not in self._reqs)
        self._reqs[slot] = req
        return slot

    def close_slot(self, slot: int) -> None:
        req = self._reqs.pop(slot)
        req.reset_state()
        self._spare.append(req)

    def capture(self, slot: int) -> Any:
        """{variable name: a copy of its state} (the plugin hands states back at their own precision)."""
        return {s.name: s.state.data.copy() for s in self._reqs[slot].query_state()}

    def restore(self, slot: int, state: Any) -> None:
        for s in self._reqs[slot].query_state():
            s.state = ov.Tensor(np.ascontiguousarray(state[s.name]))

    # --- compute -----------------------------------------------------------------------

    def forward(self, slot: int, x: np.ndarray, positions: np.ndarray, mask: np.ndarray) -> np.ndarray:
        req = self._reqs[slot]
        x = np.ascontiguousarray(x, dtype=self._x_dtype)[None]  # [1, n] ids or [1, n, H]
        req.set_input_tensor(0, ov.Tensor(x, shared_memory=True))
        req.set_input_tensor(1, ov.Tensor(np.ascontiguousarray(mask, dtype=np.int64)[None], shared_memory=True))
        req.set_input_tensor(2, ov.Tensor(np.ascontiguousarray(positions, dtype=np.int64)[None], shared_memory=True))
        req.infer()
        if self._forwards < RELEASE_AFTER:
            self._forwards += 1
            self.release_weight_pages()
        hidden = req.get_output_tensor(0).data[0].copy()  # [n, H]
        if self._fold:
            self._last = (hidden, int(req.get_output_tensor(1).data[0]))
        return hidden

    def release_weight_pages(self) -> None:
        """Drop the constants' file pages from the resident set (they come back if read)."""
        self._bank.release_pages()
        _trim_heap()

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        head = self._head_request()
        head.set_input_tensor(0, ov.Tensor(np.ascontiguousarray(hidden, dtype=np.float32), shared_memory=True))
        head.infer()
        return head.get_output_tensor(0).data.copy()  # [n, V]

    def greedy(self, hidden: np.ndarray) -> int:
        """The top-1 token after the last row of hidden [n, H] (computed in the graph). When
        `hidden` is the array the last `forward` returned on a folded shard, no inference runs."""
        if self._last is not None and hidden is self._last[0]:
            return self._last[1]
        head = self._head_request()
        last = np.ascontiguousarray(hidden[-1:], dtype=np.float32)  # [1, H]
        head.set_input_tensor(0, ov.Tensor(last, shared_memory=True))
        head.infer()
        return int(head.get_output_tensor(1).data[0])

    def _head_request(self) -> ov.InferRequest:
        if self._head is None:
            if self._head_build is None:
                raise ValueError(f"shard [{self.spec.first}, {self.spec.last}) holds no head")
            builder, device, cfg = self._head_build
            self._head = core().compile_model(builder.head(), device, cfg).create_infer_request()
        return self._head

    def runtime_model(self) -> ov.Model:
        """The compiled stage as the plugin runs it (for fusion checks)."""
        return self.compiled.get_runtime_model()

    def head_runtime_model(self) -> ov.Model:
        """The compiled head (final norm + lm_head + top-1) as the plugin runs it."""
        return self._head_request().get_compiled_model().get_runtime_model()
