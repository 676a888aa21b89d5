"""What a member holds in memory, against what the planner expected it to hold.

`process_memory()` reads this process's resident set (RSS), its peak (VmHWM) and its proportional
set (PSS: shared pages divided among the processes mapping them, from /proc/self/smaps_rollup) on
Linux; elsewhere RSS and PSS are unknown (None) and the peak comes from getrusage. Pages of a
memory-mapped model file count in RSS/PSS while resident: a file on tmpfs is memory either way.

`shard_memory()` is the planner's side (planner.member_bytes, the formula admission checks): the
shard's tensor bytes, its KV cache at the session's context and concurrency, and what the planner
expects the member to hold — the backend's fixed per-process term, the weights in the backend's
forms, the head's extra (backends.memory) and the KV.
"""

from __future__ import annotations

import resource
import sys


def _status_kib(text: str, key: str) -> int | None:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def process_memory() -> dict:
    """{"rss_bytes", "peak_rss_bytes", "pss_bytes"} of this process (None where unknown)."""
    out: dict = {"rss_bytes": None, "peak_rss_bytes": None, "pss_bytes": None}
    try:
        with open("/proc/self/status") as f:
            text = f.read()
        out["rss_bytes"] = _status_kib(text, "VmRSS")
        out["peak_rss_bytes"] = _status_kib(text, "VmHWM")
        with open("/proc/self/smaps_rollup") as f:
            out["pss_bytes"] = _status_kib(f.read(), "Pss")
    except OSError:  # not Linux (or no smaps_rollup: kernels before 4.14)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["peak_rss_bytes"] = out["peak_rss_bytes"] or (peak if sys.platform == "darwin" else peak * 1024)
    return out


def shard_memory(index, first: int, last: int, head: bool, context: int, concurrency: int,
                 backend: str = "openvino", process_bytes: float | None = None,
                 anchor: bool = False, speculate: str = "off") -> dict:  # fmt: skip
    """{"shard_bytes", "kv_bytes", "state_bytes", "planned_bytes", "planned_weights_bytes"} of
    blocks [first, last) (+ the head) of `index` on `backend` (state: a hybrid model's recurrent
    state, a sliding-window model's windowed KV, for `concurrency` requests): planned is planner.member_bytes at context × concurrency
    (what admission checked), planned_weights the same without KV (what a member holds before
    its KV fills). `process_bytes` replaces the backend's per-process term (`kafila run`);
    `anchor`: the member is the host (planner's anchor_bytes); `speculate`: the session's mode
    (with mtp the head's planned bytes hold the MTP block, its KV and rows)."""
    from backends.memory import RECURRENT_STATE_COPIES
    from kafila.session.ring.speculation.mtp import with_drafting_head
    from planner import member_bytes, parse_fleet

    blocks = last - first
    shard = sum(t.n_bytes for t in index.shard_tensors(first, last, head))
    raw = with_drafting_head(index.planner_model(backend), index, {backend}, speculate)  # --speculate mtp
    if process_bytes is not None:
        raw["process_bytes"] = process_bytes
    model = parse_fleet({"context": 1, "concurrency": 1, "anchor": "a", "model": raw,
                         "devices": [{"name": "a", "memory_gb": 1}]}).model  # fmt: skip
    kv = int(model.kv_bytes_per_token_per_block * context * concurrency * blocks)
    # hybrids' state and windowed layers' KV (their window)
    state = (index.state_bytes_per_request(first, last) * RECURRENT_STATE_COPIES
             + index.window_bytes_per_request(first, last)) * concurrency  # fmt: skip
    return {"shard_bytes": shard, "kv_bytes": kv, "state_bytes": state,
            "planned_bytes": int(member_bytes(model, blocks, head, context * concurrency, anchor, concurrency)),
            "planned_weights_bytes": int(member_bytes(model, blocks, head, 0, anchor))}  # fmt: skip


def member_memory(index, first: int, last: int, head: bool, context: int, concurrency: int,
                  backend: str = "openvino", anchor: bool = False, speculate: str = "off") -> dict:
    """What /status reports under "memory": the process's figures and the plan's for its shard,
    with RSS/PSS/peak as multiples of (shard + KV) and of the planned bytes."""
    out = process_memory()
    if index is None:
        return {**out, "shard_bytes": None, "kv_bytes": None, "state_bytes": None, "planned_bytes": None,
                "planned_weights_bytes": None}  # fmt: skip
    out.update(shard_memory(index, first, last, head, context, concurrency, backend, anchor=anchor, speculate=speculate))
    base = out["shard_bytes"] + out["kv_bytes"]
    for key in ("rss_bytes", "pss_bytes", "peak_rss_bytes"):
        value = out[key]
        name = key.removesuffix("_bytes")
        out[f"{name}_per_shard_kv"] = None if value is None or not base else round(value / base, 3)
        out[f"{name}_per_planned"] = None if value is None or not out["planned_bytes"] else round(
            value / out["planned_bytes"], 3)  # fmt: skip
    return out
