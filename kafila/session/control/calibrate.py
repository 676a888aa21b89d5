"""The model's own blocks on the host's machine: what the planner scales the probe's figures by.

A member's probe (kafila/probe.py) times a generic block at two widths before it knows the
model, and eq. 2 prices a block as that fixed cost plus its bytes at the probed rate. A real
model's blocks cost another amount per byte (narrower or wider matrices than the probe's, other
quant forms, its own head count), its stage pays Python and tensor set-up beyond the probe's
tiny graph, and in a ring whose members share one machine each forward meets caches the others
have just used. The host holds the file, so it times the model's own blocks before its first
plan (once the members are in: their probes are done), the median of single steps of a stage of
CALIBRATE_BLOCKS blocks against one of one, back to back and each step after a read of the
model's bytes (what the ring's other stages read between two of its forwards; at most twice the
last-level cache), the four timed in turn; the plan carries the ratios as the model's fields (planner.fleet.Model):

- `block_scale`: the real per-block time over what the host's own probe predicts for those
  bytes (applied to every member's per-block term: the shape's cost relative to the probe's
  block is the model's, the device's speed is each member's probe);
- `stage_us`: the real stage's fixed time beyond the probe's dispatch overhead;
- `embed_us`: what the head's stage pays for the token embedding (a stage of one block with
  the embedding against one without);
- `shared_scale`, `shared_us`: how much slower a block, and how much longer the fixed part, when
  other work ran between two forwards (applied to members that share a machine).

`calibrate` returns {} where it cannot measure (another backend, a model too small, a failure):
the plan then prices with the probe alone, as before.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

CALIBRATE_BLOCKS = 3  # the deeper stage's blocks (the shallow one has 1)
CALIBRATE_STEPS = 25  # timed steps per figure (the median is kept)
CALIBRATE_PAST = 32  # positions of KV before the timed steps
SCALE_BOUNDS = (0.25, 8.0)  # a ratio outside these is a measurement gone wrong: not used
CALIBRATE_MAX_BYTES = 1 << 30  # the timed blocks' bytes at most (a big MoE's blocks: not timed)


def calibrate(index: Any, probe: dict, kquant: str, precision: str) -> dict:
    """The model fields above for `index` (a backends.gguf ModelIndex) from the host's `probe`
    (its descriptor: overhead_us, block_us, block_gbps), its blocks built as the session's
    stages build them (`kquant` form, `precision`); {} when not measurable."""
    from backends import load_shard
    from backends.base import ShardSpec
    from kafila.probe import last_level_cache_bytes

    n = index.hparams.n_blocks
    if probe.get("block_gbps") is None or probe.get("block_us") is None or probe.get("overhead_us") is None or n < 2:
        return {}
    first, deep = (1, CALIBRATE_BLOCKS) if n > CALIBRATE_BLOCKS else (0, n)
    shards = [load_shard("openvino", ShardSpec(index.path, first, first + k, embed=embed, head=False), precision,
                         index=index, kquant=kquant) for k, embed in ((1, False), (deep, False), (1, True))]  # fmt: skip
    steps = [_stepper(s, index.hparams.carried) for s in shards]
    # between two of a stage's forwards the ring's other stages read the rest of the model: a model
    # the last-level cache holds whole stays in it (a 480 MB L3 holds a 135M model; a 32 MB one
    # does not), so read what the model's stages read a token, at most twice that cache
    ring_reads = _read_bytes(index, index.block_bytes) * n + index.head_bytes
    most = max(64 << 20, 2 * (last_level_cache_bytes() or 0))
    junk = np.ones(int(min(most, max(ring_reads, 1 << 20))) // 8, np.uint64)

    def cold() -> None:
        np.bitwise_or.reduce(junk)

    w1, wk, c1, ck, e1 = medians_ms([(steps[0], None), (steps[1], None), (steps[0], cold), (steps[1], cold),
                                      (steps[2], None)])  # fmt: skip
    per_warm, per_cold = (wk - w1) / (deep - 1), (ck - c1) / (deep - 1)
    mean_bytes = _read_bytes(index, sum(t.n_bytes for b in range(first, first + deep) for t in index.block_tensors(b))
                             / deep)  # fmt: skip
    predicted = probe["block_us"] / 1e3 + mean_bytes / (probe["block_gbps"] * 1e6)
    out = {"block_scale": per_warm / predicted, "shared_scale": per_cold / per_warm if per_warm > 0 else 0.0}
    if not all(SCALE_BOUNDS[0] <= v <= SCALE_BOUNDS[1] for v in out.values()):
        return {}
    fixed_warm, fixed_cold = w1 - per_warm, c1 - per_cold
    out["stage_us"] = max(0.0, fixed_warm * 1e3 - probe["overhead_us"])
    out["shared_us"] = max(0.0, (fixed_cold - fixed_warm) * 1e3)
    out["embed_us"] = max(0.0, (e1 - w1) * 1e3)
    return {k: round(v, 4) for k, v in out.items()}


def too_big(index: Any) -> bool:
    """Whether timing CALIBRATE_BLOCKS + 1 of `index`'s blocks would hold more than
    CALIBRATE_MAX_BYTES (the host would hold them beside its own stage for a moment)."""
    return (CALIBRATE_BLOCKS + 1) * index.block_bytes > CALIBRATE_MAX_BYTES


def _read_bytes(index: Any, block_bytes: float) -> float:
    """What a token reads of a block of `block_bytes`: of an MoE block, the dense part and k of E
    experts (as the planner prices it, kafila/session/control/pricing.model_reads)."""
    from kafila.session.control.pricing import model_reads
    from planner.fleet import Model

    reads = {k: v for k, v in model_reads(index).items() if k in ("expert_count", "experts_used", "expert_bytes")}
    return Model(name="", blocks=1, block_bytes=block_bytes, head_bytes=0.0, kv_bytes_per_token_per_block=0.0,
                 **reads).block_read_bytes  # fmt: skip


def _stepper(shard: Any, hidden: int):
    """One decode step of `shard` (a fresh slot every 128 steps, so its KV stays short); token
    ids into a shard that holds the embedding."""
    x = (np.arange(CALIBRATE_PAST, dtype=np.int64) + 100 if shard.spec.embed
         else np.full((CALIBRATE_PAST, hidden), 0.01, np.float32))  # fmt: skip
    state = {"slot": None, "n": 0}

    def step() -> None:
        if state["slot"] is None or state["n"] >= CALIBRATE_PAST + 128:
            if state["slot"] is not None:
                shard.close_slot(state["slot"])
            state["slot"] = shard.open_slot()
            shard.forward(state["slot"], x, np.arange(CALIBRATE_PAST), np.ones(CALIBRATE_PAST, np.int64))
            state["n"] = CALIBRATE_PAST
        n = state["n"]
        shard.forward(state["slot"], x[:1], np.arange(n, n + 1), np.ones(n + 1, np.int64))
        state["n"] = n + 1

    step()  # compiled and warm before any step is timed
    return step


def medians_ms(ways: list, rounds: int = CALIBRATE_STEPS) -> list[float]:
    """The median ms of each (step, before) way's step, the ways timed in turn round by round so
    that load drifting on the machine falls on all alike; `before` (None: nothing) runs untimed."""
    times: list[list[float]] = [[] for _ in ways]
    for _ in range(rounds):
        for (step, before), out in zip(ways, times):
            if before is not None:
                before()
            t0 = time.perf_counter()
            step()
            out.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


__all__ = ["CALIBRATE_BLOCKS", "calibrate", "medians_ms", "too_big"]
