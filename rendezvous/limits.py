"""Every limit the rendezvous enforces, with its unit in its name.

They bound memory and bandwidth so that a flood of bogus input cannot take the service down.
"""

from __future__ import annotations

# registry and signaling
MAX_SESSIONS = 1000
MAX_MEMBERS_PER_SESSION = 32
MAX_CONNECTIONS = 4000
MAX_SIGNAL_FRAME_BYTES = 256 * 1024  # one length-prefixed msgpack frame on the TCP channel
MAX_SIGNAL_BODY_BYTES = 192 * 1024  # the opaque (sealed) body a member sends to another
MAX_NAMEPLATE = 9999  # nameplates are drawn at random from 1..MAX_NAMEPLATE
HELLO_TIMEOUT_S = 10.0  # a connection must open or join a session within this
# No frame (heartbeats included) for this long: the member has left. Members heartbeat every
# second (kafila.net.member.HEARTBEAT_S); a home Wi-Fi link or a busy machine stalls for seconds
# now and then, so 15 s tolerates ~14 lost heartbeats in a row. A member that really died is still
# seen in bounded time: a process that ended closes its TCP connection (seen at once); a machine
# that vanished, or a link that stays dead, is dropped within MEMBER_SILENT_S plus the service's
# 0.25 s tick, and the host then replans or degrades the ring.
MEMBER_SILENT_S = 15.0
MAX_SIGNAL_FRAMES_PER_S = 200.0  # per connection; more and the connection is closed
SIGNAL_BURST_FRAMES = 400

# UDP: STUN and relay
MAX_DATAGRAM_BYTES = 1600  # larger datagrams are dropped unread (QUIC uses <= 1500)
RELAY_EDGE_BYTES_PER_S = 64 * 1024 * 1024  # per edge, both directions together
RELAY_EDGE_BURST_BYTES = 8 * 1024 * 1024
RELAY_EDGE_IDLE_S = 600.0  # an allocation nobody used for this long is dropped
MAX_RELAY_EDGES_PER_SESSION = 256
RELAY_BIND_IDLE_S = 120.0  # a member's UDP binding expires if not refreshed
