"""Sans-I/O session handshake: SPAKE2 on the code, then a sealed, numbered signaling channel.

Bodies that members exchange through the rendezvous (messages.Send/Deliver) start with a kind
byte:  b"P" + SPAKE2 message   |   b"S" + seq (8) + AEAD ciphertext   |   b"R" + reason (plain).

Theory of operation. Host and member each run `Pake(code)`; `start()` gives the message to send,
`finish(peer_message)` the shared key. Both wrap the key in a `SealedChannel` (directional keys
by HKDF; ChaCha20-Poly1305; nonce and associated data carry a per-direction sequence number,
the nameplate and the member's rid). The receiver accepts exactly the next sequence number, so a
replayed, reordered, dropped, altered or re-addressed message raises ProtocolError and the
channel is dead. With a wrong code both sides derive different keys and the very first sealed
message fails to open: the host then answers b"R", kicks the member and closes the nameplate.
"""

from __future__ import annotations

import struct

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from spake2 import SPAKE2_Symmetric

from rendezvous.errors import ProtocolError

PAKE = b"P"
SEALED = b"S"
REJECT = b"R"
PAKE_ID = b"kafila-session-v1"
MAX_SEALED_PLAINTEXT_BYTES = 160 * 1024
_SEQ = struct.Struct("!Q")


def derive(key: bytes, label: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 sub-key of `key` for one purpose."""
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=label).derive(key)


class Pake:
    """One side of SPAKE2_Symmetric over the full normalized code."""

    def __init__(self, code: str) -> None:
        self._spake = SPAKE2_Symmetric(code.encode(), idSymmetric=PAKE_ID)
        self._started = False

    def start(self) -> bytes:
        self._started = True
        return PAKE + self._spake.start()

    def finish(self, body: bytes) -> bytes:
        if not self._started:
            raise ProtocolError("state", "PAKE finished before it started")
        if body[:1] != PAKE:
            raise ProtocolError("malformed", "expected a PAKE message")
        try:
            return self._spake.finish(body[1:])
        except Exception as exc:  # spake2 raises SPAKEError/ValueError/... on a bad element
            raise ProtocolError("malformed", f"bad PAKE message ({type(exc).__name__})") from exc


def reject(reason: str) -> bytes:
    return REJECT + reason.encode()[:200]


def rejection_reason(body: bytes) -> str | None:
    if body[:1] != REJECT:
        return None
    return body[1:].decode("utf-8", "replace")


class SealedChannel:
    """Authenticated encryption of host<->member messages with strict sequence numbers."""

    def __init__(self, key: bytes, *, is_host: bool, nameplate: int, rid: int) -> None:
        to_member = ChaCha20Poly1305(derive(key, b"kafila signal host->member"))
        to_host = ChaCha20Poly1305(derive(key, b"kafila signal member->host"))
        self._send_aead, self._recv_aead = (to_member, to_host) if is_host else (to_host, to_member)
        self._send_label = b"h>m" if is_host else b"m>h"
        self._recv_label = b"m>h" if is_host else b"h>m"
        self._context = struct.pack("!II", nameplate, rid)
        self._send_seq = 0
        self._recv_seq = 0
        self.dead = False
        # After a signaling resume, messages the old rendezvous had taken but not forwarded are
        # gone: the next message may skip ahead once (never back: a replay stays refused).
        self.gap_allowed = False
        self.lost = 0  # messages skipped so

    @property
    def opened(self) -> int:
        """Messages that decrypted under our key (one means the peer knew the code)."""
        return self._recv_seq

    def _aad(self, label: bytes, seq: int) -> bytes:
        return b"kafila-signal-v1" + label + self._context + _SEQ.pack(seq)

    def seal(self, message: dict) -> bytes:
        plaintext = msgpack.packb(message, use_bin_type=True)
        if len(plaintext) > MAX_SEALED_PLAINTEXT_BYTES:
            raise ProtocolError("too-large", f"signaling message of {len(plaintext)} bytes")
        seq = self._send_seq
        self._send_seq += 1
        nonce = b"\0\0\0\0" + _SEQ.pack(seq)
        return SEALED + _SEQ.pack(seq) + self._send_aead.encrypt(
            nonce, plaintext, self._aad(self._send_label, seq)
        )

    def open(self, body: bytes) -> dict:
        if self.dead:
            raise ProtocolError("dead", "the signaling channel already failed")
        try:
            return self._open(body)
        except ProtocolError:
            self.dead = True
            raise

    def _open(self, body: bytes) -> dict:
        if body[:1] != SEALED or len(body) < 1 + _SEQ.size + 16:
            raise ProtocolError("malformed", "expected a sealed signaling message")
        (seq,) = _SEQ.unpack_from(body, 1)
        skipped = seq > self._recv_seq and self.gap_allowed
        if seq != self._recv_seq and not skipped:
            raise ProtocolError(
                "replay",
                f"signaling message number {seq} arrived where {self._recv_seq} was due "
                "(replayed or dropped by the rendezvous)",
            )
        nonce = b"\0\0\0\0" + _SEQ.pack(seq)
        try:
            plaintext = self._recv_aead.decrypt(
                nonce, body[1 + _SEQ.size :], self._aad(self._recv_label, seq)
            )
        except InvalidTag:
            raise ProtocolError(
                "auth-failed",
                "a signaling message failed authentication (wrong code, or altered in transit)",
            ) from None
        if skipped:
            self.lost += seq - self._recv_seq
        self.gap_allowed = False
        self._recv_seq = seq + 1
        try:
            message = msgpack.unpackb(plaintext, raw=False, strict_map_key=True)
        except Exception as exc:
            raise ProtocolError("malformed", "sealed message is not msgpack") from exc
        if not isinstance(message, dict) or not isinstance(message.get("t"), str):
            raise ProtocolError("malformed", "sealed message has no type")
        return message
