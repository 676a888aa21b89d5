"""Our binding at the rendezvous relay, and the relay's datagrams for our edges.

The relay forwards an edge's DATA frames to the UDP address that last proved it holds our relay
token. So we send BIND every RELAY_BIND_RETRY_S until the relay ACKs it, then every
RELAY_BIND_REFRESH_S (our NAT mapping must not expire); a BIND_CHALLENGE (the relay checks that
an address is ours before it binds it) is answered by echoing its nonce, which later BINDs
carry too. After a signaling resume `rebind()` binds again at once (a restarted relay lost us).
DATA frames go to the edge table, which knows which edge they are for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kafila.net.edge_table import EdgeTable
from kafila.net.sock import MemberSocket
from rendezvous import frames

Address = tuple[str, int]
RELAY_BIND_RETRY_S = 0.2
RELAY_BIND_REFRESH_S = 20.0


class RelayLink:
    def __init__(self, sock: MemberSocket, relay: Address, table: EdgeTable, *,
                 closed: Callable[[], bool]) -> None:
        self._sock, self._relay, self._table, self._closed = sock, relay, table, closed
        self.token = b""  # from Opened/Joined: the rendezvous knows us by it
        self.bound = asyncio.Event()  # the relay ACKed our binding: edges can form
        self._rebind = asyncio.Event()  # set: send a BIND now
        self._nonce = frames.NO_NONCE  # the relay's return-routability challenge, echoed

    def rebind(self) -> None:
        self.bound.clear()
        self._rebind.set()

    async def keep_bound(self) -> None:
        while not self._closed():
            self._sock.sendto(frames.encode_bind(self.token, nonce=self._nonce), self._relay)
            delay = RELAY_BIND_REFRESH_S if self.bound.is_set() else RELAY_BIND_RETRY_S
            self._rebind.clear()
            waiter = asyncio.ensure_future(self._rebind.wait())
            try:  # asyncio.wait, not wait_for: a cancellation of this task always gets through
                await asyncio.wait({waiter}, timeout=delay)
            finally:
                waiter.cancel()

    def datagram(self, data: bytes, src: Address) -> None:
        """A relay frame on our socket (frames.KIND_RELAY)."""
        if src != self._relay:
            return
        if data[0] == frames.BIND_ACK:
            if frames.decode_bind(data) == self.token:
                self.bound.set()
            return
        if data[0] == frames.BIND_CHALLENGE:  # prove this address is ours: echo the nonce
            token, nonce = frames.decode_bind_request(data)
            if token == self.token and not self._closed():
                self._nonce = nonce
                self._sock.sendto(frames.encode_bind(token, nonce=nonce), self._relay)
            return
        edge_id, payload = frames.decode_data(data)
        self._table.relay(edge_id, payload, asyncio.get_running_loop().time())
