"""Fleet dictionaries shared by the planner tests (the `--fleet` JSON contract); no tests here."""

from __future__ import annotations

import copy
from typing import Any

GB = 1e9

# A small model: 10 blocks of 1 GB, a 2 GB head, no KV cache, so lim(i) = memory in GB
# (minus 2 on the head) and the arithmetic in the tests stays readable.
SMALL_MODEL = {
    "name": "small",
    "blocks": 10,
    "block_bytes": 1 * GB,
    "head_bytes": 2 * GB,
    "kv_bytes_per_token_per_block": 0,
}


def device(name: str, memory_gb: float, bandwidth_gbps: float | None = 100.0, **extra: Any) -> dict:
    entry: dict[str, Any] = {
        "name": name,
        "memory_gb": memory_gb,
        "bandwidth_gbps": bandwidth_gbps,
        "overhead_us": extra.pop("overhead_us", 20.0),
    }
    entry.update(extra)
    return entry


def fleet(*devices: dict, anchor: str | None = None, model: dict | None = None) -> dict:
    return {
        "context": 1024,
        "concurrency": 1,
        "anchor": anchor if anchor is not None else devices[0]["name"],
        "model": copy.deepcopy(model if model is not None else SMALL_MODEL),
        "devices": [copy.deepcopy(d) for d in devices],
    }
