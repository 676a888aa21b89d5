"""What a shard holds in memory on each backend: the planner's memory model inputs (issue 10).

Light on purpose (no backend imports): the host builds the plan's model entry from it.

RESIDENT_BYTES_PER_WEIGHT: bytes per weight of each GGUF type in the form the backend keeps
while serving, read off the constant forms (backends/openvino/weights.py, backends/mlx/weights.py):
- OpenVINO: codes + f32 scale (+ f32 zero point) per group (32; 16 for Q6_K); the CPU plugin's
  repacked copy is what stays resident (the graph's constants live in a spill file whose pages are
  dropped). Q4_K = 0.5 + 4/32 + 4/32 = 0.75, Q6_K = 1 + 4/16 = 1.25; floats are f32 (4).
  The small types (backends/openvino/lowbit.py): Q2_K 0.5 + 4/16 + 4/16 (the split form; 0.75 as u2
  with a zero point), Q3_K 0.5 + 4/16, IQ4_NL
  1 + 2/32, IQ4_XS 1 + 4/32, MXFP4 0.5 + 4/32 (not measured; read off the forms).
  Checked on the Llama-3.2-1B shape: a 4-block shard's anonymous memory grows by 53 MB a block
  (the forms give 53.2 MB; the GGUF holds 36.6 MB).
- MLX: packed codes + scale + bias per group of 32 (f16 for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, f32 for the
  K-quants); Q6_K is padded to groups of 32 (12 bits of codes + 4 bits of f32 scale/bias = 2 B),
  Q2_K and Q3_K too (2 and 3 bits of codes); IQ4_* as 8-bit codes, MXFP4 as 5-bit ones.
- reference: every weight dequantized to float64 (8 B; a yardstick, not a serving path).

PROCESS_BYTES: a session member's fixed resident set before any weight and beside its tokenizer:
Python, numpy, the backend runtime (OpenVINO's CPU plugin and its thread pools), QUIC, the session,
the HTTP API. TOKENIZER_BYTES_PER_VOCAB: the tokenizer every member loads (each serves the API),
per vocabulary entry: Llama 3's 128,256 tokens and 280k merges take 53 MB in Python (measured with
`load_tokenizer` alone, tests/test_bpe_ranks.py; 98 MB while merges were keyed by pairs of strings,
more while the index kept the metadata's vocabulary arrays too).
ANCHOR_BYTES: the host's extra (weight serving, the bulk lane, digests).
HEAD_WORK_BYTES_PER_VOCAB: the head's extra beside its lm_head (f32 logits, the plugin's top-1
scratch, the sampler), per vocabulary entry. RUN_PROCESS_BYTES: `kafila run`'s fixed part (no
QUIC, session or API), its tokenizer included.
Fitted on two runs of bench/memory_big.py on the Llama-3.2-1B shape (docs/BENCHMARKS.md, issue
10) as RSS minus the weights' resident forms: members without the head or the host 285, 302 and
316 MB (→ 165 MB + the tokenizer), the host 55 MB more, the head 46–52 MB beyond its lm_head,
`kafila run` 211 MB. MLX's figures are not measured (no Apple machine here): the OpenVINO ones.

PREFILL_WORK_BYTES: the working set of one prefill step in a stage, beside all of the above. The
chunk rule (kafila.session.ring.scheduler.prefill_chunk_tokens) sizes a prompt's steps to it, and every
process's fixed part reserves it: a member's peak is its resident set plus a long prompt's first
chunk. Measured on the CPU plugin (the peak over the resident set while a fresh prompt's first
chunk runs; bench.memory_big --prompt-tokens, docs/BENCHMARKS.md): 183–230 bytes per position
and unit of hidden size on the Llama shapes (the 1B's one stage 383 MB over its RSS for 1,024
positions, the 8B shape's members 386–483 MB for 512), hence PREFILL_WORK_BYTES_PER_POSITION.
SmolLM2-135M takes less (a diagnostic put it under half), so it is priced above what it takes.
"""

from __future__ import annotations

import ctypes

from backends.kept import KEPT_STATES

_FLOAT = {"F32": 4.0, "F16": 4.0, "BF16": 4.0}  # dense f32 in memory on every backend

RESIDENT_BYTES_PER_WEIGHT: dict[str, dict[str, float]] = {
    "openvino": {"Q4_0": 0.5625, "Q4_1": 0.75, "Q5_0": 1.0625, "Q5_1": 1.25, "Q8_0": 1.0625,
                 "Q4_K": 0.75, "Q5_K": 1.25, "Q6_K": 1.25, **_FLOAT,
                 "Q2_K": 1.0, "Q3_K": 0.75, "IQ4_NL": 1.0625, "IQ4_XS": 1.125, "MXFP4": 0.625},  # fmt: skip
    "mlx": {"Q4_0": 0.625, "Q4_1": 0.625, "Q5_0": 0.75, "Q5_1": 0.75, "Q8_0": 1.125,
            "Q4_K": 0.75, "Q5_K": 0.875, "Q6_K": 2.0, **_FLOAT,
            "Q2_K": 1.0, "Q3_K": 1.25, "IQ4_NL": 1.125, "IQ4_XS": 1.25, "MXFP4": 0.875},  # fmt: skip
    "reference": {},  # every type: float64
}
REFERENCE_BYTES_PER_WEIGHT = 8.0
# OpenVINO's mixture-of-experts tensors (`*_exps.weight`, backends/openvino/moe.py's Experts):
# Gathered by expert before they are decompressed, so not the FullyConnected forms above: u4 / i4
# codes for the integer 4-bit types, one byte a code for the rest, f32 scales (and offsets)
EXPERT_BYTES_PER_WEIGHT: dict[str, dict[str, float]] = {
    "openvino": {"Q4_0": 0.625, "Q4_1": 0.75, "Q4_K": 0.75, "Q2_K": 1.0, "Q3_K": 0.75, "Q5_0": 1.125,
                 "Q5_1": 1.25, "Q5_K": 1.25, "Q6_K": 1.25, "Q8_0": 1.125, "IQ4_NL": 1.125, "IQ4_XS": 1.125,
                 "MXFP4": 1.125},  # fmt: skip
}
EXPERT_TENSOR_SUFFIX = "_exps.weight"
# --kquant ggml (backends/openvino/ggml_kernels.py): a quantized matrix, experts included, is held
# as the file's own blocks (or ggml's repacked copy of them, the same bytes, with the file's pages
# given back), so a weight takes its GGUF type's bytes: a block's bytes over its weights.
GGML_KIND = "openvino-ggml"
GGML_BYTES_PER_WEIGHT: dict[str, float] = {
    "Q4_0": 18 / 32, "Q4_1": 20 / 32, "Q5_0": 22 / 32, "Q5_1": 24 / 32, "Q8_0": 34 / 32, "Q2_K": 84 / 256,
    "Q3_K": 110 / 256, "Q4_K": 144 / 256, "Q5_K": 176 / 256, "Q6_K": 210 / 256, "IQ4_NL": 18 / 32,
    "IQ4_XS": 136 / 256, "MXFP4": 17 / 32,
}  # fmt: skip
RESIDENT_BYTES_PER_WEIGHT[GGML_KIND] = {**GGML_BYTES_PER_WEIGHT, **_FLOAT}
EXPERT_BYTES_PER_WEIGHT[GGML_KIND] = dict(GGML_BYTES_PER_WEIGHT)

PROCESS_BYTES: dict[str, float] = {"openvino": 165e6, "mlx": 165e6, "reference": 165e6}
ANCHOR_BYTES: dict[str, float] = {"openvino": 55e6, "mlx": 55e6, "reference": 55e6}
RUN_PROCESS_BYTES: dict[str, float] = {"openvino": 211e6, "mlx": 211e6, "reference": 211e6}
for _table in (PROCESS_BYTES, ANCHOR_BYTES, RUN_PROCESS_BYTES):
    _table[GGML_KIND] = _table["openvino"]  # the same process; only its matrices' form differs


def memory_kind(backend: str, form: str) -> str:
    """The key of these tables for a stage on `backend` whose K-quant form is `form` (an OpenVINO
    stage's resolved --kquant: "ggml" holds the file's blocks, the other forms the constants)."""
    return GGML_KIND if backend == "openvino" and form == "ggml" else backend
TOKENIZER_BYTES_PER_VOCAB = 450
# A hybrid slot holds its recurrent state up to 2 + KEPT_STATES times (backends/openvino/recurrent.py,
# the MLX shard alike): the live state, its copy at the start of the slot's last step of several
# positions (a verify step's cut goes back into it) and the copies kept where its last turns'
# messages ended (prompt caching goes back to them: backends/kept.py). The plan prices them all.
RECURRENT_STATE_COPIES = 2 + KEPT_STATES
# A sliding-window layer's KV holds the newest columns only (backends/window.py; both backends):
# its window, at most WINDOW_DROP_AT(window) more before they are dropped, and a copy of the window
# for each kept state. The plan prices them per request, not per token of context.
WINDOW_DROP_MIN = 16
# visible positions kept beyond the window (at most the window again), so a later step may mask that
# many fed in earlier steps (a draft model's chain rewinds the drafts it fed one at a time:
# kafila/session/ring/speculation/draft.py)
WINDOW_REWIND = 64


def window_drop_at(window: int) -> int:
    """Columns a slot's windowed variables may hold beyond what it needs before they are dropped."""
    return max(WINDOW_DROP_MIN, window // 2)


def window_rewind(window: int) -> int:
    """Visible positions a windowed layer keeps beyond its window (WINDOW_REWIND)."""
    return min(WINDOW_REWIND, window)


def window_held_positions(window: int) -> int:
    """Positions a request's windowed layer holds at most: its live KV and its kept windows."""
    return window + window_rewind(window) + window_drop_at(window) + KEPT_STATES * (window - 1)


PREFILL_WORK_BYTES_PER_POSITION = 208  # per unit of hidden size
PREFILL_WORK_BYTES = 416 << 20
# A runtime keeps the buffers of the largest step it has run (the CPU plugin its intermediate
# memory, MLX its buffer cache), so after one long prompt a process held that step's working set
# for the rest of the session (the 8B shape's members: 1.42–1.56× their shard + KV). Shards hand
# it back once the steps are small again (the prompt's chunks are done), not between chunks.
RELEASE_WORK_BYTES = 64 << 20
RELEASE_MIN_ROW = 16  # a step is large only with a row this long (a batch of decode rows is not)


def large_step(rows: int, length: int, hidden: int) -> bool:
    """Whether a step of `rows` × `length` positions leaves a working set worth handing back."""
    return length >= RELEASE_MIN_ROW and rows * length * hidden * PREFILL_WORK_BYTES_PER_POSITION > RELEASE_WORK_BYTES


class LargeSteps:
    """When a shard should hand a long prompt's working set back: `due(rows, length)`, asked before
    each step, is True for the first small step after a large one (the prompt's chunks are done),
    never between the chunks. `releases` counts the True answers (the tests read it)."""

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden
        self.pending = False  # a large step ran since the last release
        self.releases = 0

    def due(self, rows: int, length: int) -> bool:
        large = large_step(rows, length, self.hidden)
        if self.pending and not large:
            self.pending = False
            self.releases += 1
            return True
        self.pending = self.pending or large
        return False


HEAD_WORK_BYTES_PER_VOCAB = 390


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl)
        return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    Python objects built and dropped by the hundred thousand (a vocabulary's metadata while its
    tokenizer is built) leave their pages in the process otherwise: 20 MB for Llama 3's."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def bytes_per_weight(backend: str, qtype: str) -> float:
    """Resident bytes of one weight of GGUF type `qtype` on `backend` (KeyError: unknown backend)."""
    table = RESIDENT_BYTES_PER_WEIGHT[backend]
    if backend == "reference":
        return REFERENCE_BYTES_PER_WEIGHT
    return table.get(qtype, 4.0)


def resident_bytes(backend: str, tensors) -> float:
    """Resident bytes of `tensors` (TensorInfo: .name, .qtype, .shape) on `backend`."""
    experts = EXPERT_BYTES_PER_WEIGHT.get(backend, {})
    total = 0.0
    for t in tensors:
        n = 1
        for d in t.shape:
            n *= int(d)
        expert = getattr(t, "name", "").endswith(EXPERT_TENSOR_SUFFIX) and t.qtype in experts
        total += n * (experts[t.qtype] if expert else bytes_per_weight(backend, t.qtype))
    return total
