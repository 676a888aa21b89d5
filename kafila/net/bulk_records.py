"""Sans-I/O: the bulk lane's key handshake and sealed records (weights over plain TCP).

Theory of operation. The serving peer makes an *offer* for one transfer: a fresh random 32-byte
`key`, sent to the fetching peer inside an authenticated, encrypted channel it already shares
with it (the QUIC weight stream: TLS 1.3, pinned certificates). Whoever learns the key learned it
from that channel, so proving knowledge of the key over TCP proves being that peer. From the key:

    offer id   = HKDF(key, "kafila-bulk-v1 id")[:16]    names the offer in the clear
    auth key   = HKDF(key, "kafila-bulk-v1 auth")       for the two handshake MACs

Handshake (fixed sizes, one message each way):

    client → server   "KFB1" | offer id (16) | client nonce (32) | HMAC(auth, "client" | id | Nc)
    server → client   server nonce (32) | HMAC(auth, "server" | id | Nc | Ns)

The server looks the offer up by id, checks the MAC and consumes the offer (one connection per
key); the client checks the server's MAC, which covers its own fresh nonce. Each direction then
has its own AES-256-GCM key, HKDF(key, salt = Nc | Ns, info "c2s" / "s2c"): fresh per
connection even if a key were ever offered twice.

Records: u32 big-endian ciphertext length | AES-GCM(plaintext), nonce = 4 zero bytes | u64
record counter (per direction, from 0), associated data = the length prefix. A record holds at
most MAX_RECORD_PLAINTEXT_BYTES (a 1 MiB weight chunk and its frame header fit in one). A
record that fails authentication (tampered, replayed, reordered, dropped: the counter is part of
the nonce), or declares a length out of bounds, raises BulkError and the connection is over.
An empty record is the end of the stream (a close marker): a connection cut without one is
reported as cut, so truncation is never mistaken for the end.

No sockets, no event loop, no clock: `bulk.py` (kafila.session) drives these over asyncio.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from hashlib import sha256

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from rendezvous.errors import ProtocolError

BULK_KEY_BYTES = 32
OFFER_ID_BYTES = 16
NONCE_BYTES = 32
MAC_BYTES = 32
MAGIC = b"KFB1"
CLIENT_HELLO_BYTES = len(MAGIC) + OFFER_ID_BYTES + NONCE_BYTES + MAC_BYTES  # 84
SERVER_HELLO_BYTES = NONCE_BYTES + MAC_BYTES  # 64
MAX_RECORD_PLAINTEXT_BYTES = (1 << 20) + (64 << 10)  # a 1 MiB chunk + its frame header: one record
TAG_BYTES = 16
RECORD_PREFIX = struct.Struct(">I")
MAX_RECORD_BYTES = MAX_RECORD_PLAINTEXT_BYTES + TAG_BYTES
_COUNTER = struct.Struct(">4xQ")
_LABEL = b"kafila-bulk-v1 "


class BulkError(ProtocolError):
    """The bulk lane cannot go on: a handshake that fails, a record that does not open (the shared
    protocol error type, as every wire protocol's); str() is the one-line reason."""

    def __init__(self, reason: str) -> None:
        super().__init__("bulk", reason)
        self.args = (reason,)


def _hkdf(key: bytes, info: bytes, salt: bytes | None = None, length: int = 32) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=salt, info=_LABEL + info).derive(key)


def offer_id(key: bytes) -> bytes:
    """The public name of the offer made with `key` (the key itself never crosses TCP)."""
    _check_key(key)
    return _hkdf(key, b"id", length=OFFER_ID_BYTES)


def _check_key(key: bytes) -> None:
    if not isinstance(key, bytes) or len(key) != BULK_KEY_BYTES:
        raise BulkError(f"a bulk lane key is {BULK_KEY_BYTES} bytes")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(_hkdf(key, b"auth"), b"".join(parts), sha256).digest()


@dataclass(frozen=True)
class TrafficKeys:
    """One connection's keys: what the client seals with and what the server seals with."""

    client_to_server: bytes
    server_to_client: bytes

    @classmethod
    def derive(cls, key: bytes, client_nonce: bytes, server_nonce: bytes) -> TrafficKeys:
        salt = client_nonce + server_nonce
        return cls(_hkdf(key, b"c2s", salt), _hkdf(key, b"s2c", salt))


class ClientHandshake:
    """The fetching side: `hello()` to send, then `finish(server's 64 bytes)` → TrafficKeys."""

    def __init__(self, key: bytes, nonce: bytes) -> None:
        _check_key(key)
        if len(nonce) != NONCE_BYTES:
            raise BulkError(f"a handshake nonce is {NONCE_BYTES} bytes")
        self.key, self.nonce, self.id = key, nonce, offer_id(key)

    def hello(self) -> bytes:
        return MAGIC + self.id + self.nonce + _mac(self.key, b"client", self.id, self.nonce)

    def finish(self, answer: bytes) -> TrafficKeys:
        if len(answer) != SERVER_HELLO_BYTES:
            raise BulkError(f"the server's bulk handshake is {len(answer)} bytes, not {SERVER_HELLO_BYTES}")
        server_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        if not hmac.compare_digest(mac, _mac(self.key, b"server", self.id, self.nonce, server_nonce)):
            raise BulkError("the server does not know the bulk lane key (its handshake MAC is wrong)")
        return TrafficKeys.derive(self.key, self.nonce, server_nonce)


def parse_client_hello(hello: bytes) -> tuple[bytes, bytes, bytes]:
    """(offer id, client nonce, MAC) of a client's first 84 bytes, or BulkError."""
    if len(hello) != CLIENT_HELLO_BYTES or not hello.startswith(MAGIC):
        raise BulkError("not a bulk lane handshake")
    body = hello[len(MAGIC):]
    return body[:OFFER_ID_BYTES], body[OFFER_ID_BYTES:OFFER_ID_BYTES + NONCE_BYTES], body[-MAC_BYTES:]


def server_answer(key: bytes, hello: bytes, nonce: bytes) -> tuple[bytes, TrafficKeys]:
    """The server's reply to a client hello for the offer made with `key` (found by its id):
    (64 bytes to send, TrafficKeys), or BulkError when the client does not know the key."""
    _check_key(key)
    oid, client_nonce, mac = parse_client_hello(hello)
    if oid != offer_id(key):
        raise BulkError("the handshake names another offer")
    if not hmac.compare_digest(mac, _mac(key, b"client", oid, client_nonce)):
        raise BulkError("the client does not know the bulk lane key (its handshake MAC is wrong)")
    if len(nonce) != NONCE_BYTES:
        raise BulkError(f"a handshake nonce is {NONCE_BYTES} bytes")
    answer = nonce + _mac(key, b"server", oid, client_nonce, nonce)
    return answer, TrafficKeys.derive(key, client_nonce, nonce)


class RecordSealer:
    """Our direction of a connection: plaintext → records (in order, counted)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.counter = 0
        self.closed = False

    def _record(self, plaintext) -> bytearray:
        if self.closed:
            raise BulkError("this bulk lane direction is closed")
        if self.counter >= 1 << 64:
            raise BulkError("record counter exhausted")
        record = bytearray(RECORD_PREFIX.size + len(plaintext) + TAG_BYTES)
        RECORD_PREFIX.pack_into(record, 0, len(plaintext) + TAG_BYTES)
        prefix = bytes(record[:RECORD_PREFIX.size])
        # sealed in place after its prefix: no copy of a MiB to join them
        self._aead.encrypt_into(_COUNTER.pack(self.counter), plaintext, prefix,
                                memoryview(record)[RECORD_PREFIX.size:])  # fmt: skip
        self.counter += 1
        return record

    def seal(self, data) -> list[bytearray]:
        """Records carrying `data` (nothing for empty data: an empty record means the end)."""
        view = memoryview(data)
        return [self._record(view[i:i + MAX_RECORD_PLAINTEXT_BYTES])
                for i in range(0, len(view), MAX_RECORD_PLAINTEXT_BYTES)]  # fmt: skip

    def close(self) -> bytearray:
        """The end-of-stream record; nothing may be sealed after it."""
        out = self._record(b"")
        self.closed = True
        return out


class RecordOpener:
    """The peer's direction: records → plaintext, each authenticated and exactly the next one.

    For the I/O side: `record_length(prefix)` (validated) tells how many bytes to read next,
    `open(prefix, body)` returns the plaintext (b"" only for the end marker: `ended` is then
    True). `feed(bytes)` does both over any byte stream (tests)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.counter = 0
        self.ended = False
        self._buf = bytearray()

    @staticmethod
    def record_length(prefix: bytes) -> int:
        (n,) = RECORD_PREFIX.unpack(prefix)
        if not TAG_BYTES <= n <= MAX_RECORD_BYTES:
            raise BulkError(f"a bulk lane record of {n} bytes is out of bounds ({TAG_BYTES}..{MAX_RECORD_BYTES})")
        return n

    def open(self, prefix: bytes, body: bytes) -> bytes:
        if self.ended:
            raise BulkError("a bulk lane record after the end of the stream")
        if len(body) != self.record_length(prefix):
            raise BulkError("a bulk lane record shorter than its length")
        try:
            plaintext = self._aead.decrypt(_COUNTER.pack(self.counter), body, prefix)
        except InvalidTag:
            raise BulkError(f"bulk lane record {self.counter} failed authentication (altered, replayed, "
                            "reordered or sealed with another key)") from None  # fmt: skip
        self.counter += 1
        if not plaintext:
            self.ended = True
        return plaintext

    def feed(self, data: bytes) -> list[bytes]:
        """Whole records' plaintexts from a byte stream (the end marker gives none: see `ended`)."""
        self._buf += data
        out = []
        while len(self._buf) >= RECORD_PREFIX.size:
            prefix = bytes(self._buf[:RECORD_PREFIX.size])
            n = self.record_length(prefix)
            if len(self._buf) < RECORD_PREFIX.size + n:
                break
            body = bytes(self._buf[RECORD_PREFIX.size:RECORD_PREFIX.size + n])
            del self._buf[:RECORD_PREFIX.size + n]
            plaintext = self.open(prefix, body)
            if plaintext:
                out.append(plaintext)
        return out
