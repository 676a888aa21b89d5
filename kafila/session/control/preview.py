"""The plan as a person reads it: the table, the predicted tok/s and the bottleneck member named.

Pure functions of a plan's JSON (`planner.Plan.to_json`), shared by the host's preview (printed
before anything is sent), `kafila status` and `kafila demo`, so all three say the same thing.
"""

from __future__ import annotations

from rich.table import Table


def predicted_tok_s(plan: dict | None) -> float | None:
    """Single-stream tok/s the plan predicts: one token goes once around the ring
    (planner.Plan.predicted_tok_s; None for no plan, or one that cannot be read)."""
    from planner import Plan, PlanInputError

    try:
        return Plan.from_json(plan).predicted_tok_s
    except PlanInputError:
        return None


def bottleneck(plan: dict | None) -> str | None:
    """The member whose predicted stage time is the largest (None without stage times)."""
    known = {n: v for n, v in ((plan or {}).get("stage_ms") or {}).items() if v is not None}
    return max(known, key=known.get) if known else None


def plan_summary(plan: dict | None) -> str:
    """One line: "predicted 10.8 tok/s, bottleneck m3 (11.04 ms) → at most 90.6 tok/s with the
    ring full". The bottleneck's own figure is what its stage alone allows when every slot of the
    ring is busy (one token a stage time); the first figure is one request's."""
    tps = predicted_tok_s(plan)
    name = bottleneck(plan)
    line = f"predicted {'–' if tps is None else f'{tps:.1f}'} tok/s, bottleneck "
    if name is None:
        return line + "– (the plan has no stage times)"
    ms = plan["stage_ms"][name]  # type: ignore[index]
    # members of one machine compute one at a time: the ring full waits on the machine's sum
    busy = plan.get("bottleneck_ms") if plan.get("machines") else ms  # type: ignore[union-attr]
    shared = " (its machine's stages together)" if busy and busy != ms else ""
    cap = f" → at most {1000.0 / busy:.1f} tok/s with the ring full{shared}" if busy and busy > 0 else ""
    return line + f"{name} ({ms:.2f} ms){cap}"


def plan_table(plan: dict, first_blocks: dict[str, tuple[int, int]]) -> Table:
    t = Table(title=f"plan ({plan['policy']}, tier {plan['tier']}): head {plan['head']}")
    for col in ("ring", "blocks", "range", "predicted stage ms", "edge to next"):
        t.add_column(col)
    edges = {e["from"]: e for e in plan["edges"]}
    slowest = bottleneck(plan) if len(plan["ring"]) > 1 else None
    for name in plan["ring"]:
        ms = (plan.get("stage_ms") or {}).get(name)
        e = edges.get(name)
        a, b = first_blocks[name]
        t.add_row(name + (" (head)" if name == plan["head"] else ""), str(plan["blocks"][name]),
                  f"[{a}, {b})", ("?" if ms is None else f"{ms:.2f}") + (" ◀ bottleneck" if name == slowest else ""),
                  "" if e is None else f"{e['kind']} → {e['to']}")  # fmt: skip
    return t




def members_table(rows: list[dict], title: str) -> Table:
    """The members as the host sees them while it waits (host.member_row each)."""
    t = Table(title=title)
    for col in ("name", "NAT", "RTT ms", "bandwidth GB/s", "memory GB", "state"):
        t.add_column(col)
    for r in rows:
        bw = r["bandwidth_gbps"]
        mem = r["memory_gb"]
        t.add_row(r["name"], r["nat"], f"{r['rtt_ms']:.1f}", "?" if bw is None else f"{bw:.1f}",
                  "?" if mem is None else f"{mem:.1f}", r["state"])  # fmt: skip
    return t


__all__ = ["bottleneck", "members_table", "plan_summary", "plan_table", "predicted_tok_s"]
