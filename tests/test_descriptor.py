"""Issue 38 item 1: a joiner's descriptor is an input. Each field the host plans with is checked
at the door (kafila.net.descriptor), so a hello with `"bandwidth_gbps": "fast"` is refused in one
line naming the field instead of crashing the host's table or planner later."""

from __future__ import annotations

import pytest

from kafila.net.descriptor import descriptor_problem
from kafila.net.roster import MemberInfo, own_entry_problem
from rendezvous.errors import ProtocolError

GOOD = {"backend": "openvino", "probed_on": "reference numpy CPU", "memory_gb": 7.5, "bandwidth_gbps": 12.0,
        "overhead_us": 80.0, "tflops": 0.4, "machine": "ab12", "protocol": 3, "version": "0.1.0"}

BAD = [
    ("bandwidth_gbps", "fast"), ("memory_gb", "lots"), ("memory_gb", 1e308), ("memory_gb", float("inf")),
    ("memory_gb", float("nan")), ("memory_gb", 0), ("memory_gb", -4.0), ("memory_gb", True),
    ("overhead_us", -1.0), ("tflops", [1.0]), ("tflops", {"x": 1}), ("bandwidth_gbps", 1e9),
    ("backend", 7), ("backend", "x" * 200), ("machine", b"raw"), ("protocol", "3"), ("protocol", 2.5),
    ("protocol", -1), ("version", ["1"]),
]


def entry(descriptor) -> dict:
    return {"name": "m2", "descriptor": descriptor, "fp": "a" * 64, "rid": 1, "cand": [["127.0.0.1", 4000]],
            "nat": {"nat": "ordinary", "rtt_ms": 1.0, "mapped": "", "filtering": "", "mapping": ""}}


def test_a_real_descriptor_and_a_minimal_one_pass() -> None:
    assert descriptor_problem(GOOD) is None and descriptor_problem({}) is None
    assert descriptor_problem({**GOOD, "tflops": None, "extra": "kept"}) is None
    assert MemberInfo.from_wire(entry(GOOD)).descriptor == GOOD


@pytest.mark.parametrize(("key", "value"), BAD)
def test_each_malformed_field_is_refused_in_one_line_naming_it(key, value) -> None:
    problem = descriptor_problem({**GOOD, key: value})
    assert problem is not None and key in problem and "\n" not in problem
    with pytest.raises(ProtocolError) as caught:  # the host's admission turns it into a sealed refusal
        MemberInfo.from_wire(entry({**GOOD, key: value}))
    assert key in caught.value.reason
    assert key in own_entry_problem("m2", {**GOOD, key: value})  # and a joiner does not send it at all
