"""What a member measured of the ring: its stages' compute, the head's trips, the last decode rate.

Every member keeps one `Measured`: its own stage's compute (its ring node measures each
forward); the head adds every stage's from the traces its activations bring back and the trip
times of its decode steps (head.py); the figures travel to a request's origin with its last
tokens (`as_pairs`, `update_from`), so /status shows them on whichever member asked. No clocks:
callers pass durations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EMA = 0.2  # weight of the newest measurement in the moving averages


def ema(old: float | None, new: float) -> float:
    return new if old is None else old + EMA * (new - old)


@dataclass
class Measured:
    stage_ms: dict[str, float] = field(default_factory=dict)
    step_ms: float | None = None  # head: one decode step round the ring
    network_ms: float | None = None  # step_ms minus every stage's compute
    tok_s: float | None = None  # the latest finished request's decode rate

    def stage(self, name: str, us: int) -> None:
        """Stage `name` computed one decode step in `us` µs."""
        self.stage_ms[name] = ema(self.stage_ms.get(name), us / 1000)

    def as_pairs(self) -> tuple[tuple[str, float], ...]:
        out = [("stage:" + k, round(v, 3)) for k, v in self.stage_ms.items()]
        for k in ("step_ms", "network_ms", "tok_s"):
            if (v := getattr(self, k)) is not None:
                out.append((k, round(v, 3)))
        return tuple(out)

    def update_from(self, pairs) -> None:
        for k, v in pairs:
            if k.startswith("stage:"):
                self.stage_ms[k[6:]] = float(v)
            elif k in ("step_ms", "network_ms", "tok_s"):
                setattr(self, k, float(v))
