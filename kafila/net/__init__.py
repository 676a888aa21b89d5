"""Kafila's network layer: sessions through NATs, and QUIC ring edges between members.

API (asyncio), as built for the session layer:

    rv = await Rendezvous.start(host="0.0.0.0", port=0, *, alternate_ip=None)  # rendezvous/
    rv.address -> (host, port)   rv.stun_port2   await rv.close()

    host = await Member.host((rv_host, rv_port), "alice", descriptor, bind_host=..., send_delay_ms=0)
    host.code                                   # "4711-crossover-clockwork-pandora"
    bob = await Member.join(code, (rv_host, rv_port), "bob", descriptor, bind_host=...)
        # wrong code -> backends.errors.Refused("wrong code: ..."); unknown nameplate -> Refused;
        # malformed code or name -> BadInput
    m.name, m.is_host, m.code, m.nat (NatReport: nat, mapped, rtt_ms, filtering, mapping)
    m.roster() -> {name: MemberInfo(name, descriptor, nat, rtt_ms, fingerprint, candidates,
                                    peer_id, report)}
    await m.send(to_name, msgpack_able)          # members -> host only; host -> anyone; <= 64 KiB
    await m.recv() -> MemberJoined(info) | MemberLeft(name, reason) | Message(sender, body)
                      | RosterUpdated(roster)   # host gets MemberJoined/MemberLeft/Message;
                                                # members get RosterUpdated/Message/MemberLeft(host)
    edge = await m.connect(peer_name)            # authenticated QUIC edge, relay first
    edge = await m.accept()                      # the next edge a peer opened to us
    await m.close()                              # Bye; the host sees MemberLeft within ~0.1 s
                                                 # (a silent member: within MEMBER_SILENT_S=15 s)

    edge.peer, edge.predicted, edge.kind ("direct" | "relay", now), edge.time_to_data_s,
    edge.time_to_direct_s, edge.stats() -> {kind, predicted, rtt_ms, bytes_sent,
    bytes_received, time_to_data_s, time_to_direct_s, direct_address, peer}
    reader, writer = await edge.open_stream()    # asyncio.StreamReader / StreamWriter; write
                                                 # first, the peer sees the stream with its bytes
    reader, writer = await edge.accept_stream()
    await edge.close()

Differences from the brief: MemberInfo has two extra fields (peer_id, report); Rendezvous.start
takes `alternate_ip` (a second IP on the rendezvous lets netcheck tell endpoint-independent from
address-dependent filtering; with one IP both read as "not-port-dependent" and class permissive).
Signaling runs over an outbound TCP connection (see rendezvous.messages for why).

Sans-I/O protocol modules (no asyncio/socket/time): code, words, handshake, natcheck, punch,
roster, certs, pieces, edge_table, admission (the host's HostSession) and joining (the joiner's
Joiner), and rendezvous.{messages, frames, registry, relay, stun}. Member (member.py) is the
asyncio glue that feeds admission's machines and carries out their actions.
"""

from kafila.net.natcheck import NatReport, predict_edge_kind
from kafila.net.roster import (
    MemberInfo,
    MemberJoined,
    MemberLeft,
    Message,
    RosterUpdated,
    SessionEvent,
)

__all__ = [
    "Edge", "Member", "MemberInfo", "MemberJoined", "MemberLeft", "Message", "NatReport",
    "Rendezvous", "RosterUpdated", "SessionEvent", "netcheck", "predict_edge_kind",
]


def __getattr__(name: str):  # the asyncio layer loads on first use, not on import
    if name == "Member":
        from kafila.net.member import Member

        return Member
    if name == "Edge":
        from kafila.net.edge import Edge

        return Edge
    if name == "Rendezvous":
        from rendezvous.service import Rendezvous

        return Rendezvous
    if name == "netcheck":
        from kafila.net.stunclient import netcheck

        return netcheck
    raise AttributeError(name)
