"""The one error every Kafila wire protocol raises: a code and a one-line reason.

Decoders and state machines raise it deep; the asyncio layer converts it once at the boundary
(drop the datagram, answer with an Error message and close, or fail an edge) and never crashes.
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
