"""Qwen3.5 files with a multi-token-prediction (nextn) layer (issue 35): the trunk is served as
llama.cpp serves it (its main pass never runs the MTP block), and `--speculate mtp` drafts with
the block at the head (backends/openvino/mtp.py, kafila/session/ring/speculation/mtp.py) without
changing an id.

The files are tests/hybrid_gguf.py's small random qwen35 / qwen35moe models with an MTP block
after their 4 blocks. Random weights make the MTP block's drafts random too: the ring tests steer
some drafts right so that accepted and rejected drafts both occur, while the MTP drafter does all
its own work (catch-up with the model's rows, drafting, rewinds) underneath.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import ShardSpec, load_shard, status
from backends.errors import BadInput
from backends.gguf import open_model
from tests.hybrid_gguf import SHAPE, write_qwen35_gguf
from tests.test_llamacpp_arch import needs_llamacpp

needs_openvino = pytest.mark.skipif(not status("openvino").available, reason=status("openvino").reason)
PROMPT_IDS = [int(i) for i in np.random.default_rng(1).integers(0, SHAPE["vocab"], 90)]


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def mtp_file(request, tmp_path_factory) -> str:
    return write_qwen35_gguf(tmp_path_factory.mktemp("mtp") / f"{request.param}.gguf", arch=request.param,
                             moe=request.param == "qwen35moe", mtp=True)  # fmt: skip


def test_the_index_counts_the_trunk_and_keeps_the_mtp_block(mtp_file):
    index = open_model(mtp_file)
    hy = index.hparams.hybrid
    assert index.hparams.n_blocks == SHAPE["blocks"] and hy.mtp_blocks == 1
    assert hy.recurrent == (True, False, True, False, False)  # the MTP block attends
    assert len(hy.trunk) == SHAPE["blocks"]
    assert index.kv_bytes_per_token_per_block() == pytest.approx(2 * 2 * 32 * 2 * 2 / 4)  # the trunk's 2 of 4


def test_a_file_with_more_mtp_layers_than_llamacpp_runs_is_refused(tmp_path):
    import gguf

    from tests.hybrid_gguf import ARCH

    path = write_qwen35_gguf(tmp_path / "m.gguf", mtp=True)
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields[f"{ARCH}.nextn_predict_layers"]
    field.parts[field.data[0]][0] = 2  # two MTP blocks claimed: llama.cpp's qwen35 runs one
    del reader
    with pytest.raises(BadInput, match="multi-token-prediction"):
        open_model(path)


@needs_llamacpp
@needs_openvino
@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["1-stage", "3-stages"])
def test_the_trunk_gives_llamacpps_greedy_ids(mtp_file, ranges):
    from kafila.engine.chain import LocalChain
    from tests.llamacpp_ref import greedy_run

    index = open_model(mtp_file)
    ref_ids, _ = greedy_run(mtp_file, PROMPT_IDS, 64)
    assert len(set(ref_ids)) > 16, ref_ids
    shards = [load_shard("openvino", ShardSpec(mtp_file, a, b, a == 0, a == 0), "f32", index=index) for a, b in ranges]
    assert list(LocalChain(shards, chunk_tokens=64).generate(PROMPT_IDS, 64)) == ref_ids


def _rows(positions, hidden: int) -> np.ndarray:
    """A made-up final hidden per position (the same whenever a position is fed)."""
    return np.stack([np.random.default_rng(1000 + p).standard_normal(hidden).astype(np.float32) for p in positions])


@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_drafting_step_after_step_drafts_what_a_fresh_drafter_drafts(mtp_file, backend):
    """The drafter's slot after many steps (drafts fed with its own h', then masked out and caught
    up with the model's rows; accepted drafts, rejected ones) drafts exactly what a drafter fed the
    same history and rows from scratch drafts."""
    from kafila.session.ring.speculation.mtp import MtpDrafter

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    index = open_model(mtp_file)
    H = index.hparams.hidden
    drafter = MtpDrafter.build(index, "f32", 256, backend=backend)
    history = list(PROMPT_IDS[:40])
    drafter.observe("r", 0, _rows(range(len(history)), H))
    rng = np.random.default_rng(5)
    for step in range(12):
        drafts = drafter.propose("r", history, 3)
        assert len(drafts) == 3 and all(0 <= d < SHAPE["vocab"] for d in drafts)
        fresh = MtpDrafter.build(index, "f32", 256, backend=backend)
        fresh.observe("r", 0, _rows(range(len(history)), H))
        assert fresh.propose("r", history, 3) == drafts, step
        fresh.close()
        taken = list(drafts[: step % 4]) + [int(rng.integers(0, SHAPE["vocab"]))]  # j accepted, then the model's
        start = len(history) - 1  # the verifying step fed the last token and the drafts
        drafter.observe("r", start, _rows(range(start, start + 4), H))
        history += taken
    drafter.release("r")
    drafter.close()


@needs_openvino
def test_the_next_turn_takes_the_last_turns_mtp_slot_and_drafts_as_from_scratch(mtp_file):
    """With prompt caching the ring brings back only a turn's new positions: the drafter takes the
    finished turn's parked slot and rows, catches up from where it stopped, and drafts what a
    drafter given every position's row drafts; a history it shares nothing with gets a new slot."""
    from kafila.session.ring.speculation.mtp import PARKED, MtpDrafter

    index = open_model(mtp_file)
    H = index.hparams.hidden
    drafter = MtpDrafter.build(index, "f32", 256)
    first = list(PROMPT_IDS[:30])
    drafter.observe("turn1", 0, _rows(range(len(first)), H))
    drafter.propose("turn1", first, 3)
    answer = [int(t) for t in np.random.default_rng(3).integers(0, SHAPE["vocab"], 12)]
    drafter.observe("turn1", len(first) - 1, _rows(range(len(first) - 1, len(first) + len(answer)), H))
    slot = drafter._states["turn1"].slot
    drafter.release("turn1")  # parked at the next call
    second = first + answer + list(PROMPT_IDS[30:45])
    cached = len(first) + len(answer) - 1  # the ring's parked slot: all but the answer's last token
    drafter.observe("turn2", cached, _rows(range(cached, len(second)), H))
    fresh = MtpDrafter.build(index, "f32", 256)
    fresh.observe("r", 0, _rows(range(len(second)), H))
    assert drafter.propose("turn2", second, 3) == fresh.propose("r", second, 3)
    # turn 1's slot, caught up from its last proposal (its 2 fed drafts masked), not fed afresh
    assert drafter._states["turn2"].slot == slot
    assert drafter._states["turn2"].cache_len == len(first) + 2 + (len(second) - len(first)) + 2
    for i in range(PARKED + 2):  # unrelated requests: slots of their own; at most PARKED stay parked
        other = [(t + 1 + i) % SHAPE["vocab"] for t in PROMPT_IDS[:8]]
        drafter.observe(f"o{i}", 0, _rows(range(8), H))
        drafter.propose(f"o{i}", other, 2)
        drafter.release(f"o{i}")
    drafter.propose("turn2", second, 1)
    assert len(drafter._parked) == PARKED
    drafter.close()
    fresh.close()


class _Steered:
    """The MTP drafter under test, with its drafts steered: the first right (the answer without
    speculation), the second wrong, so that every step accepts one and rejects the rest; the
    MTP drafter still drafts (and catches up, and rewinds) underneath at every step."""

    def __init__(self, mtp, truth: list[int]) -> None:
        self.mtp, self.truth, self.ahead = mtp, truth, mtp.ahead
        self.observed = 0

    def observe(self, req_id: str, pos0: int, hidden) -> None:
        self.observed += len(hidden)
        self.mtp.observe(req_id, pos0, hidden)

    def propose(self, req_id: str, history, k: int) -> tuple[int, ...]:
        own = self.mtp.propose(req_id, history, k)
        right = self.truth[len(history): len(history) + len(own)]
        return tuple(t if j != 1 else (t + 1) % SHAPE["vocab"] for j, t in enumerate(right))

    def release(self, req_id: str) -> None:
        self.mtp.release(req_id)

    def close(self) -> None:
        self.mtp.close()


@needs_openvino
def test_mtp_drafts_on_a_three_stage_ring_give_the_ids_without_speculation(mtp_file):
    from kafila.engine.chain import LocalChain
    from kafila.session.ring.speculation.mtp import MtpDrafter
    from tests.test_speculate import N_NEW, _exactness

    index = open_model(mtp_file)
    chain = LocalChain([load_shard("openvino", ShardSpec(mtp_file, a, b, a == 0, a == 0), "f32", index=index)
                        for a, b in ((0, 1), (1, 3), (3, 4))], chunk_tokens=64)  # fmt: skip
    prompt = PROMPT_IDS[:30]
    drafter = _Steered(MtpDrafter.build(index, "f32", 1024), prompt + list(chain.generate(prompt, N_NEW + 8)))
    total = _exactness(chain.shards, index, [prompt], speculate="draft", drafter=drafter)
    assert drafter.observed >= len(prompt) + N_NEW  # every position's row came back to the drafter
    print(f"MTP drafts on the ring: {total.accepted} of {total.drafted} accepted")


def test_speculate_mtp_needs_a_file_with_an_mtp_layer(tmp_path):
    import subprocess
    import sys

    plain = write_qwen35_gguf(tmp_path / "plain.gguf", tokenizer=True)
    done = subprocess.run([sys.executable, "-m", "kafila", "host", "--model", plain, "--speculate", "mtp",
                           "--expect", "2"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("kafila host: --speculate mtp: plain has no "
                                                           "multi-token-prediction (nextn) layer")  # fmt: skip


@needs_llamacpp
@pytest.mark.parametrize("backend", ["openvino", "mlx"])
def test_the_mtp_block_drafts_what_llamacpps_mtp_head_drafts(mtp_file, backend):
    """The external reference for the block itself: llama.cpp's MTP context (its draft-mtp driver's
    feeding: token q with the model's h_{q−1}, then each draft with the MTP's own h_nextn) on the
    same file, the same tokens and the same model rows, gives the same greedy token after every
    position and the same 4 drafts as the MTP shard (OpenVINO's and MLX's) and MtpDrafter."""
    from backends.gguf.hybrid import final_norm, mtp_inputs
    from kafila.session.ring.speculation.mtp import MtpDrafter
    from tests.llamacpp_ref import mtp_drafts

    if not status(backend).available:
        pytest.skip(status(backend).reason)
    index = open_model(mtp_file)
    H = index.hparams.hidden
    for seed in (0, 1):
        tokens = [int(t) for t in np.random.default_rng(seed).integers(0, SHAPE["vocab"], 24)]
        raw = _rows(range(seed, seed + len(tokens)), H)  # the model's final hidden before output_norm
        normed = final_norm(index, raw)
        h_prev = np.concatenate([np.zeros((1, H), np.float32), normed[:-1]])  # h_{q−1}; zeros before 0
        after, drafts = mtp_drafts(mtp_file, tokens, h_prev, 4)
        drafter = MtpDrafter.build(index, "f32", 256, backend=backend)
        shard = drafter.shard
        slot = shard.open_slot()
        ours = [shard.greedy(shard.forward(slot, mtp_inputs(index, [t], h_prev[q: q + 1]), np.array([q]),
                                           np.ones(q + 1, np.int64))) for q, t in enumerate(tokens)]  # fmt: skip
        assert ours == after, seed
        shard.close_slot(slot)
        drafter.observe("r", 0, raw)
        assert drafter.propose("r", tokens, 4) == tuple(drafts), seed
        drafter.close()


@pytest.mark.session
@pytest.mark.slow
@pytest.mark.timeout(900)
@needs_openvino
def test_a_session_with_speculate_mtp_answers_as_one_stage_does(tmp_path):
    """`kafila host --speculate mtp` and two joined members (separate processes, 20 ms a hop) on a
    qwen35 file with an MTP layer and Qwen2's tokenizer, --precision f32: the head drafts with the
    file's own MTP layer, and two users at once get one stage's greedy texts."""
    from bench.churn import ask_all
    from kafila.tooling.launch import LocalSession
    from tests.test_moe_session import N_TOKENS, PROMPTS, one_stage_texts

    path = write_qwen35_gguf(tmp_path / "mtp.gguf", blocks=6, tokenizer=True, mtp=True)
    want = one_stage_texts(path)
    s = LocalSession(members=3, model=path, precision="f32", context=256, log_dir=str(tmp_path),
                     cache_root=str(tmp_path / "cache"), speculate="mtp", latency_ms=20)  # fmt: skip
    s.start(timeout_s=400)
    try:
        threads, results = ask_all(s, ["m1", "m3"], PROMPTS, N_TOKENS, raw=True)
        for t in threads:
            t.join(300)
        assert [r.get("text") for r in results] == want, results
        drafted = sum((r.get("speculation") or {}).get("drafted", 0) for r in results)
        assert drafted > 0, results  # the MTP layer drafted (random weights: few are accepted)
    finally:
        s.stop()
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert "own multi-token-prediction layer" in logs


def test_the_head_is_priced_with_the_mtp_block_when_it_drafts_with_it(mtp_file):
    from backends.memory import resident_bytes
    from kafila.session.control.host import _resident_model
    from kafila.session.ring.speculation.mtp import PARKED

    index = open_model(mtp_file)
    plain, mtp = _resident_model(index, {"openvino"}), _resident_model(index, {"openvino"}, "mtp")
    block = resident_bytes("openvino", index.block_tensors(SHAPE["blocks"]))
    assert block > 0 and mtp["head_resident_bytes"] == plain["head_resident_bytes"] + block
    # and per position of each request (and of the parked ones): the block's K and V, the row kept
    h = index.hparams
    assert mtp["head_bytes_per_token"] == 2 * h.n_kv_heads * h.head_dim * 2 + h.hidden * 4
    assert mtp["head_parked"] == PARKED and "head_bytes_per_token" not in plain
    mine = ("head_resident_bytes", "head_bytes_per_token", "head_parked")
    assert {k: v for k, v in mtp.items() if k not in mine} == {k: v for k, v in plain.items() if k not in mine}
    # the plan's slots make room for them at the head (planner.cost.head_kv_bytes)
    from planner import member_bytes, parse_fleet
    from planner.cost import slots_that_fit

    n, context = index.hparams.n_blocks, 4096

    def fleet(model: dict, memory: float):
        return parse_fleet({"context": context, "concurrency": 1, "anchor": "a", "model": model,
                            "devices": [{"name": "a", "memory_gb": memory / 1e9}]})  # fmt: skip

    memory = member_bytes(fleet(mtp, 1e9).model, n, True, context * 8, True, 8) + 1  # 8 requests drafting
    assert slots_that_fit(fleet(mtp, memory), {"a": n}, "a", 1000) == 8
    assert slots_that_fit(fleet({**mtp, "head_bytes_per_token": 0}, memory), {"a": n}, "a", 1000) > 8
    # /status's planned bytes for the head (kafila/session/ring/memory.py) count the same
    from kafila.session.ring.memory import shard_memory

    args = (index, 0, n, True, context, 2)
    got = shard_memory(*args, speculate="mtp")["planned_bytes"] - shard_memory(*args)["planned_bytes"]
    assert got == pytest.approx(block + mtp["head_bytes_per_token"] * context * (2 + PARKED), abs=2)


def test_a_request_that_stops_drafting_keeps_at_most_max_rows(mtp_file):
    from kafila.session.ring.speculation.mtp import MAX_ROWS, MtpDrafter

    drafter = MtpDrafter(open_model(mtp_file), shard=None, max_positions=64)  # observe needs no shard
    starts = range(0, MAX_ROWS + 1000, 500)
    for start in starts:
        drafter.observe("r", start, np.ones((500, SHAPE["hidden"]), np.float32))
    end = starts[-1] + 500  # positions 0 … end − 1 came back: the newest MAX_ROWS stay
    assert sorted(drafter._rows["r"]) == list(range(end - MAX_ROWS, end))


def test_inspect_shows_the_mtp_layer(mtp_file):
    from kafila.commands.inspect import describe, render

    info = describe(mtp_file)
    assert info["blocks"] == SHAPE["blocks"] + 1 and info["mtp_blocks"] == 1
    assert f"{SHAPE['blocks']} blocks + 1 multi-token-prediction (--speculate mtp)" in render(info)
