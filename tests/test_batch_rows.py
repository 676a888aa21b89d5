"""Batched decode rows (`forward_batch`; OpenVINO: backends/openvino/rows.py, MLX:
backends/mlx/model.py `block_rows`): several slots' steps as one inference give what each slot's
own `forward` gives — tightly at f32, token for token and closely at serving precision — with rows
of different cache lengths, rows leaving and joining mid-way, uneven n (a drafted row among
decode rows), masked rewind inside a batch, and (OpenVINO, where a batch has a state of its own)
capture / restore / close_slot on slots that are rows of a group. MLX tests skip with its install
hint where mlx cannot be imported."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from backends import ShardSpec, load_shard
from tests.mlx_chain import MLX

# ‖batched − solo‖∞ / ‖solo‖∞ per hidden state. Measured ≈ 3e-7 at f32 (summation order over the
# padded cache) and ≈ 6e-5 at serving precision (bf16, u8 KV, dynamic quantization) on an
# AVX-512-BF16 CPU (OpenVINO; MLX's rows are bit-identical at both); a padding or mask error
# gives ≈ 0.4 at either precision.
REL_BOUND = 1e-5
SERVING_REL_BOUND = 5e-3
PROMPTS = ([5, 60, 200, 7, 258, 33], [17, 3], [99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109], [42])


@dataclass
class Seq:
    """One request as a caller drives it: a slot per shard, the physical mask, the logical position."""

    slots: list[int]
    valid: list[int] = field(default_factory=list)  # over physical positions
    logical: int = 0
    tokens: list[int] = field(default_factory=list)

    def inputs(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        mask = np.array(self.valid + [1] * n, np.int64)  # [cache_len + n]
        return np.arange(self.logical, self.logical + n), mask

    def advance(self, n: int) -> None:
        self.valid += [1] * n
        self.logical += n

    def rewind(self, k: int) -> None:
        self.valid[len(self.valid) - k :] = [0] * k
        self.logical -= k


class Chain:
    """Shards in a row, driven solo (`feed`) or batched (`feed_batch`); hidden states kept."""

    def __init__(self, index, ranges, precision, backend="openvino"):
        n = len(ranges)
        self.backend = backend
        self.shards = [load_shard(backend, ShardSpec(index.path, a, b, embed=i == 0, head=i == n - 1), precision,
                                  index=index) for i, (a, b) in enumerate(ranges)]  # fmt: skip

    def open(self) -> Seq:
        return Seq([s.open_slot() for s in self.shards])

    def close(self, seq: Seq) -> None:
        for shard, slot in zip(self.shards, seq.slots):
            shard.close_slot(slot)

    def feed(self, seq: Seq, ids) -> np.ndarray:
        positions, mask = seq.inputs(len(ids))
        x = np.asarray(ids)
        for shard, slot in zip(self.shards, seq.slots):
            x = shard.forward(slot, x, positions, mask)
        seq.advance(len(ids))
        return x

    def feed_batch(self, seqs: list[Seq], ids: list[list[int]]) -> list[np.ndarray]:
        inputs = [s.inputs(len(t)) for s, t in zip(seqs, ids)]
        xs = [np.asarray(t) for t in ids]
        for k, shard in enumerate(self.shards):
            xs = shard.forward_batch([s.slots[k] for s in seqs], xs, [p for p, _ in inputs], [m for _, m in inputs])
        for s, t in zip(seqs, ids):
            s.advance(len(t))
        return xs

    def greedy(self, hidden: np.ndarray) -> int:
        return self.shards[-1].greedy(hidden)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / np.max(np.abs(b)))


def solo_run(chain: Chain, prompt, steps: int) -> tuple[list[int], list[np.ndarray]]:
    seq = chain.open()
    h = chain.feed(seq, prompt)
    tokens, hiddens = [], []
    for _ in range(steps):
        tokens.append(chain.greedy(h))
        h = chain.feed(seq, tokens[-1:])
        hiddens.append(h)
    chain.close(seq)
    return tokens, hiddens


needs_mlx = pytest.mark.skipif(not MLX.available, reason=MLX.reason)
BACKENDS = ["openvino", pytest.param("mlx", marks=needs_mlx)]


@pytest.fixture(scope="module", params=[("openvino", "f32"), ("openvino", "serving"),
                                        pytest.param(("mlx", "f32"), marks=needs_mlx),
                                        pytest.param(("mlx", "serving"), marks=needs_mlx)],
                ids=["openvino-f32", "openvino-serving", "mlx-f32", "mlx-serving"])  # fmt: skip
def chains(request, synthetic_index):
    """A one-shard chain (OpenVINO: the greedy token folded into the stage) and a two-shard chain
    (head on the last), at the precision."""
    backend, precision = request.param
    return precision, [Chain(synthetic_index, [(0, 4)], precision, backend),
                       Chain(synthetic_index, [(0, 1), (1, 4)], precision, backend)]  # fmt: skip


def no_groups_left(chain: Chain) -> None:
    if chain.backend == "openvino":
        for shard in chain.shards:
            assert not shard._group_of  # every row left with its slot


def check(precision: str, got_h: np.ndarray, want_h: np.ndarray) -> None:
    assert rel(got_h, want_h) < (REL_BOUND if precision == "f32" else SERVING_REL_BOUND)


STEPS = 6


def test_rows_of_different_lengths_match_solo(chains):
    precision, pair = chains
    for chain in pair:
        want = [solo_run(chain, p, STEPS) for p in PROMPTS]
        seqs = [chain.open() for _ in PROMPTS]
        hs = [chain.feed(s, p) for s, p in zip(seqs, PROMPTS)]
        for step in range(STEPS):
            for s, h in zip(seqs, hs):
                s.tokens.append(chain.greedy(h))
            hs = chain.feed_batch(seqs, [s.tokens[-1:] for s in seqs])
            for i, h in enumerate(hs):
                check(precision, h, want[i][1][step])
        for i, s in enumerate(seqs):
            assert s.tokens == want[i][0][:STEPS], f"row {i}"
            chain.close(s)
        no_groups_left(chain)


def test_rows_leave_and_join_mid_way(chains):
    """A, B, C decode together; B finishes and D (prefilled alone) joins; one step runs without
    D, one step runs A alone, then all together again: each stays token-identical to its solo run."""
    precision, pair = chains
    steps = 10
    for chain in pair:
        want = [solo_run(chain, p, steps) for p in PROMPTS]
        a, b, c = (chain.open() for _ in range(3))
        live = {0: a, 1: b, 2: c}
        last = {i: chain.feed(s, PROMPTS[i]) for i, s in live.items()}

        def step(which):
            for i in which:
                live[i].tokens.append(chain.greedy(last[i]))
            out = chain.feed_batch([live[i] for i in which], [live[i].tokens[-1:] for i in which])
            for i, h in zip(which, out):
                check(precision, h, want[i][1][len(live[i].tokens) - 1])
                last[i] = h

        step([0, 1, 2])
        step([2, 0, 1])  # reordered: beam_idx only
        step([0, 1, 2])
        chain.close(b)  # B leaves: its row is dropped, nothing copied
        d = live[3] = chain.open()
        last[3] = chain.feed(d, PROMPTS[3])
        step([0, 3, 2])  # D joins
        step([0, 2])  # D sits one step out
        step([0, 3, 2])
        live[0].tokens.append(chain.greedy(last[0]))  # A alone, through the solo path
        last[0] = chain.feed(a, live[0].tokens[-1:])
        step([3, 2, 0])
        step([0, 3, 2])
        for i, s in ((0, a), (2, c), (3, d)):
            assert s.tokens == want[i][0][: len(s.tokens)], f"row {i}"
            chain.close(s)
        assert b.tokens == want[1][0][: len(b.tokens)]
        no_groups_left(chain)


@pytest.mark.parametrize("backend", BACKENDS)
def test_uneven_rows_and_rewind_in_a_batch(synthetic_index, backend):
    """f32: two prompts of different lengths prefilled as one batch into fresh slots; a row
    verifying 3 drafts beside a decode row (n = 3 and n = 1 in one batch), 2 drafts rejected by
    the mask, then decoding on: the hidden states of every real position match the same feeds
    run solo."""
    chain = Chain(synthetic_index, [(0, 2), (2, 4)], "f32", backend)
    solo, rows = [chain.open() for _ in range(2)], [chain.open() for _ in range(2)]
    feeds = [[PROMPTS[0], PROMPTS[1]], [[70, 71, 72], [9]], [[73], [10]], [[74, 75], [11]]]
    for t, (fa, fb) in enumerate(feeds):  # t = 0: both prompts prefilled as one batch
        want = [chain.feed(solo[0], fa), chain.feed(solo[1], fb)]
        got = chain.feed_batch(rows, [fa, fb])
        for g, w in zip(got, want):
            assert g.shape == w.shape and rel(g, w) < REL_BOUND
        if t == 1:  # reject the last 2 of the 3 drafts
            for s in (solo[0], rows[0]):
                s.rewind(2)
    assert rows[0].valid == solo[0].valid and rows[0].logical == solo[0].logical
    for s in solo + rows:
        chain.close(s)


def test_capture_restore_and_close_of_grouped_slots(synthetic_index):
    """capture of a row gives the slot's state as a solo capture would (same names, shapes,
    values); restoring it into a fresh slot continues identically; closed rows free their groups."""
    chain = Chain(synthetic_index, [(0, 4)], "f32")
    shard = chain.shards[0]
    seqs = [chain.open() for _ in range(3)]
    for s, p in zip(seqs, PROMPTS):
        chain.feed(s, p)
    solo_caps = [shard.capture(s.slots[0]) for s in seqs]
    for _ in range(2):
        chain.feed_batch(seqs, [[1], [2], [3]])
    ref = chain.open()  # the third sequence replayed solo
    chain.feed(ref, PROMPTS[2])
    chain.feed(ref, [3])
    chain.feed(ref, [3])
    cap = shard.capture(seqs[2].slots[0])
    want = shard.capture(ref.slots[0])
    assert cap.keys() == want.keys() == solo_caps[2].keys()
    for name in cap:
        assert cap[name].shape == want[name].shape
        np.testing.assert_allclose(cap[name], want[name], rtol=0, atol=1e-5)
    # restore into a new slot and continue solo, against the grouped slot continuing batched
    copy = chain.open()
    shard.restore(copy.slots[0], cap)
    copy.valid, copy.logical = list(seqs[2].valid), seqs[2].logical
    h_copy = chain.feed(copy, [4])
    h_rows = chain.feed_batch(seqs, [[4], [5], [4]])
    assert rel(h_rows[2], h_copy) < REL_BOUND
    # restore over a grouped slot replaces its row: it now continues as the copy does
    shard.restore(seqs[0].slots[0], shard.capture(copy.slots[0]))
    seqs[0].valid, seqs[0].logical = list(copy.valid), copy.logical
    assert rel(chain.feed(seqs[0], [6]), chain.feed(copy, [6])) < REL_BOUND
    spare = len(shard._spare)
    for s in seqs + [ref, copy]:
        chain.close(s)
    assert not shard._group_of
    assert len(shard._spare) == spare + 5 + 1  # five slots' requests and the last group's


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_batch_rejects_bad_rows(synthetic_index, backend):
    chain = Chain(synthetic_index, [(0, 4)], "f32", backend)
    shard = chain.shards[0]
    a, b = chain.open(), chain.open()
    chain.feed(a, PROMPTS[0])
    chain.feed(b, PROMPTS[1])
    pa, ma = a.inputs(1)
    pb, mb = b.inputs(1)
    with pytest.raises(ValueError, match="twice"):
        shard.forward_batch([a.slots[0], a.slots[0]], [np.array([1])] * 2, [pa, pa], [ma, ma])
    with pytest.raises(ValueError, match="cache_len"):
        shard.forward_batch([a.slots[0], b.slots[0]], [np.array([1])] * 2, [pa, pb], [ma, ma])
    with pytest.raises(ValueError, match="not open"):
        shard.forward_batch([a.slots[0], 99], [np.array([1])] * 2, [pa, pb], [ma, mb])


def test_a_parked_row_keeps_its_kv_and_the_others_keep_their_group(synthetic_index):
    """park (prompt caching): the row of a finished request leaves its group at the group's next
    step, all parked rows with one read of its state, and the others run on the same group (no
    rebuild); the parked slot then continues as it would have."""
    chain = Chain(synthetic_index, [(0, 4)], "f32")
    shard = chain.shards[0]
    seqs = [chain.open() for _ in range(3)]
    for s, p in zip(seqs, PROMPTS):
        chain.feed(s, p)
    chain.feed_batch(seqs, [[1], [2], [3]])
    group = shard._group_of[seqs[0].slots[0]]
    ref = chain.open()  # the first sequence replayed solo
    chain.feed(ref, PROMPTS[0])
    chain.feed(ref, [1])
    shard.park(seqs[0].slots[0])
    assert shard._group_of[seqs[0].slots[0]] is group  # nothing copied yet
    chain.feed_batch(seqs[1:], [[2], [3]])
    assert shard._group_of[seqs[1].slots[0]] is group  # the others ran on their group
    assert seqs[0].slots[0] not in shard._group_of and not shard._parked  # the parked row is home
    assert rel(chain.feed(seqs[0], [4]), chain.feed(ref, [4])) < REL_BOUND
    for s in seqs + [ref]:
        chain.close(s)
