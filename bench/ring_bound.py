"""The many-users bound: what a ring of stages on one machine could deliver, from batched-step
costs measured in this process (bench.multiuser prints it beside what the session measured).

For a plan whose stage s runs blocks [first_s, last_s) (the head's with the embedding and the
lm_head), t_s(b) is one decode step of b rows through that stage, one `forward_batch` (rows of
different cache lengths, bench.batch_rows.Rows) and at the head the rows' token picks (one
lm_head over them, `greedy_rows`, as the ring's micro-batch), measured here, in one process, the
stages timed in turn as the ring runs them. A ring of those stages on one machine computes one stage at a time (the core lock,
kafila/session/ring/cores.py), so with N users split into g micro-batches of b = ⌈N/g⌉ rows:

    C(b)     = Σ_s t_s(b)                      one micro-batch's compute round the ring
    round(g) = max(g · C(b), C(b) + H)         the machine computes every batch once, and no
                                               batch can start its next step before it is back
    bound(N) = max over g = 1..N of  N / round(g)   tokens per second, decode only

H is the network part of a trip: the head's measured `network_ms` (a trip's time less the
stages' compute, /status) where it has one, else the ring edges' RTT/2 summed. Prefill, the
HTTP streaming and the API processes are outside the bound (they cost the measured figure).

With speculation (bench.dipsd): each user's step carries l drafts, so a micro-batch of b users
runs b·(l + 1) rows, and yields u(l) = (1 − α^(l+1)) / (1 − α) tokens a user (planner.dipsd's
geometric acceptance, α measured in the same run). The drafters (d ms a draft token, the draft
model's one-token step timed here) compute on the same cores as the stages:

    round(g, l)   = max(g · C(b·(l+1)) + N · l · d,   the machine computes every batch and
                        C(b·(l+1)) + H)               every draft once; a batch's trip
    spec_bound(N) = max over g = 1..N, l = 0..L of  N · u(l) / round(g, l)

At l = 0 it is bound(N). It is an upper bound for drafting at the origins and at the head
alike: a drafter drafting ahead while its step is out hides its drafts in the trip at best,
which the second term grants whole (it leaves the drafts out of a batch's own cycle).
"""

from __future__ import annotations

import math

import numpy as np

from planner.dipsd import expected_accepted

STEPS = 3
REPEATS = 3


def stage_costs(model_path: str, stages: list[tuple[int, int]], rows: list[int], context: int = 64,
                precision: str = "serving", kquant: str | None = None) -> list[dict[int, float]]:  # fmt: skip
    """Per stage (the first is the head's: embedding and lm_head), {b: ms of one b-row decode step}.
    The stages are timed in turn, round after round, as a ring on one machine runs them: each
    stage's step meets the caches the others' steps left (timed alone, back to back, a stage
    whose weights fit the last-level cache would find them there every time)."""
    from backends import DEFAULT_KQUANT, ShardSpec
    from backends.gguf import open_model
    from backends.openvino import OpenVINOShard
    from bench.batch_rows import Rows
    from kafila.session.control.calibrate import medians_ms

    index = open_model(model_path)
    kquant = kquant or DEFAULT_KQUANT
    shards = [OpenVINOShard(ShardSpec(index.path, first, last, embed=i == 0, head=i == 0), precision, index=index,
                            kquant=kquant) for i, (first, last) in enumerate(stages)]  # fmt: skip
    out: list[dict[int, float]] = [{} for _ in shards]
    for b in rows:
        rng = np.random.default_rng(b)
        prompts = [rng.integers(0, 1000, context + 8 * j) for j in range(b)]
        groups = [Rows(shard, prompts, index.hparams.hidden, rng) for shard in shards]
        try:
            # the head's step ends in its rows' token picks (one lm_head over them, as the ring's
            # micro-batch: kafila/session/ring/picks.py)
            steps = [_head_step(shards[0], groups[0])] + [g.step_batched for g in groups[1:]]
            for step in steps:
                step()  # the group's join and first-shape compile, outside the clock
            for costs, ms in zip(out, medians_ms([(step, None) for step in steps], REPEATS * STEPS)):
                costs[b] = ms
        finally:
            for g in groups:
                g.close()
    return out


def _head_step(shard, rows):
    return lambda: shard.greedy_rows(rows.step_batched())


def session_ring(head_status: dict) -> tuple[list[tuple[int, int]], float]:
    """A session's stages as block ranges (the head's first, ring order) and H, from the head's
    /status: its measured network ms per trip, else the ring edges' RTT/2 summed."""
    counts = [head_status["stages"][n]["blocks"] for n in head_status["plan"]["ring"]]
    stages = [(sum(counts[:i]), sum(counts[: i + 1])) for i in range(len(counts))]
    network_ms = head_status.get("network_ms")
    if network_ms is None:
        network_ms = sum((e.get("rtt_ms") or 0.0) / 2 for e in head_status.get("edges") or [])
    return stages, float(network_ms)


def ring_compute_ms(costs: list[dict[int, float]], b: int) -> float:
    """C(b): one b-row micro-batch's compute through every stage (the measured row count at or
    above b, else the largest measured scaled linearly)."""
    total = 0.0
    for c in costs:
        above = [n for n in c if n >= b]
        total += c[min(above)] if above else c[max(c)] * b / max(c)
    return total


def bound(costs: list[dict[int, float]], users: int, network_ms: float) -> dict:
    """bound(N) and the micro-batch count g that gives it (see the module's docstring)."""
    best = None
    for g in range(1, users + 1):
        b = math.ceil(users / g)
        c = ring_compute_ms(costs, b)
        rate = users / max(g * c, c + network_ms) * 1000
        if best is None or rate > best["tok_s"]:
            best = {"tok_s": rate, "groups": g, "rows": b, "compute_ms": c}
    return best


def spec_bound(costs: list[dict[int, float]], users: int, network_ms: float, alpha: float, draft_ms: float,
               max_draft: int = 8) -> dict:  # fmt: skip
    """spec_bound(N), with the micro-batch count g and the draft length l that give it (see the
    module's docstring; l = 0 throughout is bound(N))."""
    alpha = min(max(alpha, 0.0), 0.999)  # every draft accepted: u(l) = l + 1, near enough
    best = None
    for length in range(max_draft + 1):
        tokens = users * expected_accepted(length, alpha)
        for g in range(1, users + 1):
            b = math.ceil(users / g)
            c = ring_compute_ms(costs, b * (length + 1))
            round_ms = max(g * c + users * length * draft_ms, c + network_ms)
            rate = tokens / round_ms * 1000
            if best is None or rate > best["tok_s"]:
                best = {"tok_s": rate, "groups": g, "rows": b, "draft": length, "compute_ms": c}
    return best
