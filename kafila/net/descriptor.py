"""A member's descriptor: what a joiner says about its machine (probe results, backend, version),
carried in its hello. The host plans with these numbers and prints them, so each known field is
checked at the door: the right type, finite, in a range a real machine can have. A joiner whose
descriptor fails is refused in one line that names the field; nobody else notices.

Fields (all optional: an older or minimal joiner may leave any out; unknown keys are kept, the
whole descriptor is bounded by roster.MAX_DESCRIPTOR_BYTES):

    backend, probed_on    text         what it serves on, what the probe ran on
    memory_gb             (0, 65536]   memory the stage may use, GB
    bandwidth_gbps        (0, 1e5]     memory bandwidth, GB/s
    overhead_us           [0, 1e7]     per-call overhead, µs
    tflops                (0, 1e6]     compute, TFLOP/s
    machine               text         a hash naming the machine (stages on one share its cores)
    protocol              int 0..2^30  the session protocol it speaks
    version               text         its Kafila version
"""

from __future__ import annotations

import math

MAX_MEMORY_GB = 65536.0  # 64 TiB: more than any machine a household owns
MAX_BANDWIDTH_GBPS = 1e5
MAX_OVERHEAD_US = 1e7  # 10 s a call: slower is not a machine that can serve a stage
MAX_TFLOPS = 1e6
MAX_PROTOCOL = 1 << 30

# field -> (low, high, low inclusive)
NUMBERS: dict[str, tuple[float, float, bool]] = {
    "memory_gb": (0.0, MAX_MEMORY_GB, False),
    "bandwidth_gbps": (0.0, MAX_BANDWIDTH_GBPS, False),
    "overhead_us": (0.0, MAX_OVERHEAD_US, True),
    "tflops": (0.0, MAX_TFLOPS, False),
}
TEXTS: dict[str, int] = {"backend": 32, "probed_on": 64, "machine": 64, "version": 32}  # field -> max chars


def descriptor_problem(descriptor: object) -> str | None:
    """What is wrong with a descriptor, in one line naming the field, or None when it is usable."""
    if not isinstance(descriptor, dict):
        return "the descriptor is not a map"
    for key, (low, high, low_ok) in NUMBERS.items():
        value = descriptor.get(key)
        if value is None:
            continue
        shown = repr(value)[:40]
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"descriptor {key} must be a number, not {shown}"
        if not math.isfinite(value) or value > high or value < low or (value == low and not low_ok):
            return f"descriptor {key} must be {'≥' if low_ok else '>'} {low:g} and ≤ {high:g}, not {shown}"
    for key, limit in TEXTS.items():
        value = descriptor.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > limit):
            return f"descriptor {key} must be text of at most {limit} characters, not {repr(value)[:40]}"
    protocol = descriptor.get("protocol")
    if protocol is not None and (isinstance(protocol, bool) or not isinstance(protocol, int)
                                 or not 0 <= protocol <= MAX_PROTOCOL):  # fmt: skip
        return f"descriptor protocol must be an integer 0..{MAX_PROTOCOL}, not {repr(protocol)[:40]}"
    return None


__all__ = ["descriptor_problem"]
