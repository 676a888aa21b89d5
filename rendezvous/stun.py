"""Sans-I/O STUN binding responder for NAT classification (RFC 5389 + RFC 5780 §4.3-4.4).

The rendezvous listens on socket 0 (its primary port P1), socket 1 (a second port P2 on the same
IP) and optionally socket 2 (an alternate IP). Every binding request is answered with the
source it was seen from (XOR-MAPPED-ADDRESS) and OTHER-ADDRESS = (alternate IP or 0.0.0.0, P2).
A CHANGE-REQUEST asks for the answer to leave from the other port (flag 0x2) or from the
alternate IP (flag 0x4); that is how a member learns whether its NAT filters by port or address.
"""

from __future__ import annotations

from aioice import stun

from rendezvous.frames import KIND_STUN, kind_of

CHANGE_PORT = 0x02
CHANGE_IP = 0x04
PRIMARY, SECOND_PORT, ALTERNATE_IP = 0, 1, 2
SOFTWARE = "kafila-rendezvous"

Address = tuple[str, int]


class StunResponder:
    def __init__(self, *, port2: int, alternate_ip: str | None = None) -> None:
        self.port2 = port2
        self.alternate_ip = alternate_ip
        self.answered = 0
        self.dropped = 0

    def respond(self, datagram: bytes, src: Address, socket: int) -> tuple[bytes, int] | None:
        """A datagram that arrived on `socket` -> (answer, socket to send it from) or None."""
        if kind_of(datagram) != KIND_STUN:
            self.dropped += 1
            return None
        try:
            request = stun.parse_message(datagram)
        except Exception:  # noqa: BLE001 - aioice raises ValueError/struct.error/KeyError on garbage
            self.dropped += 1
            return None
        if request.message_method != stun.Method.BINDING or request.message_class != stun.Class.REQUEST:
            self.dropped += 1
            return None
        flags = request.attributes.get("CHANGE-REQUEST", 0)
        if not isinstance(flags, int):
            self.dropped += 1
            return None
        out_socket = socket
        if flags & CHANGE_IP:
            if self.alternate_ip is None:
                self.dropped += 1
                return None  # we cannot honour it; silence is what the member expects then
            out_socket = ALTERNATE_IP
        elif flags & CHANGE_PORT:
            out_socket = SECOND_PORT if socket == PRIMARY else PRIMARY
        response = stun.Message(
            message_method=stun.Method.BINDING,
            message_class=stun.Class.RESPONSE,
            transaction_id=request.transaction_id,
        )
        family_ip = src[0]
        response.attributes["XOR-MAPPED-ADDRESS"] = (family_ip, src[1])
        response.attributes["MAPPED-ADDRESS"] = (family_ip, src[1])
        response.attributes["OTHER-ADDRESS"] = (self.alternate_ip or "0.0.0.0", self.port2)
        response.attributes["SOFTWARE"] = SOFTWARE
        self.answered += 1
        return bytes(response), out_socket
