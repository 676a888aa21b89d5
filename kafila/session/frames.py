"""The one frame codec of every Kafila edge stream (ring and weight transfer).

Theory of operation. A frame on the wire is

    u32 big-endian header length | u32 big-endian payload length | msgpack header | payload

The header is a small map whose "k" names the kind; the payload is raw little-endian bytes
(an activation's float32 hidden states, a prompt's int32 token ids, a chunk of weights).
Decoding happens in three steps, each validated before the next allocates anything:

1. `parse_prefix` checks both lengths against MAX_HEADER_BYTES / MAX_FRAME_BYTES;
2. `parse_header` decodes the header, checks every field against `Limits` (what the plan and the
   model allow: hidden size, context, slots) and that the declared payload length is exactly what
   the header's dtype and shape imply;
3. `build_frame` wraps the payload (a numpy array over it) into a frozen frame.

Anything else raises FrameError, which the I/O layer turns into closing that edge with the reason.
A frame of our own that cannot be encoded (a payload over the limit) raises EncodeError instead:
that is our error, not the neighbour's, and it fails the request that made the frame, never the
edge (a long prompt's activations travel in chunks that fit: scheduler.prefill_chunk_tokens).
No I/O here: `FrameDecoder.feed(bytes) -> [frames]` drives the same steps for tests and any
transport; `read_frame` (in ring.py) drives them over an asyncio stream.

A weight stream may also carry one `BulkOffer` (the server's answer to a `Hello` with `bulk`:
where and with which key to fetch over TCP instead, kafila.session.bulk); a peer from before
that sends no such Hello and gets no offer.

Frames that are not addressed to the member that reads them (requests, tokens, cancels) carry a
destination `dst` and are forwarded along the ring: every control message travels in the ring's
direction, like activations, so one stream per ring edge suffices (see ring.py). They count
their `hops` (how many members passed them on): a correct ring delivers any of them within
len(ring) - 2, so a node drops one past len(ring) + 1 instead of letting it circle (a member
that re-sends what it should not, or a ring whose names disagree).
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import msgpack
import numpy as np

from kafila.net.roster import is_ip

PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 64 << 10  # mask zeros and prompts' ids live in payloads or stay small
MAX_FRAME_BYTES = 16 << 20  # payload: 16 MiB bounds a prefill of 4096 positions × hidden 1024
MAX_NAME_CHARS = 64
MAX_TOKENS_PER_FRAME = 256
MAX_ERROR_CHARS = 500
MAX_TRACE_ENTRIES = 64
MAX_BATCH_ROWS = 32  # activations of one micro-batch (the head's slots are at most 32)
MAX_TEMPERATURE = 100.0
MAX_HOPS = 255  # the wire's bound on a routed frame's hops; the ring's own is len(ring) + 1
WEIGHT_CHUNK_BYTES = 4 << 20
FINISH_REASONS = ("", "stop", "length", "error")
PURPOSES = ("ring", "weights")
MAX_BULK_HOSTS = 8  # addresses a bulk lane offer names
MAX_HOST_CHARS = 45  # the longest IPv6 literal


class FrameError(Exception):
    """A malformed or out-of-bounds frame: the edge that carried it is closed with this reason."""


class EncodeError(FrameError):
    """A frame of ours over a bound (h11's LocalProtocolError): nothing was written, the edge
    stays up, and only the request that made the frame fails."""


@dataclass(frozen=True)
class Limits:
    """What the session's plan and model allow on the wire."""

    hidden: int  # the model's hidden size: activations are float32 [n, hidden]
    context: int  # the most physical positions one slot may hold
    slots: int  # ring slot ids are 0..slots-1 (the session's concurrency)
    vocab: int  # token ids are 0..vocab-1
    # the largest activation payload one frame may carry on this ring: MAX_FRAME_BYTES in every
    # session; a test lowers it (on every node alike) to make a short prompt need several chunks
    frame_bytes: int = MAX_FRAME_BYTES

    def __post_init__(self) -> None:
        if not 0 < int(self.frame_bytes) <= MAX_FRAME_BYTES:
            raise ValueError(f"Limits.frame_bytes must be in 1..{MAX_FRAME_BYTES}")
        for name in ("hidden", "context", "slots", "vocab"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Limits.{name} must be >= 1")


# --- frames -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """The first frame on every stream: who opens it and what for."""

    name: str
    purpose: str  # "ring" | "weights"
    epoch: int = 1  # a ring stream's plan generation (a replan opens new edges: stale ones are dropped)
    bulk: bool = False  # a weights stream: the fetcher takes a BulkOffer (a peer from before ignores it)


@dataclass(frozen=True)
class Activation:
    """Hidden states of n new positions of one request, on their way round the ring.

    Every stage rebuilds the same mask: ones over cache_len + n physical positions except
    `zeros` (masked-out physical positions), and positions pos0 .. pos0+n-1.
    """

    req_id: str
    slot: int
    cache_len: int  # physical positions already in the slot's KV (0: start a fresh slot)
    pos0: int  # logical position of the first new position
    zeros: tuple[int, ...]
    hidden: np.ndarray  # float32 [n, hidden]
    trace: tuple[tuple[str, int], ...] = ()  # (stage, compute µs) appended by every stage
    # a micro-batch (batched decode rows): `rows` activations written back to back, this one
    # row `row` of them; every stage runs them as one forward and passes them on together
    rows: int = 1
    row: int = 0

    @property
    def n(self) -> int:
        return int(self.hidden.shape[0])

    def positions(self) -> np.ndarray:
        return np.arange(self.pos0, self.pos0 + self.n, dtype=np.int64)

    def mask(self) -> np.ndarray:
        m = np.ones(self.cache_len + self.n, dtype=np.int64)
        if self.zeros:
            m[list(self.zeros)] = 0
        return m


@dataclass(frozen=True)
class Free:
    """Release a ring slot's KV on every stage (the request it held is over)."""

    slot: int


@dataclass(frozen=True)
class Request:
    """A prompt typed at member `origin`, travelling to the head `dst`."""

    req_id: str
    origin: str
    dst: str
    max_new: int
    stop_at_eos: bool
    prompt: np.ndarray  # int32 [n]
    temperature: float = 0.0  # 0: greedy (the ring reproduces `kafila run` exactly)
    top_p: float = 1.0
    seed: int = -1  # -1: none
    speculate: bool = True  # False: this request must not speculate (the API's "speculate": false)
    hops: int = 0  # members that passed it on so far (0 from its origin)


@dataclass(frozen=True)
class Tokens:
    """New tokens of request `req_id` travelling from the head to `dst` (the origin)."""

    req_id: str
    dst: str
    ids: tuple[int, ...]
    done: bool = False
    finish: str = ""  # when done: "stop" | "length" | "error"
    error: str = ""  # when finish == "error": one line naming the cause
    status: int = 0  # HTTP status for an error before any token (0: none)
    stats: tuple[tuple[str, float], ...] = ()  # with done: the ring's latest measurements
    hops: int = 0  # members that passed it on so far (0 from the head)


@dataclass(frozen=True)
class Cancel:
    """The origin gave up on request `req_id` (its client went away)."""

    req_id: str
    dst: str
    hops: int = 0  # members that passed it on so far (0 from its origin)


@dataclass(frozen=True)
class WeightGet:
    """Ask the host for bytes [offset, offset+length) of the model file."""

    offset: int
    length: int
    compress: bool = False


@dataclass(frozen=True)
class WeightData:
    offset: int
    length: int  # bytes of the file range (before compression)
    compressed: bool
    data: bytes


@dataclass(frozen=True)
class BulkOffer:
    """The serving peer's answer to a weights Hello with `bulk`: fetch over TCP from one of
    `hosts` at `port`, proving `key` (kafila.net.bulk_records). Only ever sent on an edge's
    stream (TLS 1.3, pinned certificates): the key is secret to the two peers."""

    port: int = 0  # 0: a decline (no lane here: fetch on this stream), with no key and no hosts
    key: bytes = b""  # 32 random bytes, one connection, expires unused (kafila.session.bulk)
    hosts: tuple[str, ...] = ()  # IP literals of the serving machine

    @property
    def declined(self) -> bool:
        return self.port == 0


Frame = Hello | Activation | Free | Request | Tokens | Cancel | WeightGet | WeightData | BulkOffer


# --- encoding ----------------------------------------------------------------------------


def _pack(header: dict, payload: bytes | memoryview = b"", max_payload: int = MAX_FRAME_BYTES) -> bytes:
    h = msgpack.packb(header, use_bin_type=True)
    kind = {"act": "an activation", "req": "a request", "tok": "a tokens"}.get(header["k"], f"a {header['k']}")
    if len(h) > MAX_HEADER_BYTES:
        raise EncodeError(f"{kind} frame's header of {len(h)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(payload) > max_payload:
        raise EncodeError(f"{kind} frame's payload of {len(payload)} bytes exceeds the "
                          f"frame limit of {max_payload} bytes")  # fmt: skip
    return b"".join((PREFIX.pack(len(h), len(payload)), h, payload))


def encode(frame: Frame, limits: Limits | None = None) -> bytes:
    """The wire bytes of one frame (EncodeError if it exceeds a bound: `limits.frame_bytes` for
    activations)."""
    if isinstance(frame, Activation):
        x = np.ascontiguousarray(frame.hidden, dtype="<f4")
        return _pack(
            {"k": "act", "rid": frame.req_id, "slot": frame.slot, "cache": frame.cache_len,
             "pos0": frame.pos0, "zeros": list(frame.zeros), "dtype": "f32",
             "shape": list(x.shape), "trace": [list(t) for t in frame.trace],
             **({"rows": frame.rows, "row": frame.row} if frame.rows > 1 else {})},
            x.data.cast("B"), MAX_FRAME_BYTES if limits is None else limits.frame_bytes,
        )  # fmt: skip
    if isinstance(frame, Request):
        p = np.ascontiguousarray(frame.prompt, dtype="<i4")
        return _pack(
            {"k": "req", "rid": frame.req_id, "origin": frame.origin, "dst": frame.dst,
             "max_new": frame.max_new, "eos": frame.stop_at_eos, "dtype": "i32",
             "shape": list(p.shape), "temp": float(frame.temperature), "top_p": float(frame.top_p),
             "seed": int(frame.seed), "spec": bool(frame.speculate), "hops": frame.hops},
            p.data.cast("B"),
        )  # fmt: skip
    if isinstance(frame, Tokens):
        return _pack({"k": "tok", "rid": frame.req_id, "dst": frame.dst, "ids": list(frame.ids),
                      "done": frame.done, "finish": frame.finish, "error": frame.error,
                      "status": frame.status, "stats": [list(t) for t in frame.stats],
                      "hops": frame.hops})  # fmt: skip
    if isinstance(frame, Hello):
        h = {"k": "hello", "name": frame.name, "purpose": frame.purpose, "epoch": frame.epoch}
        return _pack(h | {"bulk": True} if frame.bulk else h)
    if isinstance(frame, Free):
        return _pack({"k": "free", "slot": frame.slot})
    if isinstance(frame, Cancel):
        return _pack({"k": "cancel", "rid": frame.req_id, "dst": frame.dst, "hops": frame.hops})
    if isinstance(frame, WeightGet):
        return _pack({"k": "wget", "off": frame.offset, "len": frame.length, "z": frame.compress})
    if isinstance(frame, WeightData):
        return _pack(
            {"k": "wdata", "off": frame.offset, "len": frame.length, "z": frame.compressed},
            frame.data,
        )
    if isinstance(frame, BulkOffer):
        return _pack({"k": "boffer", "port": frame.port, "key": frame.key.hex(), "hosts": list(frame.hosts)})
    raise TypeError(f"not a frame: {type(frame).__name__}")


# --- decoding ----------------------------------------------------------------------------


def parse_prefix(prefix: bytes) -> tuple[int, int]:
    """(header length, payload length), both within bounds."""
    if len(prefix) != PREFIX.size:
        raise FrameError("truncated frame prefix")
    hlen, plen = PREFIX.unpack(prefix)
    if not 0 < hlen <= MAX_HEADER_BYTES:
        raise FrameError(f"header length {hlen} out of bounds (1..{MAX_HEADER_BYTES})")
    if plen > MAX_FRAME_BYTES:
        raise FrameError(f"payload length {plen} exceeds MAX_FRAME_BYTES {MAX_FRAME_BYTES}")
    return hlen, plen


_KEY_RE = re.compile(r"[0-9a-f]{64}")


def _str(h: dict, key: str, limit: int = MAX_NAME_CHARS, empty: bool = False) -> str:
    v = h.get(key)
    if not isinstance(v, str) or len(v) > limit or (not v and not empty):
        raise FrameError(f"field {key!r} must be a string of 1..{limit} characters")
    return v


def _int(h: dict, key: str, lo: int, hi: int) -> int:
    v = h.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError(f"field {key!r} must be an integer in {lo}..{hi}, got {v!r}")
    return v


def _float(h: dict, key: str, lo: float, hi: float) -> float:
    v = h.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError(f"field {key!r} must be a number in {lo}..{hi}, got {v!r}")
    return float(v)


def _bool(h: dict, key: str) -> bool:
    v = h.get(key)
    if not isinstance(v, bool):
        raise FrameError(f"field {key!r} must be a boolean")
    return v


def _pairs(h: dict, key: str, types) -> None:
    v = h.get(key, [])
    if not isinstance(v, list) or len(v) > MAX_TRACE_ENTRIES or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and len(p[0]) <= MAX_NAME_CHARS
        and isinstance(p[1], types) and not isinstance(p[1], bool)
        for p in v
    ):
        raise FrameError(f"field {key!r} must be a short list of [name, number] pairs")


def _hops(h: dict) -> int:
    """A routed frame's hop count (absent: 0, as a peer from before hops sends it)."""
    return _int(h, "hops", 0, MAX_HOPS) if "hops" in h else 0


def _shape(h: dict, dtype: str, dims: int) -> tuple[int, ...]:
    if h.get("dtype") != dtype:
        raise FrameError(f"dtype must be {dtype}, got {h.get('dtype')!r}")
    s = h.get("shape")
    if not isinstance(s, list) or len(s) != dims or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in s
    ):
        raise FrameError(f"shape must be a list of {dims} non-negative integers, got {s!r}")
    return tuple(s)


def parse_header(data: bytes, payload_len: int, limits: Limits | None) -> dict:
    """Decode and validate a header; return it with "_size", the exact payload it implies.

    `limits` None admits only frames that need no plan (hello, weights)."""
    try:
        h = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0,
                            max_str_len=MAX_HEADER_BYTES, max_array_len=MAX_HEADER_BYTES,
                            max_map_len=32)  # fmt: skip
    except Exception as exc:  # msgpack raises several types on bad input
        raise FrameError(f"undecodable header ({type(exc).__name__})") from None
    if not isinstance(h, dict):
        raise FrameError("header is not a map")
    kind = h.get("k")
    size = 0
    if kind == "hello":
        _str(h, "name")
        if h.get("purpose") not in PURPOSES:
            raise FrameError(f"unknown stream purpose {h.get('purpose')!r}")
        if "epoch" in h:
            _int(h, "epoch", 0, 1 << 31)
        if "bulk" in h:
            _bool(h, "bulk")
    elif kind == "wget":
        _int(h, "off", 0, 1 << 48)
        _int(h, "len", 1, WEIGHT_CHUNK_BYTES)
        _bool(h, "z")
    elif kind == "wdata":
        _int(h, "off", 0, 1 << 48)
        length = _int(h, "len", 0, MAX_FRAME_BYTES)
        z = _bool(h, "z")
        if not z and payload_len != length:
            raise FrameError(f"weight chunk of {payload_len} bytes declares {length}")
        size = payload_len  # compressed chunks: any size up to the bound; checked on inflate
    elif kind == "boffer":
        hosts = h.get("hosts")
        if _int(h, "port", 0, 65535) == 0:
            if h.get("key") != "" or hosts != []:
                raise FrameError("a bulk decline (port 0) carries no key and no addresses")
        elif not isinstance(h.get("key"), str) or not _KEY_RE.fullmatch(h["key"]):
            raise FrameError("a bulk offer's key must be 64 hex digits")
        elif not isinstance(hosts, list) or not 1 <= len(hosts) <= MAX_BULK_HOSTS or not all(
            isinstance(a, str) and len(a) <= MAX_HOST_CHARS and is_ip(a) for a in hosts
        ):
            raise FrameError(f"a bulk offer names 1..{MAX_BULK_HOSTS} IP addresses")
    elif limits is None:
        raise FrameError(f"frame kind {kind!r} not allowed before the plan")
    elif kind == "act":
        _str(h, "rid")
        _int(h, "slot", 0, limits.slots - 1)
        cache = _int(h, "cache", 0, limits.context - 1)
        n, hidden = _shape(h, "f32", 2)
        if not 1 <= n <= limits.context - cache:
            raise FrameError(f"activation of {n} positions does not fit the context "
                             f"{limits.context} after {cache}")  # fmt: skip
        if hidden != limits.hidden:
            raise FrameError(f"activation width {hidden} is not the model's hidden size {limits.hidden}")
        _int(h, "pos0", 0, limits.context - 1)
        zeros = h.get("zeros")
        if not isinstance(zeros, list) or len(zeros) > cache or not all(
            isinstance(z, int) and not isinstance(z, bool) and 0 <= z < cache + n for z in zeros
        ):
            raise FrameError("mask zeros must be physical positions inside the slot")
        _pairs(h, "trace", int)
        if "rows" in h:
            rows = _int(h, "rows", 2, MAX_BATCH_ROWS)
            _int(h, "row", 0, rows - 1)
        size = n * hidden * 4
        if size > limits.frame_bytes:
            raise FrameError(f"activation of {size} bytes exceeds this ring's frame limit {limits.frame_bytes}")
    elif kind == "req":
        _str(h, "rid")
        _str(h, "origin")
        _str(h, "dst")
        _int(h, "max_new", 1, limits.context)
        _bool(h, "eos")
        _float(h, "temp", 0.0, MAX_TEMPERATURE)
        _float(h, "top_p", 0.0, 1.0)
        _int(h, "seed", -1, (1 << 63) - 1)
        if not isinstance(h.get("spec", True), bool):
            raise FrameError("field 'spec' must be a boolean")
        _hops(h)
        (n,) = _shape(h, "i32", 1)
        if not 1 <= n <= limits.context:
            raise FrameError(f"prompt of {n} tokens is outside 1..{limits.context}")
        size = n * 4
    elif kind == "tok":
        _str(h, "rid")
        _str(h, "dst")
        ids = h.get("ids")
        if not isinstance(ids, list) or len(ids) > MAX_TOKENS_PER_FRAME or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab for t in ids
        ):
            raise FrameError("token ids must be a short list of ids inside the vocabulary")
        _bool(h, "done")
        if h.get("finish") not in FINISH_REASONS:
            raise FrameError(f"unknown finish reason {h.get('finish')!r}")
        _str(h, "error", MAX_ERROR_CHARS, empty=True)
        _int(h, "status", 0, 599)
        _pairs(h, "stats", (int, float))
        _hops(h)
    elif kind == "free":
        _int(h, "slot", 0, limits.slots - 1)
    elif kind == "cancel":
        _str(h, "rid")
        _str(h, "dst")
        _hops(h)
    else:
        raise FrameError(f"unknown frame kind {kind!r}")
    if payload_len != size:
        raise FrameError(f"{kind} frame carries {payload_len} payload bytes, its header implies {size}")
    return h


def build_frame(h: dict, payload: bytes) -> Frame:
    """The frame of a validated header and its payload (arrays are read-only views)."""
    kind = h["k"]
    if kind == "act":
        # a writable copy of 4·hidden·n bytes: runtimes may share (and need to own) the buffer
        x = np.frombuffer(bytearray(payload), dtype="<f4").reshape(h["shape"])
        trace = tuple((a, b) for a, b in h.get("trace", []))
        return Activation(h["rid"], h["slot"], h["cache"], h["pos0"], tuple(h["zeros"]), x, trace,
                          h.get("rows", 1), h.get("row", 0))
    if kind == "req":
        p = np.frombuffer(payload, dtype="<i4")
        return Request(h["rid"], h["origin"], h["dst"], h["max_new"], h["eos"], p,
                       float(h["temp"]), float(h["top_p"]), h["seed"], h.get("spec", True), h.get("hops", 0))
    if kind == "tok":
        stats = tuple((a, b) for a, b in h.get("stats", []))
        return Tokens(h["rid"], h["dst"], tuple(h["ids"]), h["done"], h["finish"], h["error"], h["status"], stats,
                      h.get("hops", 0))
    if kind == "hello":
        return Hello(h["name"], h["purpose"], h.get("epoch", 1), h.get("bulk", False))
    if kind == "boffer":
        return BulkOffer(h["port"], bytes.fromhex(h["key"]), tuple(h["hosts"]))
    if kind == "free":
        return Free(h["slot"])
    if kind == "cancel":
        return Cancel(h["rid"], h["dst"], h.get("hops", 0))
    if kind == "wget":
        return WeightGet(h["off"], h["len"], h["z"])
    if kind == "wdata":
        return WeightData(h["off"], h["len"], h["z"], bytes(payload))
    raise FrameError(f"unknown frame kind {kind!r}")  # parse_header admits no other


class FrameDecoder:
    """Sans-I/O: feed it stream bytes, get whole validated frames back."""

    def __init__(self, limits: Limits | None = None) -> None:
        self.limits = limits
        self._buf = bytearray()
        self._need: tuple[int, int] | None = None  # (header, payload) lengths of the current frame
        self._header: dict | None = None

    def feed(self, data: bytes) -> list[Frame]:
        self._buf += data
        out: list[Frame] = []
        while True:
            if self._need is None:
                if len(self._buf) < PREFIX.size:
                    return out
                self._need = parse_prefix(bytes(self._buf[: PREFIX.size]))
                del self._buf[: PREFIX.size]
            hlen, plen = self._need
            if self._header is None:
                if len(self._buf) < hlen:
                    return out
                self._header = parse_header(bytes(self._buf[:hlen]), plen, self.limits)
                del self._buf[:hlen]
            if len(self._buf) < plen:
                return out
            payload = bytes(self._buf[:plen])
            del self._buf[:plen]
            out.append(build_frame(self._header, payload))
            self._need, self._header = None, None
