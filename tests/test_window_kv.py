"""A sliding-window layer's KV holds its window, not the whole history (backends/openvino/window.py).

Gemma 3 and gpt-oss files of window 8 (tests/arch_gguf.py), one OpenVINO or MLX stage at f32. Every
operation a slot meets in serving — decoding past the window, masked (rejected) positions, rows
batched in a group and taken out again, a kept window gone back to, capture and restore — runs on
a shard whose windowed layers hold their window and on one that holds every position (the form
tests/test_arch_families.py checked against llama.cpp before the window was held alone), and
their hidden states agree; the windowed variables stay within window + drop_at positions while the
full layers' grow. llama.cpp's own ids past the window: tests/test_arch_families.py; the prompt
cache going back to a kept window on the ring: tests/test_arch_hybrid.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.gguf import open_model
from backends.memory import window_drop_at, window_rewind
from tests.arch_gguf import write_arch_gguf

BLOCKS = 4
WINDOW = 8
REL = 1e-4



def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(1e-6, float(np.max(np.abs(b)))))


class Pair:
    """The same slot operations on a shard holding windows and on one holding every position."""

    def __init__(self, path: str, backend: str) -> None:
        index = open_model(path)
        assert index.hparams.family.sliding_window == WINDOW
        self.backend = backend
        self.held, self.whole = (load_shard(backend, ShardSpec(path, 0, BLOCKS, True, True), "f32", index=index)
                                 for _ in range(2))  # fmt: skip
        if backend == "openvino":  # every position kept, as before window.py
            self.whole._window = None
        else:
            self.whole._window_size = 0

    def open(self) -> int:
        a, b = self.held.open_slot(), self.whole.open_slot()
        assert a == b
        return a

    def forward(self, slot: int, ids, positions, mask) -> np.ndarray:
        args = (np.asarray(ids, np.int64), np.asarray(positions, np.int64), np.asarray(mask, np.int64))
        h, w = self.held.forward(slot, *args), self.whole.forward(slot, *args)
        assert _rel(h, w) < REL
        return h

    def batch(self, slots, ids, positions, masks) -> list[np.ndarray]:
        args = ([np.asarray(i, np.int64) for i in ids], [np.asarray(p, np.int64) for p in positions],
                [np.asarray(m, np.int64) for m in masks])  # fmt: skip
        hs, ws = self.held.forward_batch(slots, *args), self.whole.forward_batch(slots, *args)
        for h, w in zip(hs, ws):
            assert _rel(h, w) < REL
        return hs

    def do(self, method: str, *args) -> None:
        getattr(self.held, method)(*args)
        getattr(self.whole, method)(*args)

    def windowed_lengths(self, slot: int | None = None) -> tuple[set[int], set[int]]:
        """(windowed, full) positions held by the slot's solo state, or by its group's (OpenVINO)."""
        if self.backend == "mlx":
            cache = self.held._slots[slot]
            used = {w: cache.length - cache.offset(i) for i, w in enumerate(cache.windowed)}
            return {used[True]}, {used[False]}
        group = self.held._group_of.get(slot)
        req = group.req if group is not None else self.held._reqs[slot]
        names = self.held._window.names
        lengths = {s.name: s.state.shape[2] for s in req.query_state()}
        return ({n for k, n in lengths.items() if k in names}, {n for k, n in lengths.items() if k not in names})


@pytest.fixture(scope="module", params=[(k, b) for b in ("openvino", "mlx") for k in ("gemma3", "gpt-oss")],
                ids=lambda p: "-".join(p))
def pair(request, tmp_path_factory):
    kind, backend = request.param
    if not status(backend).available:
        pytest.skip(status(backend).reason)
    path = write_arch_gguf(tmp_path_factory.mktemp("w") / "m.gguf", kind, blocks=BLOCKS, tiny_vocab=256)
    return Pair(path, backend)


def test_decoding_past_the_window_holds_the_window_and_answers_as_the_whole_history(pair):
    """112 positions on one slot, one at a time after a 12-id prompt, with every fourth position
    masked out (a rejected draft): the windowed layers hold at most window + window_rewind +
    drop_at visible positions (and the masked ones among them, and the step's), the full ones all
    of them; every hidden state is the whole history's. Then the last window_rewind positions,
    fed one step each, are masked at once (a draft model's chain rewinding its drafts): still the
    whole history's answer; masking more than that is refused in one line, not computed on keys
    no longer held, and leaves the slot as it was."""
    slot = pair.open()
    mask = [1] * 12
    pair.forward(slot, np.arange(5, 17), np.arange(12), mask)
    logical = 12
    bound = 2 * (WINDOW + window_rewind(WINDOW)) + window_drop_at(WINDOW) + 1
    for i in range(100):
        visible = int(i % 4 != 3)
        mask = mask + [1]
        pair.forward(slot, [(7 * i) % 256], [logical], mask)
        mask[-1] = visible  # the next steps see it masked out: rejected
        logical += visible
        windowed, full = pair.windowed_lengths(slot)
        assert full == {len(mask)} and max(windowed) <= bound, (i, windowed)
    assert max(windowed) < len(mask) // 2
    back = np.flatnonzero(mask)[-window_rewind(WINDOW):]
    rewound = list(mask)
    for c in back:
        rewound[c] = 0
    pair.forward(slot, [3], [logical - len(back)], rewound + [1])
    too_far = list(rewound) + [0]
    for c in np.flatnonzero(too_far)[-2 * WINDOW:]:
        too_far[c] = 0
    with pytest.raises(ValueError, match="masks more earlier positions than a sliding-window layer keeps") as err:
        pair.held.forward(slot, np.array([4]), np.array([logical - len(back) - 2 * WINDOW]),
                          np.array(too_far + [1], np.int64))  # fmt: skip
    assert "\n" not in str(err.value)
    pair.forward(slot, [5], [logical - len(back) + 1], rewound + [1, 1])  # the refused step changed nothing


def test_rows_in_a_group_hold_their_windows_and_answer_as_alone(pair):
    """Two slots of different lengths stepped together for 40 steps (one group), then one taken out
    and stepped alone, then a multi-position step on it: each the whole history's answer, the
    group's windowed variables bounded as a slot alone's."""
    a, b = pair.open(), pair.open()
    ma, mb = [1] * 20, [1] * 5
    pair.forward(a, np.arange(20), np.arange(20), ma)
    pair.forward(b, np.arange(30, 35), np.arange(5), mb)
    for i in range(40):
        ma, mb = ma + [1], mb + [1]
        pair.batch([a, b], [[i + 1], [i + 2]], [[len(ma) - 1], [len(mb) - 1]], [ma, mb])
    windowed, full = pair.windowed_lengths(a)
    assert full == {len(ma)} and max(windowed) <= WINDOW + window_rewind(WINDOW) + window_drop_at(WINDOW) + 1, windowed
    ma = ma + [1]
    pair.forward(a, [9], [len(ma) - 1], ma)  # out of the group: its row copied back alone
    ma = ma + [1, 1, 1]
    pair.forward(a, [3, 4, 5], np.arange(len(ma) - 3, len(ma)), ma)
    mb = mb + [1]
    pair.batch([b], [[1]], [[len(mb) - 1]], [mb])


def test_a_kept_window_is_gone_back_to_and_a_cut_past_the_window_is_refused(pair):
    """A slot keeps its window at 30 positions (a prompt's end: checkpoint), runs 40 more, and is
    cut back to 30: its windowed layers take the kept window and answer as the whole history cut
    there. A cut to 20, neither held nor kept, is refused in one line; a cut inside the window held
    is the KV's own."""
    slot = pair.open()
    mask = [1] * 30
    pair.forward(slot, np.arange(30), np.arange(30), mask)
    pair.do("checkpoint", slot)
    for i in range(40):
        mask = mask + [1]
        pair.forward(slot, [i], [len(mask) - 1], mask)
    pair.do("trim", slot, 68)  # inside the window held: no copy needed
    pair.forward(slot, [1], [68], [1] * 69)
    pair.do("trim", slot, 30)
    pair.forward(slot, [11, 12], [30, 31], [1] * 32)
    with pytest.raises(ValueError, match="holds the window of its last positions only") as err:
        pair.held.trim(slot, 20)
    assert "\n" not in str(err.value)


def test_capture_and_restore_keep_the_answer(pair):
    """A slot past its window captured (its windowed layers padded back) and restored into
    another answers as the first."""
    slot = pair.open()
    pair.forward(slot, np.arange(50), np.arange(50), [1] * 50)
    state = pair.held.capture(slot)
    other = pair.held.open_slot()
    pair.held.restore(other, state)
    h1 = pair.held.forward(slot, np.array([3]), np.array([50]), np.ones(51, np.int64))
    h2 = pair.held.forward(other, np.array([3]), np.array([50]), np.ones(51, np.int64))
    assert _rel(h1, h2) < REL
