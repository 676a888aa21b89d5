"""`kafila status [--api HOST:PORT] [--watch] [--json]`: the session as any member sees it.

The same picture as the page at http://HOST:PORT/ (and the host's terminal): the members with
their devices, blocks and predicted vs measured stage ms; the ring's edges (direct or relay, RTT,
the NAT classes at both ends); the plan's predicted tok/s against the measured, the bottleneck
member named; the requests in flight and this member's weight transfer. `render` is a pure
function of the GET /status body.
"""

from __future__ import annotations

import http.client
import json
import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

from backends.errors import EXIT_OK, Refused
from kafila.api import DEFAULT_API_HOST, DEFAULT_API_PORT, parse_hostport
from kafila.session.control.preview import plan_summary, predicted_tok_s  # noqa: F401 (predicted_tok_s: re-exported)

CONNECT_TIMEOUT_S = 5.0
WATCH_EVERY_S = 1.0


def fetch_status(host: str, port: int) -> dict:
    """GET /status from a member (Refused, one line, when it cannot be had)."""
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    conn = http.client.HTTPConnection(host, port, timeout=CONNECT_TIMEOUT_S)
    try:
        conn.request("GET", "/status")
        resp = conn.getresponse()
        data = resp.read()
    except OSError as exc:
        reason = (exc.strerror or str(exc) or type(exc).__name__).lower()
        raise Refused(f"cannot reach a Kafila API at {url} ({reason}): pass --api HOST:PORT of a "
                      "member (`kafila host` and `kafila join` print it)") from None  # fmt: skip
    finally:
        conn.close()
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if resp.status != 200 or not isinstance(body, dict):
        raise Refused(f"{url}/status answered HTTP {resp.status}: not a Kafila member's API")
    return body


def _f(v, digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:.0f} %"


def _slowest(values: dict) -> str | None:
    known = {k: v for k, v in values.items() if v is not None}
    return max(known, key=known.get) if known else None


def transfer_line(t: dict) -> str:
    """A weight transfer's figures (`TransferProgress.as_dict`) in words: "12.0 of 40.0 MB (30 %),
    6.1 MB/s, 4.6 s left"."""
    done, total = t.get("done_bytes") or 0, t.get("total_bytes") or 0
    pct = f" ({100 * done / total:.0f} %)" if total else ""
    rate = f", {t['mb_s']:.1f} MB/s" if t.get("mb_s") else ""
    if t.get("lane") in ("tcp", "quic"):  # which lane carried them (kafila.session.weights.bulk)
        rate += " over TCP" if t["lane"] == "tcp" else " over QUIC"
    state = t.get("state")
    if state == "done":
        left = ", done" if done >= total else ", done (the member had the rest)"
    else:
        left = f", {t['eta_s']:.0f} s left" if t.get("eta_s") is not None else f", {state}" if state else ""
    return f"{done / 1e6:.1f} of {total / 1e6:.1f} MB{pct}{rate}{left}"


def render(st: dict) -> Group:
    """The GET /status body → tables for a terminal."""
    s = st.get("session") or {}
    plan = st.get("plan") or {}
    members = st.get("members") or {}
    stages = st.get("stages") or {}
    ring = list(plan.get("ring") or members)
    head = plan.get("head")
    me = s.get("name")
    parts: list = []
    if s:
        state = s.get("state") or "?"
        line = Text.assemble((f"{s.get('model') or '?'}", "bold"), "  ",
                             (state, "green" if state == "serving" else "red" if state == "degraded" else "yellow"),
                             f"  member {me}, host {s.get('host')}, context {s.get('context')}, "
                             f"uptime {_f(s.get('uptime_s'), 0)} s")  # fmt: skip
        parts.append(line)
        if s.get("degraded"):
            parts.append(Text(f"degraded: {s['degraded']}", style="red"))
    else:  # `kafila serve`: one process, no ring
        parts.append(Text(f"{st.get('model')}  {'serving' if st.get('ready') else 'not ready'}  (one process)"))

    slow_pred = _slowest({n: (stages.get(n) or {}).get("predicted_ms") for n in ring})
    slow_meas = _slowest({n: (stages.get(n) or {}).get("compute_ms") for n in ring})
    t = Table(title="members (ring order)", title_justify="left")
    errors = ((st.get("prediction") or {}).get("stages")) or {}  # |predicted − measured| / measured
    for col in ("member", "backend", "NAT", "memory GB", "GB/s", "blocks", "predicted ms", "measured ms", "off by",
                "state"):  # fmt: skip
        t.add_column(col, justify="right" if col in ("memory GB", "GB/s", "blocks", "predicted ms",
                                                     "measured ms", "off by") else "left")  # fmt: skip
    for name in ring + [n for n in members if n not in ring]:
        m = members.get(name) or {}
        stg = stages.get(name) or {}
        label = name + (" (head)" if name == head else "") + (" (here)" if name == me else "")
        pred = _f(stg.get("predicted_ms"), 2) + (" ◀" if name == slow_pred else "")
        meas = _f(stg.get("compute_ms"), 2) + (" ◀" if name == slow_meas and len(ring) > 1 else "")
        t.add_row(label, m.get("backend") or "–", m.get("nat") or "–", _f(m.get("memory_gb")),
                  _f(m.get("bandwidth_gbps")), str(stg.get("blocks") or "–"), pred, meas,
                  _pct((errors.get(name) or {}).get("error")), m.get("state") or "–")  # fmt: skip
    if ring:
        parts.append(t)

    measured = {e.get("from"): e for e in st.get("edges") or []}
    if len(ring) > 1:
        e_t = Table(title="ring edges", title_justify="left")
        for col in ("edge", "kind", "frames over", "RTT ms", "plan ms", "NAT (from / to)"):
            e_t.add_column(col)
        for e in plan.get("edges") or []:
            got = measured.get(e["from"]) or {}
            e_t.add_row(f"{e['from']} → {e['to']}", got.get("kind") or f"{e.get('kind')} (planned)",
                        {"tcp": "TCP", "quic": "QUIC"}.get(got.get("lane"), "–"),
                        _f(got.get("rtt_ms"), 2), _f(e.get("ms"), 2),
                        f"{(members.get(e['from']) or {}).get('nat', '?')} / "
                        f"{(members.get(e['to']) or {}).get('nat', '?')}")  # fmt: skip
        parts.append(e_t)

    if plan:
        tok = (st.get("prediction") or {}).get("tok_s") or {}
        off = f" ({_pct(tok['error'])} off the prediction)" if tok.get("error") is not None else ""
        parts.append(Text(f"plan ({plan.get('policy')}, tier {plan.get('tier')}): {plan_summary(plan)}; "
                          f"measured {_f(st.get('tok_s'))} tok/s{off}, step {_f(st.get('step_ms'), 2)} ms, "
                          f"network {_f(st.get('network_ms'), 2)} ms"))  # fmt: skip
    req = st.get("requests")
    api = st.get("api") or {}
    live = f"requests: {req['active']} active, {req['queued']} queued" if req else "requests: scheduled by the head"
    parts.append(Text(f"{live}; {api.get('inflight_requests', 0)} in flight at this API ({api.get('url', '?')})"))
    parts.extend(load_parts(st.get("load"), ring))
    w = st.get("weights") or {}
    if w.get("total_bytes") is not None:  # live figures (while fetching, and kept once done)
        parts.append(Text(f"weights: {transfer_line(w)} from {w.get('source')}"))
    elif w.get("tensor_bytes"):
        got, total = w.get("received_bytes") or 0, w["tensor_bytes"]
        rate = f", {got / 1e6 / w['seconds']:.1f} MB/s" if w.get("seconds") else ""
        parts.append(Text(f"weights: {got / 1e6:.1f} of {total / 1e6:.1f} MB from {w.get('source')}{rate}"))
    for name, t in (st.get("transfers") or {}).items():  # the host: what it serves each member
        parts.append(Text(f"weights to {name}: {transfer_line(t)}"))
    mem = st.get("memory") or {}
    if mem.get("rss_bytes"):
        parts.append(Text(f"memory here: {mem['rss_bytes'] / 1e6:.0f} MB resident; the plan expects "
                          f"{(mem.get('planned_bytes') or 0) / 1e6:.1f} MB with its KV full"))  # fmt: skip
    history = [h for h in st.get("history") or [] if isinstance(h, dict)]
    if history:
        parts.append(Text("history: " + "; ".join(history_line(h) for h in history[-8:])))
    return Group(*parts)


def load_parts(load: dict | None, ring: list[str]) -> list:
    """GET /status `load`: a line for the queue, one for the micro-batches, a table of every
    stage's active requests and rows in its last forward, and one of the requests the head holds
    with their tok/s."""
    if not isinstance(load, dict):
        return []
    parts: list = []
    if load.get("slots") is not None:
        kept = f", {load['parked']} keeping a finished request's prompt cache" if load.get("parked") else ""
        parts.append(Text(f"slots: {load.get('active')} of {load['slots']} busy{kept}, {load.get('queued')} queued "
                          f"(at most {load.get('max_queued')} wait; one more is answered 429)"))  # fmt: skip
    b = load.get("batching")
    if isinstance(b, dict) and b.get("groups"):
        sizes = load.get("micro_batches") or []
        cost = (f"; a batch costs the busiest machine {_f(b['c_ms'])} + {_f(b['beta_ms'], 2)} ms a position"
                if b.get("c_ms") is not None and b.get("beta_ms") is not None else "")  # fmt: skip
        parts.append(Text(f"micro-batches: {b['groups']} kept in flight, rows now {sizes or '–'}{cost}"))
    stages = load.get("stages") or {}
    if any(stages.get(n) for n in ring):
        t = Table(title="load per stage", title_justify="left")
        for col in ("member", "active requests", "rows in last forward", "forwards"):
            t.add_column(col, justify="left" if col == "member" else "right")
        for name in ring:
            stg = stages.get(name) or {}
            t.add_row(name, *(str(stg[k]) if stg.get(k) is not None else "–" for k in ("active", "batch_rows", "steps")))
        parts.append(t)
    requests = load.get("requests") or []
    if requests:
        t = Table(title="requests at the head", title_justify="left")
        for col in ("request", "from", "state", "tokens", "tok/s"):
            t.add_column(col, justify="right" if col in ("tokens", "tok/s") else "left")
        for r in requests:
            t.add_row(str(r.get("id")), str(r.get("origin")), str(r.get("state")),
                      f"{r.get('tokens')} / {r.get('max_tokens')}", _f(r.get("tok_s")))  # fmt: skip
        parts.append(t)
    return parts


def history_line(h: dict) -> str:
    """One membership event from /status: when, what, who, the ring it planned, why."""
    ring = f": ring {' → '.join(map(str, h['ring']))}" if h.get("ring") else ""
    who = f" {h['name']}" if h.get("name") else ""
    why = f" ({h['reason']})" if h.get("reason") else ""
    return f"{h.get('at', '?')} {h.get('event', '?')}{who}{ring}{why}"


def handle(args) -> int:
    from rich.console import Console

    host, port = parse_hostport(args.api)
    if args.json:
        print(json.dumps(fetch_status(host, port)))
        return EXIT_OK
    console = Console()
    if not args.watch:
        console.print(render(fetch_status(host, port)))
        return EXIT_OK
    from rich.live import Live

    try:
        with Live(render(fetch_status(host, port)), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(WATCH_EVERY_S)
                live.update(render(fetch_status(host, port)))
    except KeyboardInterrupt:
        return EXIT_OK


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "status",
        help="show a session as any member sees it (members, ring, plan vs measured)",
        description="Print the session from a member's GET /status: members, ring edges, the "
        "plan's predicted tok/s and bottleneck against the measured figures.",
    )
    p.add_argument("--api", default=f"{DEFAULT_API_HOST}:{DEFAULT_API_PORT}", metavar="HOST:PORT",
                   help=f"the member's API (default {DEFAULT_API_HOST}:{DEFAULT_API_PORT})")  # fmt: skip
    p.add_argument("--watch", action="store_true", help="refresh every second until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print the raw GET /status JSON")
    p.set_defaults(handler=handle)
