"""How many prompt positions one prefill step feeds (the head's scheduler and the local chain
share the rule): the first chunk of a prompt, and the chunks after it."""

from __future__ import annotations

from backends.memory import PREFILL_WORK_BYTES, PREFILL_WORK_BYTES_PER_POSITION
from kafila.session.wire.frames import MAX_FRAME_BYTES

F32_BYTES = 4


def prefill_chunk_tokens(hidden: int, frame_bytes: int = MAX_FRAME_BYTES,
                         work_bytes: int = PREFILL_WORK_BYTES) -> int:  # fmt: skip
    """The most prompt positions one prefill step feeds (the rule, in one place):

        n × hidden × 4 B                                ≤ frame_bytes   (one activation frame)
        n × hidden × PREFILL_WORK_BYTES_PER_POSITION    ≤ work_bytes    (one stage's working set,
                                                                         backends.memory: measured)

    hidden 4096 → 512 positions a step, 2048 → 1024, 576 → 3640; at least 1."""
    return max(1, min(frame_bytes // (hidden * F32_BYTES), work_bytes // (hidden * PREFILL_WORK_BYTES_PER_POSITION)))


# A prompt's chunks after its first attend to the KV already in the slot, and the CPU plugin runs
# any such step in its one-query-at-a-time attention (docs/BENCHMARKS.md, "Prefill"), so chunks
# of a quarter cost no more time than full ones (bench.prefill --equal-chunks: full chunks took
# 1.10-1.13x as long on the 1B shape) and hold a smaller working set while they run. The first
# chunk keeps its full size: a fresh prompt takes the fast attention kernel.
LATER_CHUNK_SHARE = 4


def later_chunk_tokens(chunk_tokens: int) -> int:
    """Positions of a prefill step after a prompt's first (`chunk_tokens` positions)."""
    return max(1, chunk_tokens // LATER_CHUNK_SHARE)


def next_chunk(done: int, chunk_tokens: int) -> int:
    """Positions of the prefill step that follows `done` fed positions of a prompt."""
    return chunk_tokens if done == 0 else later_chunk_tokens(chunk_tokens)
