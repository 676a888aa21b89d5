"""The host's model digests: computed in a worker, cached on disk by file identity.

Small files (a tiny synthetic GGUF), no sockets; the real-session check that a slowly hashed model
still forms its session is in tests/test_big_models.py."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time

import pytest

from backends.gguf import open_model
from kafila.session.weights import manifest as W
from tests.arch_gguf import write_arch_gguf


@pytest.fixture()
def model(tmp_path):
    return str(write_arch_gguf(tmp_path / "tiny.gguf", "llama", tiny_vocab=256, blocks=3))


def _sha(path: str, offset: int = 0, length: int | None = None) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return hashlib.sha256(f.read() if length is None else f.read(length)).hexdigest()


def test_digests_are_the_files_and_each_tensors(model, tmp_path):
    index = open_model(model)
    d = W.DigestCache.load(index, str(tmp_path / "cache"))
    assert d.hashed and d.sha256 == _sha(model)
    m = d.manifest(1, 3, True)
    assert m.sha256 == _sha(model) and m.header_sha256 == _sha(model, 0, m.header_len)
    assert {t.name for t in m.tensors} == {t.name for t in index.shard_tensors(1, 3, True)}
    for t in m.tensors:
        assert t.sha256 == _sha(model, t.offset, t.n_bytes)


def test_a_second_load_of_the_same_file_reads_the_cache(model, tmp_path):
    cache = str(tmp_path / "cache")
    first = W.DigestCache.load(open_model(model), cache)
    assert first.hashed and os.path.isfile(first.cache_path)
    second = W.DigestCache.load(open_model(model), cache)
    assert not second.hashed and second.cache_path == first.cache_path
    assert second.manifest(0, 3, True) == first.manifest(0, 3, True)
    # a throttle that would take minutes is never reached: nothing is hashed (else a timeout)
    third = W.DigestCache.load(open_model(model), cache, hash_bytes_per_s=1.0)
    assert not third.hashed


def test_a_changed_file_is_hashed_again(model, tmp_path):
    cache = str(tmp_path / "cache")
    first = W.DigestCache.load(open_model(model), cache)
    index = open_model(model)
    t = index.tensors["blk.0.attn_q.weight"]
    with open(model, "r+b") as f:  # same size, other bytes, later mtime
        f.seek(t.offset)
        f.write(b"\x00\x00\x80\x3f")
    st = os.stat(model)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    again = W.DigestCache.load(open_model(model), cache)
    assert again.hashed and again.sha256 == _sha(model) != first.sha256
    assert again.manifest(0, 1, False) != first.manifest(0, 1, False)


def test_a_damaged_or_foreign_cache_file_is_hashed_again(model, tmp_path):
    cache = str(tmp_path / "cache")
    first = W.DigestCache.load(open_model(model), cache)
    with open(first.cache_path, "w") as f:
        f.write("{not json")
    assert W.DigestCache.load(open_model(model), cache).hashed
    with open(first.cache_path) as f:
        d = json.load(f)
    d["identity"]["inode"] += 1  # another file's digests under this name
    with open(first.cache_path, "w") as f:
        json.dump(d, f)
    again = W.DigestCache.load(open_model(model), cache)
    assert again.hashed and again.sha256 == first.sha256


def test_no_cache_dir_hashes_every_time(model):
    assert W.DigestCache.load(open_model(model)).hashed
    assert W.DigestCache.load(open_model(model)).cache_path is None


def test_hashing_in_a_worker_leaves_the_event_loop_free(model):
    """What the host does: the loop keeps ticking (heartbeats, API) while a slow hash runs."""
    index = open_model(model)
    rate = os.path.getsize(model) * 2 / 1.5  # the file is read twice (whole + tensors): ~1.5 s

    async def main():
        lags = []

        async def ticker():
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.02)
                lags.append(time.monotonic() - t - 0.02)

        tick = asyncio.create_task(ticker())
        t0 = time.monotonic()
        d = await asyncio.to_thread(W.DigestCache.load, index, None, rate)
        took = time.monotonic() - t0
        tick.cancel()
        return d, took, lags

    d, took, lags = asyncio.run(main())
    assert d.hashed and took >= 1.0  # the throttle held it back (a lower bound: load only lengthens it)
    assert len(lags) > 20  # the loop kept ticking while the file hashed: hashing does not block it


def test_cancel_stops_a_hash_in_progress(model):
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    with pytest.raises(W.WeightError, match="cancelled"):  # at 1000 B/s, unstopped, it would time out
        W.DigestCache.load(open_model(model), None, hash_bytes_per_s=1000.0, cancel=cancel)
