"""The bulk lane (weights over TCP, kafila.session.weights.bulk): its sealed records without sockets, the
lane end to end on 127.0.0.1 moving a real model's ranges, keys that must be refused, and the
fallback to the QUIC stream (here an in-memory stream, as in test_weights.py)."""

import ast
import asyncio
import contextlib
import dataclasses
import os
import pathlib
import socket
import time

import pytest

from kafila.net import bulk_records as R
from kafila.session.weights import bulk as B
from kafila.session.weights import transfer as T
from kafila.session.weights import manifest as W
from kafila.session.wire.frames import BulkOffer, FrameDecoder, FrameError, Hello, encode
from kafila.session.weights.transfer import Lanes, fetch_weights, serve_weights
from tests.fake_link import Pipe

ROOT = pathlib.Path(__file__).resolve().parent.parent
KEY = bytes(range(32))


def pair(key=KEY):
    """A client and a server that agreed on traffic keys: (client sealer, server opener)."""
    hs = R.ClientHandshake(key, b"c" * 32)
    answer, server_keys = R.server_answer(key, hs.hello(), b"s" * 32)
    client_keys = hs.finish(answer)
    assert client_keys == server_keys
    return R.RecordSealer(client_keys.client_to_server), R.RecordOpener(server_keys.client_to_server)


# --- the record layer and the handshake, sans-I/O ------------------------------------------


def test_records_module_does_no_io():
    tree = ast.parse((ROOT / "kafila/net/bulk_records.py").read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert not roots & {"asyncio", "socket", "time", "selectors", "threading", "os", "kafila"}, roots


def test_records_carry_data_in_order_and_end_with_a_marker():
    sealer, opener = pair()
    data = os.urandom(R.MAX_RECORD_PLAINTEXT_BYTES * 2 + 123)
    wire = b"".join(sealer.seal(data)) + sealer.close()
    assert sealer.seal(b"") == []  # nothing to send is no record (an empty one means the end)
    got = []
    for i in range(0, len(wire), 70_000):  # any cut of the byte stream
        got += opener.feed(wire[i:i + 70_000])
    assert b"".join(got) == data and len(got) == 3 and opener.ended
    with pytest.raises(R.BulkError, match="closed"):
        sealer.seal(b"more")


def test_a_tampered_record_fails_authentication():
    sealer, opener = pair()
    (record,) = sealer.seal(b"weights" * 100)
    bad = bytearray(record)
    bad[40] ^= 1
    with pytest.raises(R.BulkError, match="record 0 failed authentication"):
        opener.feed(bytes(bad))


def test_a_replayed_or_reordered_record_fails():
    sealer, opener = pair()
    first, second = sealer.seal(b"a"), sealer.seal(b"b")
    assert opener.feed(first[0]) == [b"a"]
    with pytest.raises(R.BulkError, match="record 1 failed authentication"):
        opener.feed(first[0])  # the same record again
    sealer, opener = pair()
    first, second = sealer.seal(b"a"), sealer.seal(b"b")
    with pytest.raises(R.BulkError, match="record 0 failed authentication"):
        opener.feed(second[0])  # the second one first


def test_an_oversize_or_undersize_record_is_refused_before_it_is_read():
    _, opener = pair()
    with pytest.raises(R.BulkError, match="out of bounds"):
        opener.feed(R.RECORD_PREFIX.pack(R.MAX_RECORD_BYTES + 1))
    _, opener = pair()
    with pytest.raises(R.BulkError, match="out of bounds"):
        opener.feed(R.RECORD_PREFIX.pack(3))
    with pytest.raises(R.BulkError, match="out of bounds"):
        R.RecordOpener.record_length(R.RECORD_PREFIX.pack(1 << 31))


def test_records_sealed_with_another_key_do_not_open():
    sealer, _ = pair(os.urandom(32))
    _, opener = pair()
    with pytest.raises(R.BulkError, match="failed authentication"):
        opener.feed(sealer.seal(b"private weights")[0])


def test_the_handshake_fails_with_a_wrong_key_either_way():
    client = R.ClientHandshake(os.urandom(32), b"c" * 32)
    with pytest.raises(R.BulkError, match="names another offer"):  # another key: another id
        R.server_answer(KEY, client.hello(), b"s" * 32)
    forged = bytearray(R.ClientHandshake(KEY, b"c" * 32).hello())
    forged[-1] ^= 1  # the right id, without the key
    with pytest.raises(R.BulkError, match="client does not know the bulk lane key"):
        R.server_answer(KEY, bytes(forged), b"s" * 32)
    client = R.ClientHandshake(KEY, b"c" * 32)
    impostor = b"s" * 32 + os.urandom(32)  # a server without the key can only guess its MAC
    with pytest.raises(R.BulkError, match="server does not know the bulk lane key"):
        client.finish(impostor)
    with pytest.raises(R.BulkError, match="not a bulk lane handshake"):
        R.parse_client_hello(b"GET / HTTP/1.1\r\n" + bytes(68))
    with pytest.raises(R.BulkError, match="32 bytes"):
        R.ClientHandshake(b"short", b"c" * 32)


def test_each_connection_gets_its_own_keys():
    hs1, hs2 = R.ClientHandshake(KEY, b"1" * 32), R.ClientHandshake(KEY, b"2" * 32)
    k1 = R.server_answer(KEY, hs1.hello(), b"s" * 32)[1]
    k2 = R.server_answer(KEY, hs2.hello(), b"s" * 32)[1]
    assert len({k1.client_to_server, k1.server_to_client, k2.client_to_server, k2.server_to_client}) == 4


def test_offer_frames_are_validated():
    offer = BulkOffer(40123, KEY, ("127.0.0.1", "::1"))
    (back,) = FrameDecoder().feed(encode(offer))
    assert back == offer and not back.declined
    (decline,) = FrameDecoder().feed(encode(BulkOffer()))
    assert decline.declined
    (hello,) = FrameDecoder().feed(encode(Hello("m2", "weights", bulk=True)))
    assert hello.bulk
    (plain,) = FrameDecoder().feed(encode(Hello("m2", "weights")))  # as a peer from before sends it
    assert not plain.bulk and b"bulk" not in encode(Hello("m2", "weights"))
    for bad in (BulkOffer(0, KEY, ()), BulkOffer(1, b"", ("127.0.0.1",)), BulkOffer(1, KEY, ("host.lan",)),
                BulkOffer(1, KEY, ()), BulkOffer(1, KEY, ("10.0.0.1",) * 9)):  # fmt: skip
        with pytest.raises(FrameError):
            FrameDecoder().feed(encode(bad))


# --- the lane on 127.0.0.1 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small real GGUF (random weights) and its digests."""
    from backends.gguf import open_model
    from tests.synthetic_gguf import write_llama_gguf

    path = str(write_llama_gguf(tmp_path_factory.mktemp("bulk") / "tiny.gguf"))
    return path, W.DigestCache.load(open_model(path))


async def transfer(model_path, manifest, copy, listener, lanes, old_server=False):
    """fetch_weights over an in-memory 'QUIC' stream to serve_weights (with `listener`)."""
    up, down = Pipe(), Pipe()
    if old_server:
        server = asyncio.create_task(_old_serve(up.reader, down, model_path, manifest.file_bytes))
    else:
        server = asyncio.create_task(serve_weights(up.reader, down, model_path, manifest.file_bytes, {},
                                                   bulk=listener))  # fmt: skip
    sent = None
    try:
        stats = await fetch_weights(down.reader, up, "m2", manifest, copy, lanes=lanes)
    finally:
        up.close()
        with contextlib.suppress(ConnectionError, OSError, asyncio.IncompleteReadError):
            sent = await server
    return stats, sent, up.writes


async def _old_serve(reader, writer, path, file_bytes):
    """A server from before the bulk lane: it ignores Hello's flag and answers chunks."""
    from kafila.session.wire.streams import FrameWriter, StreamClosed, read_frame

    out = FrameWriter(writer)
    while True:
        try:
            frame = await read_frame(reader, None)
        except StreamClosed:
            return out.bytes_sent
        if not isinstance(frame, Hello):
            await out.send(W.serve_chunk(path, file_bytes, frame))


def same_ranges(a, b, manifest):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        for t in manifest.tensors:
            fa.seek(t.offset), fb.seek(t.offset)
            if fa.read(t.n_bytes) != fb.read(t.n_bytes):
                return False
    return True


def test_the_tcp_lane_moves_the_ranges_and_every_digest_checks(model, tmp_path):
    path, digests = model
    m = digests.manifest(1, 3, True)
    copy = str(tmp_path / "copy.gguf")

    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        lanes = Lanes(B.dial)
        try:
            return await transfer(path, m, copy, listener, lanes), lanes, listener.refused
        finally:
            await listener.close()

    (stats, sent, quic_writes), lanes, refused = asyncio.run(run())
    assert stats["lane"] == lanes.lane == "tcp" and lanes.note is None and refused == 0
    assert stats["fetched_tensors"] == len(m.tensors)
    assert W.plan_fetch(copy, m) == (False, [])  # header and every tensor: their SHA-256 match
    assert same_ranges(path, copy, m)
    assert quic_writes == 1  # only the Hello crossed the QUIC stream; every request went over TCP
    assert sent >= m.tensor_bytes


def test_a_record_altered_on_the_way_ends_the_transfer_with_one_clear_error(model, tmp_path):
    path, digests = model
    m = digests.manifest(0, 4, True)

    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        proxy = await _flipping_proxy(listener.port, flip_at=1000)
        port = proxy.sockets[0].getsockname()[1]
        lanes = Lanes(lambda offer: B.dial(dataclasses.replace(offer, port=port)))
        try:
            with pytest.raises(R.BulkError, match="failed authentication"):
                await transfer(path, m, str(tmp_path / "c.gguf"), listener, lanes)
        finally:
            proxy.close()
            await listener.close()

    asyncio.run(run())


async def _flipping_proxy(port, flip_at):
    """A TCP relay to 127.0.0.1:port that flips one bit of the server's stream at byte `flip_at`."""

    async def pipe(r, w, flip):
        seen = 0
        with contextlib.suppress(ConnectionError, OSError):
            while data := await r.read(65536):
                if flip is not None and seen <= flip < seen + len(data):
                    data = bytearray(data)
                    data[flip - seen] ^= 1
                    data = bytes(data)
                seen += len(data)
                w.write(data)
                await w.drain()
        w.close()

    async def handle(cr, cw):
        sr, sw = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.gather(pipe(cr, sw, None), pipe(sr, cw, flip_at))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_wrong_a_reused_or_an_expired_key_is_refused(monkeypatch):
    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            ticket = listener.offer()
            _, writer = await B.dial(ticket.frame)  # the right key, once
            assert ticket.accepted
            server_reader, server_writer = await ticket.connection()
            writer.write(b"hello over the lane")
            assert await server_reader.readexactly(19) == b"hello over the lane"
            writer.close()
            with pytest.raises(asyncio.IncompleteReadError):  # the end marker: a clean end
                await server_reader.readexactly(1)
            server_writer.close()
            with pytest.raises(R.BulkError, match="refused the key"):
                await B.dial(ticket.frame)  # the same key again
            with pytest.raises(R.BulkError, match="refused the key"):
                await B.dial(BulkOffer(listener.port, os.urandom(32), ("127.0.0.1",)))
            monkeypatch.setattr(B, "OFFER_TTL_S", 0.05)
            late = listener.offer()
            await asyncio.sleep(0.2)
            assert await late.connection() is None
            with pytest.raises(R.BulkError, match="refused the key"):
                await B.dial(late.frame)
            assert listener.refused == 3
            revoked = listener.offer()
            listener.revoke(revoked)
            with pytest.raises(R.BulkError, match="refused the key"):
                await B.dial(revoked.frame)
        finally:
            await listener.close()

    asyncio.run(run())


def test_the_listener_bounds_offers_and_silent_connections(monkeypatch):
    monkeypatch.setattr(B, "BULK_HANDSHAKE_TIMEOUT_S", 0.2)

    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        try:
            tickets = [listener.offer() for _ in range(B.MAX_LANES)]
            assert all(tickets) and listener.offer() is None  # no more than MAX_LANES at once
            for t in tickets:
                listener.revoke(t)
            _, w = await asyncio.open_connection("127.0.0.1", listener.port)  # says nothing
            await asyncio.sleep(0.5)
            assert listener.refused == 1 and listener._handshakes == 0
            w.close()
        finally:
            await listener.close()

    asyncio.run(run())


def test_offers_name_ip_addresses_only():
    assert B.offer_hosts("127.0.0.1", ["10.0.0.2"]) == ("127.0.0.1",)
    assert B.offer_hosts("0.0.0.0", ["192.168.1.5", "203.0.113.9", "192.168.1.5", "a.lan", "0.0.0.0"]) == (
        "192.168.1.5", "203.0.113.9")  # fmt: skip


# --- fallback: the QUIC stream carries it all -------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once closed


def test_an_unreachable_lane_falls_back_to_the_quic_stream(model, tmp_path):
    path, digests = model
    m = digests.manifest(0, 4, True)
    copy = str(tmp_path / "copy.gguf")

    async def run():
        listener = await B.BulkListener.start("127.0.0.1", [])
        listener.port = _closed_port()  # offers name a port nobody listens on
        lanes = Lanes(B.dial)
        try:
            stats, _, quic_writes = await transfer(path, m, copy, listener, lanes)
        finally:
            await listener.close()
        return stats, lanes, quic_writes

    stats, lanes, quic_writes = asyncio.run(run())
    assert stats["lane"] == lanes.lane == "quic" and "cannot reach 127.0.0.1 port" in lanes.note
    assert quic_writes > 1 and W.plan_fetch(copy, m) == (False, []) and same_ranges(path, copy, m)


def test_a_server_without_a_lane_or_from_before_it_serves_over_quic(model, tmp_path, monkeypatch):
    path, digests = model
    m = digests.manifest(0, 2, False)
    monkeypatch.setattr(T, "OFFER_WAIT_S", 0.3)

    for old in (False, True):
        lanes = Lanes(B.dial)
        copy = str(tmp_path / f"copy-{old}.gguf")
        stats, _, _ = asyncio.run(transfer(path, m, copy, None, lanes, old_server=old))
        assert stats["lane"] == "quic" and W.plan_fetch(copy, m) == (False, [])
        assert ("no bulk lane offer within" if old else "offers no TCP lane") in lanes.note


# --- a session: one member over TCP, one over QUIC, both answer; its ring frames on QUIC ---------


@pytest.mark.session
@pytest.mark.model
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_session_fetches_over_both_lanes_and_answers(tmp_path):
    from kafila.tooling.launch import LocalSession, get_json, stream_chat
    from tests.default_model import MODEL

    if MODEL is None:
        pytest.skip("default model not installed")
    s = LocalSession(members=3, context=256, concurrency=1, weights_lane={"m3": "quic"}, ring_lane="quic",
                     log_dir=str(tmp_path), cache_root=str(tmp_path / "cache"))  # fmt: skip
    s.start(timeout_s=240)
    try:
        # --ring-lane quic: the ring's frames stay on the QUIC edges (what a NAT between members
        # leaves), while the weights lane is unaffected
        deadline = time.monotonic() + 15  # the host hears each member's edge every 2 s
        while len(edges := get_json(s.api("m1"), "/status")["edges"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(edges) == 3 and {e["lane"] for e in edges} == {"quic"}, edges
        lanes = {n: get_json(s.api(n), "/status")["weights"] for n in ("m2", "m3")}
        assert lanes["m2"]["lane"] == "tcp" and lanes["m3"]["lane"] == "quic", lanes
        assert all(w["state"] == "done" and w["mb_s"] > 0 for w in lanes.values()), lanes
        transfers = get_json(s.api("m1"), "/status")["transfers"]
        assert {n: t["lane"] for n, t in transfers.items()} == {"m2": "tcp", "m3": "quic"}, transfers
        with open(s.proc("m2").log_path) as log:
            assert "over TCP" in log.read()
        answers = {n: stream_chat(s.api(n), "The capital of France is", 6)["text"] for n in s.names}
        assert len(set(answers.values())) == 1 and next(iter(answers.values())), answers
    finally:
        codes = s.stop()
    assert all(c in (0, -2, 130) for c in codes.values()), codes
