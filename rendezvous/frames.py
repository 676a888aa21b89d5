"""The member's one UDP socket carries several protocols, told apart by the first byte.

    0x00-0x03  STUN (RFC 5389 header; the magic cookie confirms it)
    0x10       BIND      member -> rendezvous: [0x10][relay token 16][nonce 16]  (register my UDP
                         address; the nonce is zeros until the rendezvous challenged this address)
    0x11       BIND_ACK  rendezvous -> member: [0x11][relay token 16]
    0x13       BIND_CHALLENGE  rendezvous -> member: [0x13][relay token 16][nonce 16]
    0x12       DATA      relay frame, both ways: [0x12][edge id 8][opaque payload]
    0x20       PROBE     member -> member punch probe  (kafila.net.punch)
    0x21       PONG      member -> member punch answer (kafila.net.punch)
    0x40-0xFF  QUIC (the fixed bit 0x40 is set in every long and short header)

The relay never looks inside a DATA payload: it is a QUIC packet, encrypted end to end.

Return routability: a BIND from an address the token is not bound to is answered with a
BIND_CHALLENGE *to that address*; only a BIND that echoes its nonce binds it. So a spoofed BIND
cannot point an edge's traffic at someone else's address. A BIND is as long as the challenge:
no amplification.
"""

from __future__ import annotations

from rendezvous.errors import ProtocolError
from rendezvous.limits import MAX_DATAGRAM_BYTES
from rendezvous.messages import EDGE_ID_BYTES, RELAY_TOKEN_BYTES

BIND = 0x10
BIND_ACK = 0x11
DATA = 0x12
BIND_CHALLENGE = 0x13
BIND_NONCE_BYTES = 16
NO_NONCE = bytes(BIND_NONCE_BYTES)
PROBE = 0x20
PONG = 0x21
STUN_COOKIE = b"\x21\x12\xa4\x42"

KIND_STUN = "stun"
KIND_RELAY = "relay"  # BIND / BIND_ACK / DATA
KIND_PUNCH = "punch"  # PROBE / PONG
KIND_QUIC = "quic"

DATA_HEADER_BYTES = 1 + EDGE_ID_BYTES


def kind_of(datagram: bytes, max_bytes: int = MAX_DATAGRAM_BYTES) -> str | None:
    """Which protocol a datagram belongs to, or None for garbage (to be dropped); only QUIC may
    be longer than MAX_DATAGRAM_BYTES, up to `max_bytes` (a member's peer on its own machine)."""
    if not datagram:
        return None
    if len(datagram) > MAX_DATAGRAM_BYTES and (len(datagram) > max_bytes or not datagram[0] & 0x40):
        return None
    first = datagram[0]
    if first & 0x40:
        return KIND_QUIC
    if first <= 0x03:
        return KIND_STUN if len(datagram) >= 20 and datagram[4:8] == STUN_COOKIE else None
    if first in (BIND, BIND_ACK, DATA, BIND_CHALLENGE):
        return KIND_RELAY
    if first in (PROBE, PONG):
        return KIND_PUNCH
    return None


def encode_bind(token: bytes, *, ack: bool = False, nonce: bytes = NO_NONCE) -> bytes:
    """BIND (with the nonce of a challenge, zeros before one) or BIND_ACK."""
    if len(token) != RELAY_TOKEN_BYTES:
        raise ProtocolError("malformed", "relay token must be 16 bytes")
    if ack:
        return bytes([BIND_ACK]) + token
    if len(nonce) != BIND_NONCE_BYTES:
        raise ProtocolError("malformed", "bind nonce must be 16 bytes")
    return bytes([BIND]) + token + nonce


def decode_bind(datagram: bytes) -> bytes:
    """A BIND_ACK -> its token."""
    if len(datagram) != 1 + RELAY_TOKEN_BYTES or datagram[0] != BIND_ACK:
        raise ProtocolError("malformed", "bad relay bind ack")
    return bytes(datagram[1:])


def decode_bind_request(datagram: bytes) -> tuple[bytes, bytes]:
    """A BIND -> (token, nonce); or a BIND_CHALLENGE -> (token, nonce)."""
    if len(datagram) != 1 + RELAY_TOKEN_BYTES + BIND_NONCE_BYTES or datagram[0] not in (BIND, BIND_CHALLENGE):
        raise ProtocolError("malformed", "bad relay bind frame")
    return bytes(datagram[1 : 1 + RELAY_TOKEN_BYTES]), bytes(datagram[1 + RELAY_TOKEN_BYTES :])


def encode_challenge(token: bytes, nonce: bytes) -> bytes:
    if len(token) != RELAY_TOKEN_BYTES or len(nonce) != BIND_NONCE_BYTES:
        raise ProtocolError("malformed", "bad bind challenge")
    return bytes([BIND_CHALLENGE]) + token + nonce


def encode_data(edge_id: bytes, payload: bytes) -> bytes:
    if len(edge_id) != EDGE_ID_BYTES:
        raise ProtocolError("malformed", "edge id must be 8 bytes")
    if DATA_HEADER_BYTES + len(payload) > MAX_DATAGRAM_BYTES:
        raise ProtocolError("too-large", f"relay payload of {len(payload)} bytes")
    return bytes([DATA]) + edge_id + payload


def decode_data(datagram: bytes) -> tuple[bytes, bytes]:
    """A DATA frame -> (edge id, payload)."""
    if len(datagram) < DATA_HEADER_BYTES or datagram[0] != DATA:
        raise ProtocolError("malformed", "bad relay data frame")
    if len(datagram) > MAX_DATAGRAM_BYTES:
        raise ProtocolError("too-large", "relay frame too large")
    return bytes(datagram[1:DATA_HEADER_BYTES]), bytes(datagram[DATA_HEADER_BYTES:])
