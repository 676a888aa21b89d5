"""The wire bytes of every frame kind, pinned: the table-driven codec (one entry per kind) writes
exactly what the encoder before it wrote (captured from it), and decodes it back to the frame.
Whose fault an error is stays a type: ours (EncodeError) is never the peer's (FrameError)."""

import numpy as np
import pytest

from kafila.session.wire import frames as F
from rendezvous.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

LIM = F.Limits(hidden=8, context=32, slots=2, vocab=100)
x = np.arange(24, dtype=np.float32).reshape(3, 8)
frames = [
    F.Hello("m2", "ring"), F.Hello("m2", "weights", 3, True),
    F.Activation("r1", 1, 4, 4, (2,), x, (("m1", 120), ("m2", 300))),
    F.Activation("r1", 1, 4, 4, (), x[:1], (), 3, 2),
    F.Free(1),
    F.Request("m2:1", "m2", "m1", 5, True, np.array([1, 2, 3], dtype=np.int32), 0.7, 0.9, 42),
    F.Request("m2:1", "m2", "m1", 5, False, np.array([1], dtype=np.int32), 0.0, 1.0, -1, False, 3),
    F.Tokens("m2:1", "m2", (4, 5), True, "error", "member m3 left", 503, (("tok_s", 41.5),), 2),
    F.Tokens("m2:1", "m2", ()),
    F.Cancel("m2:1", "m1"), F.Cancel("m2:1", "m1", 4),
    F.WeightGet(100, 4096, True), F.WeightData(100, 3, False, b"abc"),
    F.BulkOffer(), F.BulkOffer(9000, bytes(range(32)), ("127.0.0.1", "::1")),
]

# F.encode(frame).hex() for each of `frames`, from the encoder before the table (commit 41f5e63)
GOLDEN = [
    "000000250000000084a16ba568656c6c6fa46e616d65a26d32a7707572706f7365a472696e67a565706f636801",
    "0000002e0000000085a16ba568656c6c6fa46e616d65a26d32a7707572706f7365a777656967687473a565706f636803a462756c6bc3",
    "0000004f0000006089a16ba3616374a3726964a27231a4736c6f7401a5636163686504a4706f733004a57a65726f739102a56474797065a3663332a57368617065920308a574726163659292a26d317892a26d32cd012c000000000000803f0000004000004040000080400000a0400000c0400000e0400000004100001041000020410000304100004041000050410000604100007041000080410000884100009041000098410000a0410000a8410000b0410000b841",
    "0000004d000000208ba16ba3616374a3726964a27231a4736c6f7401a5636163686504a4706f733004a57a65726f7390a56474797065a3663332a57368617065920108a5747261636590a4726f777303a3726f7702000000000000803f0000004000004040000080400000a0400000c0400000e040",
    "0000000e0000000082a16ba466726565a4736c6f7401",
    "000000700000000c8da16ba3726571a3726964a46d323a31a66f726967696ea26d32a3647374a26d31a76d61785f6e657705a3656f73c3a56474797065a3693332a573686170659103a474656d70cb3fe6666666666666a5746f705f70cb3feccccccccccccda4736565642aa473706563c3a4686f707300010000000200000003000000",
    "00000070000000048da16ba3726571a3726964a46d323a31a66f726967696ea26d32a3647374a26d31a76d61785f6e657705a3656f73c2a56474797065a3693332a573686170659101a474656d70cb0000000000000000a5746f705f70cb3ff0000000000000a473656564ffa473706563c2a4686f70730301000000",
    "0000006d000000008aa16ba3746f6ba3726964a46d323a31a3647374a26d32a3696473920405a4646f6e65c3a666696e697368a56572726f72a56572726f72ae6d656d626572206d33206c656674a6737461747573cd01f7a573746174739192a5746f6b5f73cb4044c00000000000a4686f707302",
    "00000046000000008aa16ba3746f6ba3726964a46d323a31a3647374a26d32a369647390a4646f6e65c2a666696e697368a0a56572726f72a0a673746174757300a5737461747390a4686f707300",
    "000000200000000084a16ba663616e63656ca3726964a46d323a31a3647374a26d31a4686f707300",
    "000000200000000084a16ba663616e63656ca3726964a46d323a31a3647374a26d31a4686f707304",
    "000000170000000084a16ba477676574a36f666664a36c656ecd1000a17ac3",
    "000000160000000384a16ba57764617461a36f666664a36c656e03a17ac2616263",
    "0000001c0000000084a16ba6626f66666572a4706f727400a36b6579a0a5686f73747390",
    "0000006d0000000084a16ba6626f66666572a4706f7274cd2328a36b6579d94030303031303230333034303530363037303830393061306230633064306530663130313131323133313431353136313731383139316131623163316431653166a5686f73747392a93132372e302e302e31a33a3a31",
]


def test_every_kind_is_in_the_table_and_pinned():
    assert {type(f) for f in frames} == set(F._KINDS.values())


@pytest.mark.parametrize("i", range(len(GOLDEN)))
def test_bytes_are_the_previous_encoders_and_decode_back(i):
    frame = frames[i]
    data = F.encode(frame)
    assert data.hex() == GOLDEN[i]
    (back,) = F.FrameDecoder(LIM).feed(data)
    assert type(back) is type(frame)
    assert F.encode(back) == data


def test_our_encode_failure_is_not_the_peers_malformed_frame():
    big = F.Activation("r", 0, 0, 0, (), np.zeros((1, 8), np.float32))
    with pytest.raises(F.EncodeError) as err:
        F.encode(big, F.Limits(hidden=8, context=32, slots=2, vocab=100, frame_bytes=16))
    assert isinstance(err.value, LocalProtocolError) and not isinstance(err.value, F.FrameError)
    assert err.value.code == "too-large" and "frame limit of 16 bytes" in str(err.value)
    with pytest.raises(F.FrameError) as bad:
        F.FrameDecoder(LIM).feed(b"\0\0\0\0\0\0\0\0")
    assert isinstance(bad.value, RemoteProtocolError) and not isinstance(bad.value, LocalProtocolError)
    assert isinstance(bad.value, ProtocolError) and str(bad.value) == bad.value.reason  # one line, as before
    with pytest.raises(TypeError, match="not a frame"):
        F.encode(object())
