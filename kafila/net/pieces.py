"""Session messages larger than one sealed signaling message travel in pieces.

Theory of operation. An application message (a plan with its weight manifest: about 0.9 kB a
block, so ~80 blocks already fill 64 KiB) is packed once with msgpack; when the packed bytes
exceed PIECE_BYTES they are cut into n consecutive pieces, each sealed and sent as its own
signaling message (admission_messages.Part: i, n, size, data). The sealed channel
is ordered and numbered (handshake.SealedChannel), and the sender writes all pieces of one
message before anything else, so the receiver needs no message ids: pieces 0..n-1 arrive in a
row. The receiver (`Assembler`, one per sender) checks every piece against what the first one
declared and against its bound *before* keeping it, and returns the packed message when the last
piece lands. Anything else — a piece out of order, a message that starts before the previous one
is complete, a size over the bound, a piece of the wrong length — raises ProtocolError, which the
net layer treats as any broken signaling channel (the host removes the member; a member leaves
with the reason).

No I/O here.
"""

from __future__ import annotations

import math

import msgpack

from kafila.net.admission_messages import Part
from rendezvous.errors import ProtocolError

# One piece's data. Small enough that a plan for 20 blocks already travels in pieces (the path
# is exercised by every sizeable session, not only by huge models) and far below the sealed and
# signaling bounds; the pieces of a whole session's manifests number about (the model's tensor
# count × ~120 B) / PIECE_BYTES + members, far below the rendezvous's frame burst.
PIECE_BYTES = 16 * 1024
# what a member accepts from the host in one message: a plan plus the weight manifest of up to
# weights.MAX_MANIFEST_TENSORS tensors (~130 B each: name, offset, size, SHA-256) fits twice over
MAX_HOST_MESSAGE_BYTES = 1 << 20
MAX_MEMBER_MESSAGE_BYTES = 64 * 1024  # what the host accepts from a member (ready, edge stats…)


def split(packed: bytes) -> list[Part]:
    """The pieces of one packed message (one per PIECE_BYTES), each to be sealed on its own."""
    n = max(1, math.ceil(len(packed) / PIECE_BYTES))
    return [Part(i, n, len(packed), packed[i * PIECE_BYTES : (i + 1) * PIECE_BYTES]) for i in range(n)]


def unpack(packed: bytes, max_bytes: int):
    """A reassembled message's object (msgpack bounded by its size)."""
    try:
        return msgpack.unpackb(packed, raw=False, strict_map_key=True, max_bin_len=max_bytes,
                               max_str_len=max_bytes, max_array_len=max_bytes, max_map_len=max_bytes)  # fmt: skip
    except Exception as exc:  # msgpack raises several types on bad input
        raise ProtocolError("malformed", f"a message in pieces is not msgpack ({type(exc).__name__})") from None


class Assembler:
    """Reassembles the pieces of one sender's messages, within `max_bytes` a message."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._n = 0  # pieces of the message in progress (0: none)
        self._size = 0
        self._parts: list[bytes] = []

    @property
    def pending(self) -> bool:
        """A message has begun and is not complete."""
        return self._n > 0

    def whole(self) -> None:
        """A whole (unpieced) message arrived: legal only between messages."""
        if self._n:
            raise ProtocolError("malformed", f"a message arrived inside one of {self._n} pieces "
                                             f"(piece {len(self._parts)} was due): incomplete")  # fmt: skip

    def feed(self, part: Part) -> bytes | None:
        """One piece (its types checked by admission_messages.decode); the packed message when it
        was the last, else None."""
        i, n, size, data = part.i, part.n, part.size, part.data
        if i == 0:
            self.whole()
            if size > self.max_bytes:
                raise ProtocolError("too-large", f"a message of {size} bytes in pieces exceeds the "
                                                 f"{self.max_bytes} bytes this side accepts")  # fmt: skip
            if not 0 < size or n != max(1, math.ceil(size / PIECE_BYTES)):
                raise ProtocolError("malformed", f"a message of {size} bytes cannot be {n} pieces")
            self._n, self._size = n, size
        elif not self._n or i != len(self._parts) or n != self._n or size != self._size:
            raise ProtocolError("malformed", f"message piece {i} of {n} arrived out of order "
                                             f"(expected {len(self._parts)} of {self._n})")  # fmt: skip
        want = min(PIECE_BYTES, self._size - i * PIECE_BYTES)
        if len(data) != want:
            raise ProtocolError("malformed", f"message piece {i} holds {len(data)} bytes, not {want}")
        self._parts.append(data)
        if len(self._parts) < self._n:
            return None
        packed = b"".join(self._parts)
        self._n, self._size, self._parts = 0, 0, []
        return packed
