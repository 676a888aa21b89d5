"""Issue 15, finding 4 (sans-I/O): relay BIND proves return routability; relay byte budgets."""

from __future__ import annotations

from rendezvous import frames
from rendezvous.relay import RelayTable

A, B = b"a" * 16, b"b" * 16
ADDR_A, ADDR_B, VICTIM = ("10.0.0.1", 4000), ("10.0.0.2", 4000), ("192.0.2.99", 53)


def _bind(relay: RelayTable, token: bytes, addr, now: float = 0.0) -> None:
    challenge, to = relay.receive(frames.encode_bind(token), addr, now)
    assert to == addr and challenge[0] == frames.BIND_CHALLENGE
    _, nonce = frames.decode_bind_request(challenge)
    assert relay.receive(frames.encode_bind(token, nonce=nonce), addr, now) == (
        frames.encode_bind(token, ack=True), addr)


def test_spoofed_bind_cannot_point_an_edge_at_a_victim() -> None:
    """Before: one BIND from a spoofed source moved the binding, and the edge's traffic (up to
    64 MB/s) went to the victim. Now the relay only sends a challenge there, and binds nothing."""
    relay = RelayTable()
    for tok, addr in ((A, ADDR_A), (B, ADDR_B)):
        relay.add_member(tok, 7, 0)
        _bind(relay, tok, addr)
    relay.allocate(b"E" * 8, 7, A, B, 0.0)
    out = relay.receive(frames.encode_bind(B), VICTIM, 1.0)  # spoofed: B's token, the victim's address
    assert out is not None and out[1] == VICTIM and out[0][0] == frames.BIND_CHALLENGE
    assert len(out[0]) == len(frames.encode_bind(B))  # no amplification
    guessed = relay.receive(frames.encode_bind(B, nonce=b"\x01" * 16), VICTIM, 1.0)
    assert guessed[0][0] == frames.BIND_CHALLENGE and relay.stats.dropped["bad-nonce"] == 1
    data = frames.encode_data(b"E" * 8, b"q" * 1000)
    assert relay.receive(data, ADDR_A, 1.0) == (data, ADDR_B)  # still goes to B, not the victim
    # a nonce for one address does not bind another
    _, nonce_victim = frames.decode_bind_request(out[0])
    assert relay.receive(frames.encode_bind(B, nonce=nonce_victim), ("10.0.0.3", 1), 1.0)[0][0] == frames.BIND_CHALLENGE


def test_a_member_whose_address_changed_rebinds_by_answering() -> None:
    relay = RelayTable()
    relay.add_member(A, 7, 0)
    _bind(relay, A, ADDR_A)
    assert relay.receive(frames.encode_bind(A), ADDR_A, 1.0)[0][0] == frames.BIND_ACK  # refresh
    _bind(relay, A, ("10.0.0.1", 4001), 2.0)  # a new NAT mapping answers its own challenge


def test_session_and_global_relay_budgets() -> None:
    relay = RelayTable(session_bytes_per_s=1000, session_burst_bytes=5000,
                       global_bytes_per_s=1000, global_burst_bytes=8000)
    toks = [bytes([i]) * 16 for i in range(1, 7)]
    for i, tok in enumerate(toks):
        relay.add_member(tok, 7 if i < 4 else 8, i)
        _bind(relay, tok, (f"10.0.1.{i}", 1))
    relay.allocate(b"1" * 8, 7, toks[0], toks[1], 0.0)
    relay.allocate(b"2" * 8, 7, toks[2], toks[3], 0.0)
    relay.allocate(b"3" * 8, 8, toks[4], toks[5], 0.0)
    sent = {7: 0, 8: 0}
    for _ in range(10):
        for edge, src, session in ((b"1", 0, 7), (b"2", 2, 7), (b"3", 4, 8)):
            frame = frames.encode_data(edge * 8, b"x" * 991)
            if relay.receive(frame, (f"10.0.1.{src}", 1), 0.0) is not None:
                sent[session] += len(frame)
    assert sent[7] <= 5000  # two edges of one session share its budget
    assert sent[7] + sent[8] <= 8000  # and every session the global one
    assert relay.stats.dropped["session-rate-limited"] and relay.stats.dropped["global-rate-limited"]
