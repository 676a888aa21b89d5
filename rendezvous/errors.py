"""The one error every Kafila wire protocol raises: a code and a one-line reason.

Decoders and state machines raise it deep; the asyncio layer converts it once at the boundary
(drop the datagram, answer with an Error message and close, or fail an edge) and never crashes.

Whose fault it is decides what the boundary does, so the two kinds are different types (h11's
LocalProtocolError / RemoteProtocolError): `RemoteProtocolError` is the peer's (bytes or a
message it sent break a rule: close that edge, name the peer); `LocalProtocolError` is ours (a
message of our own we cannot encode or send, e.g. over a bound: nothing was written, the peer did
nothing wrong, and only the work that made the message fails). Both are ProtocolErrors, so every
`except ProtocolError` keeps working; a plain ProtocolError (what the rendezvous messages and the
net handshake raise) is a peer's unless said otherwise.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Bytes or a message that break a protocol rule.

    code: a short stable identifier ("malformed", "too-large", "auth-failed", "replay", ...)
    reason: one line a person can read
    """

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(f"{reason} [{code}]")
        self.code = code
        self.reason = reason


class LocalProtocolError(ProtocolError):
    """A message of our own breaks a rule (we cannot encode or send it): our error, not the peer's."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes or a message that break a rule: its edge is closed naming it."""
