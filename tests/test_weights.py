"""Weight transfer between two in-process streams on the real default model file."""

import asyncio
import contextlib
import os

import pytest

from backends.gguf import open_model
from kafila.session.weights import manifest as W
from kafila.session.wire.streams import StreamClosed
from kafila.session.weights.transfer import check_local_file, fetch_weights, serve_weights
from tests.default_model import MODEL, needs_default_model
from tests.fake_link import Pipe

pytestmark = needs_default_model




async def transfer(manifest, path, fail_after=None, check=None):
    up, down = Pipe(), Pipe(fail_after)
    server = asyncio.create_task(serve_weights(up.reader, down, MODEL, manifest.file_bytes, {}))
    try:
        return await fetch_weights(down.reader, up, "m2", manifest, path, check=check)
    finally:
        up.close()
        with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
            await server


@pytest.fixture(scope="module")
def digests():
    return W.DigestCache.load(open_model(MODEL))


def test_fetch_only_own_tensors_and_open_the_sparse_copy(tmp_path, digests):
    m = digests.manifest(10, 20, False)
    path = str(tmp_path / "copy.gguf")
    stats = asyncio.run(transfer(m, path))
    assert stats["received_bytes"] <= 1.05 * m.tensor_bytes
    assert stats["fetched_tensors"] == len(m.tensors)
    assert os.path.getsize(path) == m.file_bytes
    assert os.stat(path).st_blocks * 512 < 0.5 * m.file_bytes  # sparse: holes elsewhere
    index = open_model(path)  # the header is intact: backends open it like the real file
    assert index.hparams.n_blocks == 30
    with open(MODEL, "rb") as a, open(path, "rb") as b:
        for t in m.tensors:
            a.seek(t.offset), b.seek(t.offset)
            assert a.read(t.n_bytes) == b.read(t.n_bytes)
    # a second run finds everything in place: nothing crosses
    assert asyncio.run(transfer(m, path))["received_bytes"] == 0


def test_resume_after_interruption_and_corruption(tmp_path, digests):
    m = digests.manifest(0, 3, True)
    path = str(tmp_path / "copy.gguf")
    with pytest.raises((ConnectionError, W.WeightError, StreamClosed)):
        asyncio.run(transfer(m, path, fail_after=34))
    header, missing = W.plan_fetch(path, m)
    assert not header and 0 < len(missing) < len(m.tensors)
    # damage a tensor that had arrived: it is fetched again
    done = [t for t in m.tensors if t not in missing]
    W.write_at(path, done[0].offset, b"\xff" * 16)
    stats = asyncio.run(transfer(m, path))
    assert stats["fetched_tensors"] == len(missing) + 1
    assert W.plan_fetch(path, m) == (False, [])


def test_bad_chunks_are_refused(digests):
    m = digests.manifest(29, 30, False)
    f = W.Fetcher(m, False, list(m.tensors))
    (first, *_) = f.requests()
    with pytest.raises(W.WeightError, match="does not answer"):
        f.received(W.WeightData(first.offset + 1, first.length, False, b"\0" * first.length))
    f = W.Fetcher(m, True, [])
    (get,) = f.requests()
    with pytest.raises(W.WeightError, match="corrupt"):
        f.received(W.WeightData(0, get.length, True, b"not zlib"))


def test_manifest_json_roundtrip_and_bounds(digests):
    m = digests.manifest(5, 7, False)
    assert W.Manifest.from_json(m.to_json()) == m
    bad = m.to_json() | {"tensors": [["x", m.file_bytes, 10, "0" * 64]]}
    with pytest.raises(W.WeightError, match="outside"):
        W.Manifest.from_json(bad)
    with pytest.raises(W.WeightError, match="malformed"):
        W.Manifest.from_json({"sha256": "x"})


def test_local_file_with_the_same_digest_is_used(tmp_path, digests):
    m = digests.manifest(0, 1, False)
    assert check_local_file(MODEL, m)
    assert not check_local_file(str(tmp_path / "none.gguf"), m)


def test_transfer_progress_figures():
    p = W.TransferProgress(total_bytes=10_000_000, started_s=100.0)
    assert p.as_dict()["state"] == "waiting" and p.eta_s is None
    p.update(2_000_000, 102.0)  # 2 MB in 2 s: 1 MB/s, 8 s left
    d = p.as_dict()
    assert (d["done_bytes"], d["mb_s"], d["eta_s"], d["state"]) == (2_000_000, 1.0, 8.0, "fetching")
    from kafila.commands.status import transfer_line

    assert transfer_line(d) == "2.0 of 10.0 MB (20 %), 1.0 MB/s, 8 s left"  # `kafila status`, the host
    p.finish(104.0)
    assert p.as_dict()["state"] == "done" and p.eta_s == 0.0


class FakeNet:
    """The one edge a member opens to fetch its weights: an in-memory stream to serve_weights."""

    def __init__(self, reader, writer):
        self.stream = (reader, writer)

    def roster(self):
        return {}

    def signaling(self):
        return {"up": True, "resumes": 0, "last_outage_s": None}

    async def connect(self, peer):
        return FakeEdge(peer, self.stream)


class FakeEdge:
    def __init__(self, peer, stream=None):
        self.peer, self.stream = peer, stream

    async def open_stream(self):
        return self.stream

    async def close(self):
        pass


async def _sample_while(task, read):
    seen = []
    while not task.done():
        seen.append(read())
        await asyncio.sleep(0)
    await task
    return seen, read()


def _quiet_console():
    from rich.console import Console

    return Console(file=open(os.devnull, "w"))  # noqa: SIM115


def test_member_status_shows_the_transfer_live(tmp_path, digests):
    """/status during a fetch: bytes done of the total, MB/s and ETA, before the fetch returns."""
    from kafila.session.control.fetch import fetch_weights_from
    from kafila.session.control.participant import Participant, SessionConfig

    m = digests.manifest(10, 20, False)
    cfg = SessionConfig(name="m2", rendezvous=None, api=None, cache_dir=str(tmp_path))
    member = Participant(cfg, _quiet_console())

    async def run():
        up, down = Pipe(), Pipe()
        member.stage.net = FakeNet(down.reader, up)
        server = asyncio.create_task(serve_weights(up.reader, down, MODEL, m.file_bytes, {}))
        fetch = asyncio.create_task(fetch_weights_from(member.stage, m, "m1"))
        seen, last = await _sample_while(fetch, lambda: dict(member.status()["weights"]))
        up.close()
        await server
        return seen, last, fetch.result()

    seen, last, (_, weights) = asyncio.run(run())
    partial = [w for w in seen if w.get("state") == "fetching" and 0 < w["done_bytes"] < w["total_bytes"]]
    assert partial, seen[:3]
    assert all(w["mb_s"] is not None and w["eta_s"] is not None for w in partial)
    assert last["state"] == "done" and last["done_bytes"] == last["total_bytes"] and last["source"] == "host"
    assert weights == member.stage.state.weights


def test_host_status_shows_each_members_transfer_live(tmp_path, digests):
    """The host counts the bytes it serves each member: its /status has a partial figure per
    member while the transfer runs, and 'done' once the member closed its stream."""
    from kafila.session.control.host import HostParticipant
    from kafila.session.control.participant import SessionConfig

    m = digests.manifest(0, 10, True)
    cfg = SessionConfig(name="m1", rendezvous=None, api=None, cache_dir=str(tmp_path), model_path=MODEL)
    host = HostParticipant(cfg, _quiet_console())
    host.weights.digests = digests

    async def run():
        up, down = Pipe(), Pipe()
        host.weights.transfers["m2"] = W.TransferProgress(m.header_len + m.tensor_bytes, 0.0)
        served = asyncio.create_task(host.weights.serve(FakeEdge("m2"), up.reader, down))
        fetch = asyncio.create_task(fetch_weights(down.reader, up, "m2", m, str(tmp_path / "c.gguf")))
        seen, _ = await _sample_while(fetch, lambda: dict(host.status()["transfers"]["m2"]))
        up.close()
        await served
        return seen, host.status()["transfers"]["m2"]

    seen, last = asyncio.run(run())
    assert any(0 < t["done_bytes"] < t["total_bytes"] and t["state"] == "fetching" for t in seen), seen[:3]
    assert last["state"] == "done" and last["done_bytes"] == m.header_len + m.tensor_bytes


def test_manifest_must_be_exactly_the_planned_shard(digests):
    """Issue 15 item 6: a member checked only a manifest's own bounds (4 TiB, inside the file), so
    a host could have it fetch tensors outside its shard, or leave some of its shard out (holes)."""
    index = digests.index
    W.check_shard(digests.manifest(10, 20, False), index, 10, 20, False)
    W.check_shard(digests.manifest(0, 3, True), index, 0, 3, True)
    m = digests.manifest(10, 20, False)
    t0 = m.tensors[0]
    for bad, why in ((digests.manifest(10, 21, False), "extra"), (digests.manifest(11, 20, False), "missing"),
                     (digests.manifest(10, 20, True), "extra"),  # the head's tensors too
                     (W.Manifest(m.sha256, m.file_bytes + 1, m.header_len, m.header_sha256, m.tensors), "size"),
                     (W.Manifest(m.sha256, m.file_bytes, m.header_len + 8, m.header_sha256, m.tensors), "header"),
                     (W.Manifest(m.sha256, m.file_bytes, m.header_len, m.header_sha256,
                                 (W.TensorRange(t0.name, t0.offset, t0.n_bytes + 4, t0.sha256), *m.tensors[1:])),
                      "range")):  # fmt: skip
        with pytest.raises(W.WeightError, match=why):
            W.check_shard(bad, index, 10, 20, False)
    twice = m.to_json() | {"tensors": m.to_json()["tensors"] * 2}
    with pytest.raises(W.WeightError, match="twice"):
        W.Manifest.from_json(twice)


def test_no_tensor_is_fetched_before_the_header_says_the_manifest_is_the_shard(tmp_path, digests):
    """The member asks for the header first, checks the manifest against it, then the tensors:
    a manifest with an extra block ends the transfer having fetched no tensor byte."""
    m = digests.manifest(10, 21, False)  # the plan gave this member [10, 20)
    path = str(tmp_path / "copy.gguf")

    def check(p):
        W.check_shard(m, open_model(p), 10, 20, False)

    with pytest.raises(W.WeightError, match="extra"):
        asyncio.run(transfer(m, path, check=check))
    header, missing = W.plan_fetch(path, m)
    assert not header and missing == list(m.tensors)  # header verified, no tensor arrived
    with pytest.raises(W.WeightError, match="extra"):  # a copy that has the header: checked at once
        asyncio.run(transfer(m, path, check=check))
    good = digests.manifest(10, 20, False)
    stats = asyncio.run(transfer(good, path, check=lambda p: W.check_shard(good, open_model(p), 10, 20, False)))
    assert stats["fetched_tensors"] == len(good.tensors)
