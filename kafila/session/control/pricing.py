"""What the host hands the planner beyond the fleet contract's basics, and the prediction beside
the measurement.

- `probe_fields(descriptor, host)`: a member's probe figures as fleet fields (bandwidth,
  overhead, TFLOP/s, a block's and the head's fixed cost, the machine it runs on); a member on
  the host's machine, neither under a CPU quota, takes the host's timing figures: the host
  timed the model's own blocks against them (calibrate.py), so its stages are priced by that
  timing, not by a second quick probe of the same cores (which moved the demo's stage
  predictions by 10-20 % from run to run);
- `model_reads(index)`: what a token reads of the model, from the GGUF: the head's lm_head (not
  the embedding table: a token reads one row of it) and, for a mixture-of-experts file, the
  expert count E, the experts a token uses k and one expert's bytes (a block's `*_exps`
  tensors over E), so the planner balances the bytes read while memory counts every expert;
- `choose_context(...)`: the session's context, the model's own by default capped by what the
  members' memory holds (planner.largest_context), an explicit one refused with the largest
  that fits;
- `predictions(plan, measured)`: per stage, the planner's ms beside the measured, and tok/s,
  for /status, `kafila status` and `kafila demo --json`.
"""

from __future__ import annotations

from typing import Any

from backends.errors import Refused

TIMING_FIELDS = ("bandwidth_gbps", "overhead_us", "tflops", "block_us", "block_gbps", "head_us")
PROBE_FIELDS = (*TIMING_FIELDS, "cpu_quota", "cpu_period_ms", "cpu_burst", "cpu_run_ms", "machine")
# With --concurrency auto the context is capped so that memory holds this many requests at it
# (as llama-server's default parallel slots); auto then gives as many slots as memory holds.
CONTEXT_ROOM_REQUESTS = 4


def probe_fields(descriptor: dict, host: dict | None = None) -> dict:
    """The descriptor's measurements present (not null), as the fleet's device fields; the
    planner validates them (PlanInputError: one line naming the field). With the `host`'s
    descriptor: its timing figures where the member shares its machine and what it was probed
    on, and neither computes under a CPU quota."""
    own = {k: descriptor[k] for k in PROBE_FIELDS if descriptor.get(k) is not None}
    if host is None or not _same_cores(descriptor, host):
        return own
    return {**own, **{k: host[k] for k in TIMING_FIELDS if host.get(k) is not None}}


def _same_cores(a: dict, b: dict) -> bool:
    """Whether two descriptors measured the same cores the same way: one machine, one backend,
    neither under a CPU quota (a quota'd member's figures are its own)."""
    return (a.get("machine") is not None and a.get("machine") == b.get("machine")
            and a.get("probed_on") == b.get("probed_on")
            and a.get("cpu_quota") is None and b.get("cpu_quota") is None)  # fmt: skip


def model_reads(index: Any) -> dict:
    """Read-bytes fields of the planner's model entry for `index` (a backends.gguf ModelIndex)."""
    sizes = {name: t.n_bytes for name, t in index.tensors.items()}
    return reads_from(index.lean_metadata, sizes)


def reads_from(metadata: dict, sizes: dict[str, int]) -> dict:
    """model_reads from a GGUF's metadata and its tensors' byte sizes (name → bytes), whatever
    its architecture (backends.gguf.read_header gives both for a file the backends refuse)."""
    out: dict = {}
    lm = sizes.get("output.weight", sizes.get("token_embd.weight"))
    if lm is not None:
        out["head_read_bytes"] = float(lm)
    arch = metadata.get("general.architecture")
    count = metadata.get(f"{arch}.expert_count")
    used = metadata.get(f"{arch}.expert_used_count")
    if isinstance(count, int) and isinstance(used, int) and 1 <= used <= count:
        experts = sum(n for name, n in sizes.items() if name.startswith("blk.0.") and "_exps." in name)
        if experts:
            out.update(expert_count=count, experts_used=used, expert_bytes=experts / count)
    return out


def choose_context(fleet: dict, asked: int | None, model_context: int, model_name: str,
                   policy: str, concurrency: int | None) -> tuple[int, str]:
    """The session's context for `fleet` (its "context" is replaced) and one line saying why.
    `asked`: --context (None: the model's own, capped by memory at the session's concurrency,
    CONTEXT_ROOM_REQUESTS with auto). Refused when an explicit context does not fit but a
    shorter one would; a fleet that fits no context is left to the plan's refusal."""
    from planner import PlanInputError, largest_context, parse_fleet

    room = concurrency or CONTEXT_ROOM_REQUESTS
    want = asked or model_context
    try:
        parsed = parse_fleet({**fleet, "context": want, "concurrency": room})
    except PlanInputError as exc:
        raise Refused(f"cannot plan this session: {exc}") from None
    fits = largest_context(parsed, want, policy)
    at = f"{room} request{'s' if room > 1 else ''} at once"
    if asked is not None:
        if 2 <= fits < asked:
            raise Refused(f"--context {asked} does not fit the members' memory at {at}: the largest that "
                          f"fits is {fits} (kafila host --context {fits}, or leave --context out)")  # fmt: skip
        return asked, f"context {asked} (--context)"
    if fits >= want:
        return want, f"context {want}: {model_name}'s own"
    if fits < 2:
        return want, f"context {want}: {model_name}'s own (the members' memory cannot hold it)"
    return fits, (f"context {fits}: {model_name}'s own is {want}, the members' memory holds {fits} "
                  f"at {at}")  # fmt: skip


def predictions(plan: dict | None, stage_ms: dict, tok_s: float | None) -> dict:
    """Predicted beside measured: per stage ms with |predicted − measured| / measured, and tok/s
    (one request: 1 / the circuit). The head's stage is compared without its token pick (the
    plan's `head_ms`: the lm_head and the pick), which a member times apart from its stage. A
    member under a CPU quota is compared at one request's time (the plan's `alone_ms`)."""
    from kafila.session.control.preview import predicted_tok_s

    plan = plan or {}
    predicted = plan.get("alone_ms") or plan.get("stage_ms") or {}
    pick = plan.get("head_ms") or 0.0
    stages = {}
    for name in plan.get("ring") or []:
        p, m = predicted.get(name), stage_ms.get(name)
        if p is not None and name == plan.get("head"):
            p = max(0.0, p - pick)
        stages[name] = {"predicted_ms": _r(p), "measured_ms": _r(m), "error": _error(p, m)}
    tps = predicted_tok_s(plan)
    return {"stages": stages, "pick_ms": {"predicted": _r(plan.get("head_ms"))},
            "tok_s": {"predicted": _r(tps), "measured": _r(tok_s), "error": _error(tps, tok_s)}}  # fmt: skip


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return round(abs(predicted - measured) / measured, 4)


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


__all__ = ["CONTEXT_ROOM_REQUESTS", "choose_context", "model_reads", "predictions", "probe_fields", "reads_from"]
