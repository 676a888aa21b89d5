"""Edge formation across the NAT lab: predicted vs achieved kind and time to data / to direct.

For every ordered pair of NAT kinds (the seed paper's Table III with both ordinary variants, plus
a public member) an edge is opened from a member behind the first kind (initiator) to a member
behind the second (responder), one edge at a time so timings are not skewed by the other edges,
then a 64 KiB stream is sent each way to prove it carries data. Each round uses fresh members (fresh
NAT state); the table shows medians over rounds. *connect wall s* is the initiator's whole
`connect`, clock started before its EdgeRequest goes to the rendezvous (signaling round trip,
edge allocation, QUIC over the relay, first stream authenticated), seen from the bench; *time to
data* starts later, at the allocation. With --send-delay-ms every path a member sends on is
delayed: direct and relayed datagrams and the TCP signaling to the rendezvous.

    sudo .venv/bin/python -m bench.edges [--rounds 3] [--direct-wait-s 6] [--send-delay-ms 0] [--json]

Targets (issue 5): time until an edge carries data <= 0.5 s (over the relay) and until it is
direct <= 1.0 s (median) where direct is possible. Needs root, ip and nft (see natlab_tests).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

from natlab_tests import nat, session
from natlab_tests.lab import Lab, unavailable_reason

KINDS = nat.ALL_KINDS
PROBE_BYTES = 64 * 1024
TIME_TO_DATA_TARGET_S = 0.5
TIME_TO_DIRECT_TARGET_S = 1.0


def one_round(
    lab: Lab, rendezvous: str, direct_wait_s: float, round_no: int, send_delay_ms: float = 0.0
) -> list[dict]:
    initiators = {k: lab.add_member(k) for k in KINDS}
    responders = {k: lab.add_member(k) for k in KINDS}
    nodes = [*initiators.values(), *responders.values()]
    names = [f"i{round_no}-{k}" for k in KINDS] + [f"r{round_no}-{k}" for k in KINDS]
    members = session.start_session(lab, rendezvous, nodes, names, send_delay_ms=send_delay_ms)
    by_name = {m.name: m for m in members}
    rows = []
    try:
        for a, b in itertools.product(KINDS, KINDS):
            ma, mb = by_name[f"i{round_no}-{a}"], by_name[f"r{round_no}-{b}"]
            started = time.monotonic()
            [(ea, _eb)] = session.open_edges([(ma, mb)])
            open_s = time.monotonic() - started
            [(da, db)] = session.wait_direct([(ma, mb)], direct_wait_s)
            [there, back] = session.exchange([(ma, mb)], PROBE_BYTES)
            rows.append(
                {
                    "initiator": a,
                    "responder": b,
                    "nat_initiator": ma.ready["nat"].get("nat"),
                    "nat_responder": mb.ready["nat"].get("nat"),
                    "predicted": ea.get("predicted"),
                    "expected": session.expected_kind(a, b),
                    "achieved": da.get("kind"),
                    "achieved_responder": db.get("kind"),
                    "time_to_data_s": ea.get("time_to_data_s"),
                    "time_to_direct_s": da.get("time_to_direct_s"),
                    "connect_wall_s": round(open_s, 3),
                    "data_ok": there["intact"] and back["intact"],
                }
            )
    finally:
        session.quit_all(members)
    return rows


def median_or_none(values: list) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return round(statistics.median(values), 3) if values else None


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for a, b in itertools.product(KINDS, KINDS):
        cell = [r for r in rows if r["initiator"] == a and r["responder"] == b]
        achieved = sorted({r["achieved"] for r in cell})
        out.append(
            {
                "initiator": a,
                "responder": b,
                "predicted": sorted({str(r["predicted"]) for r in cell}),
                "expected": cell[0]["expected"],
                "achieved": achieved,
                "direct_rounds": sum(r["achieved"] == "direct" for r in cell),
                "rounds": len(cell),
                "time_to_data_s": median_or_none([r["time_to_data_s"] for r in cell]),
                "time_to_direct_s": median_or_none(
                    [r["time_to_direct_s"] for r in cell if r["achieved"] == "direct"]
                ),
                "connect_wall_s": median_or_none([r["connect_wall_s"] for r in cell]),
                "data_ok": all(r["data_ok"] for r in cell),
            }
        )
    return out


def table(summary: list[dict]) -> str:
    lines = [
        (
            "| initiator | responder | predicted | expected | achieved (direct/rounds) | data | "
            "connect wall s (median) | time to data s (median) | time to direct s (median) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        ok = "" if (s["achieved"] == [s["expected"]]) else " **≠ expected**"
        lines.append(
            f"| {s['initiator']} | {s['responder']} | {'/'.join(s['predicted'])} | {s['expected']} | "
            f"{'/'.join(map(str, s['achieved']))} ({s['direct_rounds']}/{s['rounds']}){ok} | "
            f"{'ok' if s['data_ok'] else 'LOST'} | {s['connect_wall_s']} | {s['time_to_data_s']} | "
            f"{s['time_to_direct_s'] or '–'} |"
        )
    data = [s["time_to_data_s"] for s in summary if s["time_to_data_s"] is not None]
    direct = [s["time_to_direct_s"] for s in summary if s["time_to_direct_s"] is not None]
    connect = [s["connect_wall_s"] for s in summary if s["connect_wall_s"] is not None]
    lines.append("")
    if connect:
        lines.append(
            f"median connect wall time over all pairs (EdgeRequest → authenticated edge): "
            f"{statistics.median(connect):.3f} s; worst {max(connect):.3f} s"
        )
    if data:
        lines.append(
            f"median time to data over all pairs: {statistics.median(data):.3f} s "
            f"(target <= {TIME_TO_DATA_TARGET_S} s); worst {max(data):.3f} s"
        )
    if direct:
        lines.append(
            f"median time to direct over direct pairs: {statistics.median(direct):.3f} s "
            f"(target <= {TIME_TO_DIRECT_TARGET_S} s); worst {max(direct):.3f} s"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--direct-wait-s",
        type=float,
        default=6.0,
        help="how long to wait for an edge to turn direct before calling it relayed",
    )
    parser.add_argument(
        "--send-delay-ms",
        type=float,
        default=0.0,
        help="delay every datagram a member sends by this much (a WAN: each "
        "member is this far from everyone; tc netem is not available)",
    )
    parser.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    args = parser.parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        print(f"bench.edges: {reason}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    started = time.monotonic()
    with Lab() as lab:
        rendezvous = session.start_rendezvous(lab).address
        for round_no in range(args.rounds):
            rows += one_round(lab, rendezvous, args.direct_wait_s, round_no, args.send_delay_ms)
    summary = summarize(rows)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print(table(summary))
        print(f"\n{args.rounds} rounds, {len(rows)} edges, {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
