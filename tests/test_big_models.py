"""Models with the shapes of real Llamas (tests/big_gguf.py): their layout, their plans, and a
real session on the 1B shape whose host spends seconds hashing it.

The files are written at test time into the test cache (0.8 GB for the 1B, a 42 GB *hole* for the
70B that takes a few MB of disk) and reused across runs; the tokenizer comes from llama.cpp's
vocab files (tests/llamacpp_files.py)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.big_gguf import SHAPES, big_model, tensor_plan, use_more_bits

pytestmark = pytest.mark.slow


def test_use_more_bits_is_llama_cpps():
    # llama-quant.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2, C++ integer division
    assert [b for b in range(16) if use_more_bits(b, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [b for b in range(32) if use_more_bits(b, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]


@pytest.mark.parametrize("shape", ["llama-3.2-1b", "llama-3-70b"])
def test_big_shapes_open_with_q4_k_m_types(shape):
    from backends.gguf import open_model

    s = SHAPES[shape]
    path = big_model(shape)
    index = open_model(path)  # how long it takes: bench.header_read
    h = index.hparams
    assert (h.n_blocks, h.hidden, h.n_heads, h.n_kv_heads, h.vocab) == (s.blocks, s.hidden, s.heads, s.kv_heads, s.vocab)
    assert index.metadata["general.file_type"] == 15  # MOSTLY_Q4_K_M
    types = {name: qtype for name, qtype, _ in tensor_plan(s)}
    assert {n: t.qtype for n, t in index.tensors.items()} == types
    for b in range(s.blocks):
        more = use_more_bits(b, s.blocks)
        assert types[f"blk.{b}.ffn_down.weight"] == ("Q6_K" if more else "Q4_K")
        assert types[f"blk.{b}.attn_v.weight"] == ("Q6_K" if more else "Q5_K" if s.model_type_70b else "Q4_K")
        assert types[f"blk.{b}.attn_q.weight"] == types[f"blk.{b}.ffn_up.weight"] == "Q4_K"
    assert types["token_embd.weight"] == ("Q6_K" if s.tied else "Q4_K")
    assert s.tied or types["output.weight"] == "Q6_K"


def test_70b_shape_plans_across_members_and_is_refused_when_short():
    from backends.gguf import open_model
    from planner import plan_fleet

    index = open_model(big_model("llama-3-70b"))
    assert 42.4e9 < index.file_bytes < 42.6e9  # as llama.cpp's Llama-3-70B Q4_K_M (42.5 GB)
    model = index.planner_model()  # β_block is the largest block (Q6_K ffn_down): 45 GB for 80
    assert 42e9 < model["blocks"] * model["block_bytes"] + model["head_bytes"] < 46e9

    def fleet(memory_gb):
        return {"context": 4096, "concurrency": 2, "anchor": "a", "model": model,
                "devices": [{"name": n, "memory_gb": memory_gb, "nat": "permissive", "rtt_ms": 5.0} for n in "abcd"]}  # fmt: skip

    ok = plan_fleet(fleet(16.0), None, "kafila").to_json()
    assert ok["feasible"] and sum(ok["blocks"].values()) == 80
    short = plan_fleet(fleet(8.0), None, "kafila").to_json()
    assert not short["feasible"] and short["refused"]


def test_inspect_1b_shape():
    r = subprocess.run([sys.executable, "-m", "kafila", "inspect", big_model("llama-3.2-1b")],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "16 blocks" in r.stdout and "MOSTLY_Q4_K_M" in r.stdout and "128256 tokens" in r.stdout


def _digest_line(log_path: str) -> tuple[str, float]:
    with open(log_path) as f:
        text = f.read()
    m = re.search(r"model digests (computed|read from the cache) in ([\d.]+) s", text)
    assert m, text[-2000:]
    return m.group(1), float(m.group(2))


@pytest.mark.session
def test_host_hashing_for_seconds_forms_the_session_and_a_second_session_reuses_the_digests(tmp_path):
    """The 1B shape's host hashes 0.8 GB (file, header and every tensor) in a worker for seconds
    while members join; a second session on the same file with the same cache reads the digests
    back instead of hashing again."""
    from kafila.tooling.launch import LocalSession, stream_chat

    model = big_model("llama-3.2-1b")
    caches = str(tmp_path / "caches")
    answers, digests = [], []
    for run in range(2):
        (tmp_path / f"logs{run}").mkdir()
        s = LocalSession(members=2, model=model, context=64, concurrency=1, cache_root=caches,
                         log_dir=str(tmp_path / f"logs{run}"))  # fmt: skip
        s.start(timeout_s=900)
        try:
            answers.append(stream_chat(s.api("m2"), "Hi", 3, timeout_s=300))
            digests.append(_digest_line(s.proc("m1").log_path))
        finally:
            codes = s.stop()
        assert all(c in (0, -2, 130) for c in codes.values()), codes
    (first, first_s), (second, second_s) = digests
    assert first == "computed" and first_s > 0, digests  # the 808 MB file hashed on the first run
    assert second == "read from the cache", digests  # and not on the second (how long each took: a timing, not a claim)
    assert answers[0]["text"] == answers[1]["text"] and answers[0]["tokens"] == 3


def test_a_header_larger_than_one_chunk_arrives_in_pieces(tmp_path):
    """Llama 3's tokenizer makes a 7.8 MB header: fetched in compressed pieces of ≤ one chunk."""
    import asyncio
    import contextlib

    from backends.gguf import open_model
    from kafila.session.weights import manifest as W
    from kafila.session.wire.frames import WEIGHT_CHUNK_BYTES
    from kafila.session.weights.transfer import fetch_weights, serve_weights
    from tests.fake_link import Pipe

    model = big_model("llama-3.2-1b")
    index = open_model(model)
    m = W.DigestCache.load(index).manifest(15, 16, False)
    assert m.header_len > WEIGHT_CHUNK_BYTES
    gets = W.Fetcher(m, True, []).requests()
    assert len(gets) >= 2 and all(g.length <= WEIGHT_CHUNK_BYTES and g.compress for g in gets)

    async def transfer(path):
        up, down = Pipe(), Pipe()
        server = asyncio.create_task(serve_weights(up.reader, down, model, m.file_bytes, {}))
        try:
            return await fetch_weights(down.reader, up, "m2", m, path)
        finally:
            up.close()
            with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
                await server

    path = str(tmp_path / "copy.gguf")
    stats = asyncio.run(transfer(path))
    assert stats["fetched_tensors"] == len(m.tensors)
    assert W.plan_fetch(path, m) == (False, [])
    copy = open_model(path)  # the sparse copy opens like the file: header and tokenizer intact
    assert copy.metadata["tokenizer.ggml.tokens"][:3] == index.metadata["tokenizer.ggml.tokens"][:3]
