"""The one frame codec of every Kafila edge stream (ring and weight transfer).

Theory of operation. A frame on the wire is

    u32 big-endian header length | u32 big-endian payload length | msgpack header | payload

The header is a small map whose "k" names the kind; the payload is raw little-endian bytes
(an activation's float32 hidden states, a prompt's int32 token ids, a chunk of weights).
Every kind is one frame class holding its wire form next to its fields: `_to_wire` (header,
payload, bound), `_check` (a header's fields) and `_from_wire`; `_KINDS` maps "k" to it. Decoding
happens in three steps, each validated before the next allocates anything:

1. `parse_prefix` checks both lengths against MAX_HEADER_BYTES / MAX_FRAME_BYTES;
2. `parse_header` decodes the header, checks every field against `Limits` (what the plan and the
   model allow: hidden size, context, slots) and that the declared payload length is exactly what
   the header's dtype and shape imply;
3. `build_frame` wraps the payload (a numpy array over it) into a frozen frame.

Anything else raises FrameError (the peer's: a RemoteProtocolError), which the I/O layer turns into closing that edge with the reason.
A frame of our own that cannot be encoded (a payload over the limit) raises EncodeError instead:
that is our error, not the neighbour's, and it fails the request that made the frame, never the
edge (a long prompt's activations travel in chunks that fit: chunks.prefill_chunk_tokens).
No I/O here: `FrameDecoder.feed(bytes) -> [frames]` drives the same steps for tests and any
transport; `read_frame` (streams.py) drives them over an asyncio stream.

A weight stream may also carry one `BulkOffer` (the server's answer to a `Hello` with `bulk`: where and with
which key to fetch over TCP instead, kafila.session.weights.bulk); a peer from before gets no offer.

Frames that are not addressed to the member that reads them (requests, tokens, cancels) carry a
destination `dst` and are forwarded along the ring: every control message travels in the ring's
direction, like activations, so one stream per ring edge suffices (see ring.py). They count
their `hops` (how many members passed them on): a correct ring delivers any of them within
len(ring) - 2, so a node drops one past len(ring) + 1 instead of letting it circle (a member
that re-sends what it should not, or a ring whose names disagree).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import numpy as np

from kafila.net.roster import is_ip
# Limits, MAX_HOPS, MAX_NAME_CHARS, MAX_TRACE_ENTRIES, FrameError and EncodeError stay importable from here
from kafila.session.wire.fields import (KEY_RE, MAX_FRAME_BYTES, MAX_HOPS, MAX_NAME_CHARS, MAX_ORIGIN_DRAFT,
                                   MAX_TRACE_ENTRIES,
                                   EncodeError, FrameError, Limits, check_bool, check_draft, check_float,
                                   check_hops, check_int, check_pairs, check_shape, check_str)  # fmt: skip

PREFIX = struct.Struct(">II")
MAX_HEADER_BYTES = 64 << 10  # mask zeros and prompts' ids live in payloads or stay small
MAX_TOKENS_PER_FRAME = 256
MAX_ERROR_CHARS = 500
MAX_BATCH_ROWS = 32  # activations of one micro-batch (the head's slots are at most 32)
MAX_TEMPERATURE = 100.0
WEIGHT_CHUNK_BYTES = 4 << 20
FINISH_REASONS = ("", "stop", "length", "error")
PURPOSES = ("ring", "weights")
MAX_BULK_HOSTS = 8  # addresses a bulk lane offer names
MAX_HOST_CHARS = 45  # the longest IPv6 literal


# --- frames: each kind with its wire form ---------------------------------------------------------
#
# Every frame kind is one entry, its three steps side by side: `_to_wire` (the frame → its header
# map, payload and payload bound), `_check` (a decoded header and its payload length → the exact
# payload size the header implies, or FrameError) and `_from_wire` (a checked header and its
# payload → the frame). The header maps are the wire format: keys, their order and their types
# are what peers before this table sent and read (tests/test_frames.py holds the bytes).


class _Kind:
    TAG: ClassVar[str]  # the header's "k"
    NOUN: ClassVar[str] = ""  # how an encode error names it ("" → "a <tag>")
    NEEDS_PLAN: ClassVar[bool] = True  # False: allowed before the plan (hello, weights)


@dataclass(frozen=True)
class Hello(_Kind):
    """The first frame on every stream: who opens it and what for."""

    name: str
    purpose: str  # "ring" | "weights"
    epoch: int = 1  # a ring stream's plan generation (a replan opens new edges: stale ones are dropped)
    bulk: bool = False  # a weights stream: the fetcher takes a BulkOffer (a peer from before ignores it)
    TAG: ClassVar[str] = "hello"
    NEEDS_PLAN: ClassVar[bool] = False

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        h = {"k": "hello", "name": self.name, "purpose": self.purpose, "epoch": self.epoch}
        return (h | {"bulk": True} if self.bulk else h), b"", MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits | None) -> int:
        check_str(h, "name")
        if h.get("purpose") not in PURPOSES:
            raise FrameError(f"unknown stream purpose {h.get('purpose')!r}")
        if "epoch" in h:
            check_int(h, "epoch", 0, 1 << 31)
        if "bulk" in h:
            check_bool(h, "bulk")
        return 0

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> Hello:
        return cls(h["name"], h["purpose"], h.get("epoch", 1), h.get("bulk", False))


@dataclass(frozen=True)
class Activation(_Kind):
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
    # the origin member's latest draft of this request, continuing its first `dbase` tokens
    # (--speculate origin, kafila/session/ring/speculation/origin.py); () on every other activation
    draft: tuple[int, ...] = ()
    dbase: int = 0
    dus: int = 0  # and its draft model's measured µs per draft token (0: n-grams, ~free)
    keep: bool = False  # every stage keeps the slot's recurrent state after it (a hybrid's prompt end: prefix.py)
    TAG: ClassVar[str] = "act"
    NOUN: ClassVar[str] = "an activation"

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

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        x = np.ascontiguousarray(self.hidden, dtype="<f4")
        h = {"k": "act", "rid": self.req_id, "slot": self.slot, "cache": self.cache_len,
             "pos0": self.pos0, "zeros": list(self.zeros), "dtype": "f32",
             "shape": list(x.shape), "trace": [list(t) for t in self.trace],
             **({"rows": self.rows, "row": self.row} if self.rows > 1 else {}), **({"keep": True} if self.keep else {}),
             **({"draft": list(self.draft), "dbase": self.dbase, "dus": self.dus} if self.draft else {})}  # fmt: skip
        return h, x.data.cast("B"), MAX_FRAME_BYTES if limits is None else limits.frame_bytes

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits) -> int:
        check_str(h, "rid")
        check_int(h, "slot", 0, limits.slots - 1)
        cache = check_int(h, "cache", 0, limits.context - 1)
        n, hidden = check_shape(h, "f32", 2)
        if not 1 <= n <= limits.context - cache:
            raise FrameError(f"activation of {n} positions does not fit the context {limits.context} after {cache}")
        if hidden != limits.hidden:
            raise FrameError(f"activation width {hidden} is not the model's row width {limits.hidden}")
        check_int(h, "pos0", 0, limits.context - 1)
        zeros = h.get("zeros")
        if not isinstance(zeros, list) or len(zeros) > cache or not all(
            isinstance(z, int) and not isinstance(z, bool) and 0 <= z < cache + n for z in zeros
        ):
            raise FrameError("mask zeros must be physical positions inside the slot")
        check_pairs(h, "trace", int)
        if "rows" in h:
            rows = check_int(h, "rows", 2, MAX_BATCH_ROWS)
            check_int(h, "row", 0, rows - 1)
        if "draft" in h or "dbase" in h or "dus" in h:
            check_draft(h, limits.vocab, limits.context)
        if "keep" in h and h["keep"] is not True:
            raise FrameError("act.keep must be true when present")
        size = n * hidden * 4
        if size > limits.frame_bytes:
            raise FrameError(f"activation of {size} bytes exceeds this ring's frame limit {limits.frame_bytes}")
        return size

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> Activation:
        # a writable copy of 4·hidden·n bytes: runtimes may share (and need to own) the buffer
        x = np.frombuffer(bytearray(payload), dtype="<f4").reshape(h["shape"])
        trace = tuple((a, b) for a, b in h.get("trace", []))
        return cls(h["rid"], h["slot"], h["cache"], h["pos0"], tuple(h["zeros"]), x, trace, h.get("rows", 1),
                   h.get("row", 0), tuple(h.get("draft", ())), h.get("dbase", 0), h.get("dus", 0), h.get("keep", False))


@dataclass(frozen=True)
class Free(_Kind):
    """The request a ring slot held is over: release its KV on every stage, or with `keep` let
    it out of any micro-batch and keep it (prompt caching: session/ring/prefix.py)."""

    slot: int
    keep: bool = False
    TAG: ClassVar[str] = "free"

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        return {"k": "free", "slot": self.slot, **({"keep": True} if self.keep else {})}, b"", MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits) -> int:
        check_int(h, "slot", 0, limits.slots - 1)
        if not isinstance(h.get("keep", False), bool):
            raise FrameError("free.keep must be true or false")
        return 0

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> Free:
        return cls(h["slot"], h.get("keep", False))


@dataclass(frozen=True)
class Request(_Kind):
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
    keep_at: int = 0  # hybrids: the prompt position whose state the stages keep (GenerationRequest)
    TAG: ClassVar[str] = "req"
    NOUN: ClassVar[str] = "a request"

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        p = np.ascontiguousarray(self.prompt, dtype="<i4")
        h = {"k": "req", "rid": self.req_id, "origin": self.origin, "dst": self.dst,
             "max_new": self.max_new, "eos": self.stop_at_eos, "dtype": "i32",
             "shape": list(p.shape), "temp": float(self.temperature), "top_p": float(self.top_p),
             "seed": int(self.seed), "spec": bool(self.speculate), "hops": self.hops,
             **({"keep": self.keep_at} if self.keep_at else {})}  # fmt: skip
        return h, p.data.cast("B"), MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits) -> int:
        for key in ("rid", "origin", "dst"):
            check_str(h, key)
        check_int(h, "max_new", 1, limits.context)
        check_bool(h, "eos")
        check_float(h, "temp", 0.0, MAX_TEMPERATURE)
        check_float(h, "top_p", 0.0, 1.0)
        check_int(h, "seed", -1, (1 << 63) - 1)
        if not isinstance(h.get("spec", True), bool):
            raise FrameError("field 'spec' must be a boolean")
        check_hops(h)
        (n,) = check_shape(h, "i32", 1)
        if not 1 <= n <= limits.context:
            raise FrameError(f"prompt of {n} tokens is outside 1..{limits.context}")
        if "keep" in h:
            check_int(h, "keep", 1, n - 1)
        return n * 4

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> Request:
        p = np.frombuffer(payload, dtype="<i4")
        return cls(h["rid"], h["origin"], h["dst"], h["max_new"], h["eos"], p,
                   float(h["temp"]), float(h["top_p"]), h["seed"], h.get("spec", True), h.get("hops", 0),
                   h.get("keep", 0))  # fmt: skip


@dataclass(frozen=True)
class Tokens(_Kind):
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
    want: int = -1  # the drafts the head plans for the request's steps (-1: none planned): its origin's budget
    TAG: ClassVar[str] = "tok"
    NOUN: ClassVar[str] = "a tokens"

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        h = {"k": "tok", "rid": self.req_id, "dst": self.dst, "ids": list(self.ids),
             "done": self.done, "finish": self.finish, "error": self.error,
             "status": self.status, "stats": [list(t) for t in self.stats], "hops": self.hops}  # fmt: skip
        if self.want >= 0:
            h["want"] = self.want
        return h, b"", MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits) -> int:
        check_str(h, "rid")
        check_str(h, "dst")
        ids = h.get("ids")
        if not isinstance(ids, list) or len(ids) > MAX_TOKENS_PER_FRAME or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab for t in ids
        ):
            raise FrameError("token ids must be a short list of ids inside the vocabulary")
        check_bool(h, "done")
        if h.get("finish") not in FINISH_REASONS:
            raise FrameError(f"unknown finish reason {h.get('finish')!r}")
        check_str(h, "error", MAX_ERROR_CHARS, empty=True)
        check_int(h, "status", 0, 599)
        check_pairs(h, "stats", (int, float))
        check_hops(h)
        if "want" in h:  # absent from a head before it: no plan
            check_int(h, "want", -1, MAX_ORIGIN_DRAFT)
        return 0

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> Tokens:
        stats = tuple((a, b) for a, b in h.get("stats", []))
        return cls(h["rid"], h["dst"], tuple(h["ids"]), h["done"], h["finish"], h["error"], h["status"], stats,
                   h.get("hops", 0), h.get("want", -1))  # fmt: skip


@dataclass(frozen=True)
class Cancel(_Kind):
    """The origin gave up on request `req_id` (its client went away)."""

    req_id: str
    dst: str
    hops: int = 0  # members that passed it on so far (0 from its origin)
    TAG: ClassVar[str] = "cancel"

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        return {"k": "cancel", "rid": self.req_id, "dst": self.dst, "hops": self.hops}, b"", MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits) -> int:
        check_str(h, "rid")
        check_str(h, "dst")
        check_hops(h)
        return 0

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> Cancel:
        return cls(h["rid"], h["dst"], h.get("hops", 0))


@dataclass(frozen=True)
class WeightGet(_Kind):
    """Ask the host for bytes [offset, offset+length) of the model file."""

    offset: int
    length: int
    compress: bool = False
    TAG: ClassVar[str] = "wget"
    NEEDS_PLAN: ClassVar[bool] = False

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        return {"k": "wget", "off": self.offset, "len": self.length, "z": self.compress}, b"", MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits | None) -> int:
        check_int(h, "off", 0, 1 << 48)
        check_int(h, "len", 1, WEIGHT_CHUNK_BYTES)
        check_bool(h, "z")
        return 0

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> WeightGet:
        return cls(h["off"], h["len"], h["z"])


@dataclass(frozen=True)
class WeightData(_Kind):
    offset: int
    length: int  # bytes of the file range (before compression)
    compressed: bool
    data: bytes
    TAG: ClassVar[str] = "wdata"
    NEEDS_PLAN: ClassVar[bool] = False

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        return {"k": "wdata", "off": self.offset, "len": self.length, "z": self.compressed}, self.data, MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits | None) -> int:
        check_int(h, "off", 0, 1 << 48)
        length = check_int(h, "len", 0, MAX_FRAME_BYTES)
        if not check_bool(h, "z") and payload_len != length:
            raise FrameError(f"weight chunk of {payload_len} bytes declares {length}")
        return payload_len  # compressed chunks: any size up to the bound; checked on inflate

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> WeightData:
        return cls(h["off"], h["len"], h["z"], bytes(payload))


@dataclass(frozen=True)
class BulkOffer(_Kind):
    """The serving peer's answer to a weights Hello with `bulk`: fetch over TCP from one of
    `hosts` at `port`, proving `key` (kafila.net.bulk_records). Only ever sent on an edge's
    stream (TLS 1.3, pinned certificates): the key is secret to the two peers."""

    port: int = 0  # 0: a decline (no lane here: fetch on this stream), with no key and no hosts
    key: bytes = b""  # 32 random bytes, one connection, expires unused (kafila.session.weights.bulk)
    hosts: tuple[str, ...] = ()  # IP literals of the serving machine
    TAG: ClassVar[str] = "boffer"
    NEEDS_PLAN: ClassVar[bool] = False

    @property
    def declined(self) -> bool:
        return self.port == 0

    def _to_wire(self, limits: Limits | None) -> tuple[dict, Any, int]:
        return {"k": "boffer", "port": self.port, "key": self.key.hex(), "hosts": list(self.hosts)}, b"", MAX_FRAME_BYTES

    @staticmethod
    def _check(h: dict, payload_len: int, limits: Limits | None) -> int:
        hosts = h.get("hosts")
        if check_int(h, "port", 0, 65535) == 0:
            if h.get("key") != "" or hosts != []:
                raise FrameError("a bulk decline (port 0) carries no key and no addresses")
        elif not isinstance(h.get("key"), str) or not KEY_RE.fullmatch(h["key"]):
            raise FrameError("a bulk offer's key must be 64 hex digits")
        elif not isinstance(hosts, list) or not 1 <= len(hosts) <= MAX_BULK_HOSTS or not all(
            isinstance(a, str) and len(a) <= MAX_HOST_CHARS and is_ip(a) for a in hosts
        ):
            raise FrameError(f"a bulk offer names 1..{MAX_BULK_HOSTS} IP addresses")
        return 0

    @classmethod
    def _from_wire(cls, h: dict, payload: bytes) -> BulkOffer:
        return cls(h["port"], bytes.fromhex(h["key"]), tuple(h["hosts"]))


Frame = Hello | Activation | Free | Request | Tokens | Cancel | WeightGet | WeightData | BulkOffer
_KINDS: dict[str, type] = {k.TAG: k for k in (Hello, Activation, Free, Request, Tokens, Cancel,
                                              WeightGet, WeightData, BulkOffer)}  # fmt: skip


# --- encoding ----------------------------------------------------------------------------


def encode(frame: Frame, limits: Limits | None = None) -> bytes:
    """The wire bytes of one frame (EncodeError if it exceeds a bound: `limits.frame_bytes` for
    activations)."""
    if _KINDS.get(getattr(type(frame), "TAG", None)) is not type(frame):
        raise TypeError(f"not a frame: {type(frame).__name__}")
    header, payload, max_payload = frame._to_wire(limits)
    h = msgpack.packb(header, use_bin_type=True)
    noun = frame.NOUN or f"a {frame.TAG}"
    if len(h) > MAX_HEADER_BYTES:
        raise EncodeError(f"{noun} frame's header of {len(h)} bytes exceeds {MAX_HEADER_BYTES}")
    if len(payload) > max_payload:
        raise EncodeError(f"{noun} frame's payload of {len(payload)} bytes exceeds the "
                          f"frame limit of {max_payload} bytes")  # fmt: skip
    return b"".join((PREFIX.pack(len(h), len(payload)), h, payload))


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


def parse_header(data: bytes, payload_len: int, limits: Limits | None) -> dict:
    """Decode a header and validate it by its kind's `_check`; return it.

    `limits` None admits only frames that need no plan (hello, weights)."""
    try:
        h = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=0,
                            max_str_len=MAX_HEADER_BYTES, max_array_len=MAX_HEADER_BYTES,
                            max_map_len=32)  # fmt: skip
    except Exception as exc:  # msgpack raises several types on bad input
        raise FrameError(f"undecodable header ({type(exc).__name__})") from None
    if not isinstance(h, dict):
        raise FrameError("header is not a map")
    tag = h.get("k")
    kind = _KINDS.get(tag) if isinstance(tag, str) else None
    if limits is None and (kind is None or kind.NEEDS_PLAN):
        raise FrameError(f"frame kind {tag!r} not allowed before the plan")
    if kind is None:
        raise FrameError(f"unknown frame kind {tag!r}")
    size = kind._check(h, payload_len, limits)
    if payload_len != size:
        raise FrameError(f"{tag} frame carries {payload_len} payload bytes, its header implies {size}")
    return h


def build_frame(h: dict, payload: bytes) -> Frame:
    """The frame of a validated header and its payload (arrays are read-only views)."""
    return _KINDS[h["k"]]._from_wire(h, payload)  # parse_header admits no other kind


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
