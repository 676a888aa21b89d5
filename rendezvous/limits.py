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
# the host sends each member its plan and manifest in 16 KiB pieces (up to 64 a member)
HOST_SIGNAL_FRAMES_PER_S = 1000.0
HOST_SIGNAL_BURST_FRAMES = 4000
# bytes of bodies (plus SIGNAL_FRAME_COST_BYTES a frame) per connection: a member sends a
# descriptor and small replies; the host sends each member its plan and manifest (up to 1 MiB)
MEMBER_SIGNAL_BYTES_PER_S = 1024 * 1024
MEMBER_SIGNAL_BURST_BYTES = 2 * 1024 * 1024
HOST_SIGNAL_BYTES_PER_S = 32 * 1024 * 1024
HOST_SIGNAL_BURST_BYTES = 64 * 1024 * 1024
SIGNAL_FRAME_COST_BYTES = 16
# admission: a joined id is pending until the host admits it after a confirmed PAKE
MAX_PENDING_PER_SESSION = 4  # more pending joins at once are refused ("full")
PENDING_TIMEOUT_S = 30.0  # a pending id the host has not admitted by then is dropped
PENDING_BODIES_MAX = 4  # bodies a pending id may send to the host (PAKE, hello)
PENDING_BYTES_MAX = 96 * 1024  # in all: the hello carries the member's descriptor (<= 64 KiB)
# Pending slots cannot be hogged: a join that finds them full waits in line (arrival order), a
# pending id must begin its PAKE within PAKE_START_S, and one address holds at most
# MAX_PENDING_PER_SOURCE pending or waiting joins of a session, so a stranger's connections
# hold a slot for seconds and a real joiner's turn comes within a few of those.
MAX_PENDING_PER_SOURCE = 2
PAKE_START_S = 3.0  # from Joined to the pending id's first body (its PAKE: the joiner measured its NAT before)
MAX_WAITING_JOINS = 64  # per session; more get "busy" (the joiner asks again)
JOIN_WAIT_S = 8.0  # in line longer than this: "busy" (the joiner asks again; its own wait is 10 s)
# Nameplate scanning is slow and seen: each address may ask for nameplates that do not exist
# UNKNOWN_JOIN_BURST times, then one per 1/UNKNOWN_JOINS_PER_S s; past that every join from it is
# refused (also to live nameplates, so refusals tell a scanner nothing). 9999 nameplates: ~5.5 h.
UNKNOWN_JOIN_BURST = 10
UNKNOWN_JOINS_PER_S = 0.5
MAX_TRACKED_SOURCES = 4096  # addresses whose misses are remembered (the oldest forgotten first)
NOTICE_INTERVAL_S = 60.0  # "n joins refused from ADDR": one line per address and interval
MAX_RELAY_EDGES_PER_MEMBER = 64  # edges one member may have asked for at once
# resume: a session re-created after a restart gives new joiners ids from here, above any id the
# old rendezvous handed out (it counts from 1), so a member that resumes later never collides
RESUMED_RID_BASE = 500_000
EDGE_CLAIM_TTL_S = 60.0  # one end's EdgeResume waits this long for the other end's

# UDP: STUN and relay
MAX_DATAGRAM_BYTES = 1600  # larger datagrams are dropped unread (QUIC uses <= 1500)
RELAY_EDGE_BYTES_PER_S = 64 * 1024 * 1024  # per edge, both directions together
RELAY_EDGE_BURST_BYTES = 8 * 1024 * 1024
RELAY_EDGE_IDLE_S = 600.0  # an allocation nobody used for this long is dropped
MAX_RELAY_EDGES_PER_SESSION = 256
RELAY_SESSION_BYTES_PER_S = 256 * 1024 * 1024  # every edge of one session together
RELAY_SESSION_BURST_BYTES = 32 * 1024 * 1024
RELAY_GLOBAL_BYTES_PER_S = 1024 * 1024 * 1024  # the whole relay
RELAY_GLOBAL_BURST_BYTES = 64 * 1024 * 1024
RELAY_BIND_IDLE_S = 120.0  # a member's UDP binding expires if not refreshed
