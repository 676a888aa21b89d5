"""Codec fuzzing (hypothesis): every decoder either returns a valid value or raises ProtocolError."""

from __future__ import annotations

import random

from aioice import stun
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.net.handshake import SealedChannel
from kafila.net.punch import Puncher
from kafila.net.roster import MemberInfo
from rendezvous import frames
from rendezvous import messages as m
from rendezvous.errors import ProtocolError
from rendezvous.relay import RelayTable
from rendezvous.stun import StunResponder

FUZZ = settings(max_examples=120, deadline=None)


@FUZZ
@given(st.binary(max_size=600))
def test_signaling_decode_raises_only_protocol_error(data: bytes) -> None:
    try:
        message = m.decode(data)
    except ProtocolError:
        return
    assert m.decode(m.encode(message)[4:]) == message


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.binary(max_size=40)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=6), max_leaves=20,
)


@FUZZ
@given(st.integers(0, 20), st.lists(_msgpack_values, max_size=6))
def test_signaling_decode_of_structured_garbage(tag: int, fields: list) -> None:
    import msgpack

    try:
        m.decode(msgpack.packb([tag, *fields], use_bin_type=True))
    except ProtocolError:
        pass


@FUZZ
@given(st.lists(st.binary(max_size=50), max_size=20))
def test_frame_reader_on_arbitrary_segments(chunks: list[bytes]) -> None:
    reader = m.FrameReader()
    try:
        for chunk in chunks:
            reader.feed(chunk)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=1700))
def test_relay_and_frames_survive_garbage(data: bytes) -> None:
    frames.kind_of(data)
    relay = RelayTable()
    relay.add_member(b"t" * 16, 1, 0)
    out = relay.receive(data, ("10.0.0.1", 9), 0.0)
    # only a BIND for a known token gets an answer: a challenge (or, echoing it, an ack) to its source
    assert out is None or (data[:1] == bytes([frames.BIND]) and out[1] == ("10.0.0.1", 9)
                           and len(out[0]) <= len(data))


@FUZZ
@given(st.binary(max_size=300))
def test_stun_responder_survives_garbage(data: bytes) -> None:
    StunResponder(port2=1).respond(data, ("10.0.0.1", 9), 0)
    StunResponder(port2=1).respond(b"\x00\x01" + data[:2] + b"\x21\x12\xa4\x42" + data[4:], ("10.0.0.1", 9), 1)


@FUZZ
@given(st.binary(max_size=200))
def test_punch_decode_raises_only_protocol_error(data: bytes) -> None:
    p = Puncher(b"E" * 8, b"k" * 32, [], 0.0, random.Random(0))
    try:
        p.receive(data, ("10.0.0.1", 9), 0.0)
    except ProtocolError:
        pass


@FUZZ
@given(st.binary(max_size=300))
def test_sealed_channel_rejects_garbage(data: bytes) -> None:
    channel = SealedChannel(b"k" * 32, is_host=True, nameplate=1, rid=1)
    try:
        channel.open(data)
    except ProtocolError:
        return
    raise AssertionError("garbage opened")


@FUZZ
@given(_msgpack_values | st.dictionaries(st.sampled_from(
    ["name", "descriptor", "fp", "rid", "cand", "nat"]), _msgpack_values))
def test_member_info_rejects_garbage(data: object) -> None:
    try:
        MemberInfo.from_wire(data)
    except ProtocolError:
        pass


def test_stun_message_roundtrip_sanity() -> None:
    request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
    assert StunResponder(port2=1).respond(bytes(request), ("10.0.0.1", 9), 0) is not None
