"""The frame codec: round trips, and rejection of anything the plan does not allow."""

import struct

import msgpack
import numpy as np
import pytest

from kafila.session.wire import frames as F

LIM = F.Limits(hidden=8, context=32, slots=2, vocab=100)


def roundtrip(frame, limits=LIM, chunk=None):
    data = F.encode(frame)
    dec = F.FrameDecoder(limits)
    out = []
    if chunk is None:
        out = dec.feed(data)
    else:  # byte by byte / in pieces: the decoder must reassemble
        for i in range(0, len(data), chunk):
            out += dec.feed(data[i : i + chunk])
    assert len(out) == 1
    return out[0]


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_activation_roundtrip(chunk):
    x = np.arange(24, dtype=np.float32).reshape(3, 8)
    a = F.Activation("r1", 1, 4, 4, (2,), x, (("m1", 120), ("m2", 300)))
    b = roundtrip(a, chunk=chunk)
    assert isinstance(b, F.Activation)
    assert (b.req_id, b.slot, b.cache_len, b.pos0, b.zeros, b.trace) == ("r1", 1, 4, 4, (2,), a.trace)
    np.testing.assert_array_equal(b.hidden, x)
    assert b.mask().tolist() == [1, 1, 0, 1, 1, 1, 1]
    assert b.positions().tolist() == [4, 5, 6]
    assert not b.keep and "keep" not in msgpack.unpackb(F.encode(a)[8:8 + struct.unpack(">I", F.encode(a)[:4])[0]])
    assert roundtrip(F.Activation("r1", 1, 4, 4, (2,), x, keep=True), chunk=chunk).keep  # a hybrid's prompt end


def test_other_frames_roundtrip():
    req = F.Request("m2:1", "m2", "m1", 5, True, np.array([1, 2, 3], dtype=np.int32), 0.7, 0.9, 42)
    r = roundtrip(req)
    assert (r.temperature, r.top_p, r.seed) == (0.7, 0.9, 42)
    assert r.prompt.tolist() == [1, 2, 3] and (r.req_id, r.origin, r.dst, r.max_new) == ("m2:1", "m2", "m1", 5)
    for f in (
        F.Tokens("m2:1", "m2", (4, 5), True, "error", "member m3 left", 503, (("tok_s", 41.5),)),
        F.Hello("m2", "ring"),
        F.Free(1),
        F.Free(1, keep=True),
        F.Cancel("m2:1", "m1"),
        F.WeightGet(100, 4096, True),
        F.WeightData(100, 3, False, b"abc"),
    ):
        assert roundtrip(f) == f
    several = F.encode(F.Free(0)) + F.encode(F.Free(1))
    assert F.FrameDecoder(LIM).feed(several) == [F.Free(0), F.Free(1)]


def test_routed_frames_carry_their_hops_within_a_bound():
    """Issue 15 item 6: Request, Tokens and Cancel count their hops (a header without one, from
    a peer before hops, is 0); a count outside 0..MAX_HOPS is refused like any bad field."""
    prompt = np.array([1], dtype=np.int32)
    for f in (F.Request("r", "m2", "m1", 1, True, prompt, hops=3), F.Tokens("r", "m2", (4,), hops=7),
              F.Cancel("r", "m1", F.MAX_HOPS)):
        got = roundtrip(f)
        assert got.hops == f.hops and type(got) is type(f)
    assert roundtrip(F.Cancel("r", "m1")).hops == 0
    assert F.FrameDecoder(LIM).feed(raw({"k": "cancel", "rid": "r", "dst": "m"})) == [F.Cancel("r", "m")]
    for hops in (-1, F.MAX_HOPS + 1, True, "1"):
        with pytest.raises(F.FrameError, match="hops"):
            F.FrameDecoder(LIM).feed(raw({"k": "cancel", "rid": "r", "dst": "m", "hops": hops}))


def test_tokens_carry_the_heads_planned_drafts_for_the_origin():
    """frames.Tokens.want: the live optimiser's draft length for the request, the origin's
    budget; absent (a head before it) or -1 is no plan; outside -1..MAX_ORIGIN_DRAFT refused."""
    assert roundtrip(F.Tokens("r", "m2", (4,), want=3)).want == 3
    assert roundtrip(F.Tokens("r", "m2", (4,))).want == -1
    head = {"k": "tok", "rid": "r", "dst": "m", "ids": [4], "done": False, "finish": "", "error": "", "status": 0,
            "stats": []}  # fmt: skip
    assert F.FrameDecoder(LIM).feed(raw({**head, "want": 0}))[0].want == 0
    for want in (-2, F.MAX_ORIGIN_DRAFT + 1, True, "1"):
        with pytest.raises(F.FrameError, match="want"):
            F.FrameDecoder(LIM).feed(raw({**head, "want": want}))


def raw(header, payload=b""):
    h = msgpack.packb(header)
    return struct.pack(">II", len(h), len(payload)) + h + payload


ACT = {"k": "act", "rid": "r", "slot": 0, "cache": 0, "pos0": 0, "zeros": [], "dtype": "f32", "shape": [1, 8]}


@pytest.mark.parametrize(
    "header,payload,why",
    [
        ({**ACT, "shape": [1, 9]}, b"\0" * 36, "row width"),
        ({**ACT, "dtype": "f16"}, b"\0" * 32, "dtype"),
        ({**ACT, "slot": 2}, b"\0" * 32, "slot"),
        ({**ACT, "slot": -1}, b"\0" * 32, "slot"),
        ({**ACT, "cache": 31, "shape": [2, 8]}, b"\0" * 64, "context"),
        ({**ACT, "zeros": [5]}, b"\0" * 32, "zeros"),
        ({**ACT}, b"\0" * 31, "payload"),
        ({**ACT, "rid": ""}, b"\0" * 32, "rid"),
        ({**ACT, "rid": "x" * 65}, b"\0" * 32, "rid"),
        ({**ACT, "slot": True}, b"\0" * 32, "slot"),
        ({**ACT, "trace": [["m1", "x"]]}, b"\0" * 32, "trace"),
        ({**ACT, "keep": 1}, b"\0" * 32, "keep"),
        ({**ACT, "keep": False}, b"\0" * 32, "keep"),
        ({"k": "tok", "rid": "r", "dst": "m", "ids": [100], "done": False, "finish": "", "error": "", "status": 0}, b"", "vocabulary"),
        ({"k": "req", "rid": "r", "origin": "a", "dst": "b", "max_new": 1, "eos": True, "dtype": "i32", "shape": [33], "temp": 0.0, "top_p": 1.0, "seed": -1}, b"\0" * 132, "prompt"),
        ({"k": "req", "rid": "r", "origin": "a", "dst": "b", "max_new": 1, "eos": True, "dtype": "i32", "shape": [1], "temp": -1.0, "top_p": 1.0, "seed": -1}, b"\0" * 4, "temp"),
        ({"k": "nope"}, b"", "unknown frame kind"),
        ({"k": "free", "slot": 0, "keep": 1}, b"", "keep"),
        ({"k": "hello", "name": "m", "purpose": "x"}, b"", "purpose"),
        ({"k": "wget", "off": 0, "len": F.WEIGHT_CHUNK_BYTES + 1, "z": False}, b"", "len"),
    ],
)
def test_rejects_before_allocating(header, payload, why):
    with pytest.raises(F.FrameError, match=why):
        F.FrameDecoder(LIM).feed(raw(header, payload))


def test_header_not_a_map_and_garbage():
    with pytest.raises(F.FrameError):
        F.FrameDecoder(LIM).feed(struct.pack(">II", 3, 0) + b"\x93\x01\x02")
    with pytest.raises(F.FrameError):
        F.FrameDecoder(LIM).feed(struct.pack(">II", 2, 0) + b"\xc1\xc1")


def test_oversized_lengths_rejected_from_the_prefix_alone():
    with pytest.raises(F.FrameError, match="MAX_FRAME_BYTES"):
        F.FrameDecoder(LIM).feed(struct.pack(">II", 10, F.MAX_FRAME_BYTES + 1))
    with pytest.raises(F.FrameError, match="header length"):
        F.FrameDecoder(LIM).feed(struct.pack(">II", F.MAX_HEADER_BYTES + 1, 0))
    with pytest.raises(F.FrameError, match="header length"):
        F.FrameDecoder(LIM).feed(struct.pack(">II", 0, 0))


def test_ring_frames_need_a_plan():
    with pytest.raises(F.FrameError, match="before the plan"):
        F.FrameDecoder(None).feed(F.encode(F.Free(0)))
    assert F.FrameDecoder(None).feed(F.encode(F.Hello("m1", "weights"))) == [F.Hello("m1", "weights")]


def test_fuzz_never_crashes():
    rng = np.random.default_rng(0)
    good = F.encode(F.Activation("r", 0, 0, 0, (), np.zeros((2, 8), np.float32)))
    for _ in range(2000):
        data = bytearray(good)
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(len(data))] = rng.integers(256)
        try:
            F.FrameDecoder(LIM).feed(bytes(data))
        except F.FrameError:
            pass


def test_no_io_imports():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(F))
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & {"asyncio", "socket", "time", "threading"}
