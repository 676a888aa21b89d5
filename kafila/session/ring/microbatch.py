"""Sans-I/O grouping of the head's decode steps into micro-batches (batched decode rows).

A micro-batch is a set of requests whose decode steps travel round the ring together, each stage
running them as one forward (`Shard.forward_batch`: the weights read once for all rows). Two
things make it pay, and both are decided here:

- Membership is stable. A backend keeps a batch's KV rows together (OpenVINO: one state whose
  rows are the slots), so a row that joins costs a copy of its KV and one that leaves costs
  nothing: a request is put in a group once, and stays in it until it ends.
- The ring stays full. With G groups on a ring of G machines, each machine works on one group
  while the others are elsewhere (pipelining); more requests make the groups bigger, not more
  numerous. Stages that share a machine share its cores and do not run side by side, so they
  count once (a loopback session of 3 stages on one machine keeps one group: the biggest rows).
  A request is added to the smallest group (a new one while there are fewer than `groups`), and
  moves to a group two rows smaller at its next step (the groups stay within a row of each other).

A group leaves when every member's step is ready, which happens when the group comes back round
the ring; a member that joined while its group was away waits for it (once, at most one trip).

A plan (`plan`, the live DiP-SD optimiser's batches: dipsd_live.py) overrides the placement: a
planned request rides in the group of its batch's label, and moves there at its next ready step
if it is elsewhere (that move is a join: the optimiser moves requests only for a gain).

    ready(step)   a plain decode step of request req_id (its group is chosen on its first)
    leave(req_id)    the request ended, or its next step cannot share a forward (a prefill, drafts)
    due()         the groups to send now: [[step, ...], ...] (every member ready)
    plan(labels)  req_id → batch label for the requests the optimiser placed ({}: none)

Prompts too: prefill steps that are ready together go round as one batch (`prompt_batches`), so
eight people who type at once have their prompts read with the weights read once, not eight
times; such a batch lives for one trip (its rows then decode in the groups above).

How many groups: `best_groups` weighs a longer trip per group (fewer, bigger batches) against
more compute per round (more, smaller ones, each reading the weights again) on the measured
compute of a batch of r rows, so 8 users 20 ms a hop from each other on one machine go round
as two groups of 4, not three of 3 or one of 8.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Group:
    members: list[str] = field(default_factory=list)  # in joining order: the rows' order
    ready: dict[str, Any] = field(default_factory=dict)  # req_id -> its step
    label: int | None = None  # the planned batch it carries (None: placed by the rule below)


class MicroBatches:
    def __init__(self, groups: int, max_rows: int) -> None:
        self.groups = max(1, groups)
        self.max_rows = max(1, max_rows)
        self._groups: dict[int, _Group] = {}
        self._of: dict[str, int] = {}
        self._next = 0
        self._plan: dict[str, int] = {}

    def plan(self, labels: dict[str, int]) -> None:
        self._plan = dict(labels)

    def ready(self, step: Any) -> None:
        gid = self._of.get(step.req_id)
        label = self._plan.get(step.req_id)
        if label is not None and (gid is None or self._groups[gid].label != label):
            if gid is not None:  # planned into another batch: leave this one first
                self.leave(step.req_id)
            gid = self._labelled(label)
            self._join(step.req_id, gid)
        elif gid is None:
            gid = self._place()
            self._join(step.req_id, gid)
        elif label is None and (to := self._lighter(gid)) is not None:
            self.leave(step.req_id)  # a join: the groups stay within a row of each other
            gid = to
            self._join(step.req_id, gid)
        self._groups[gid].ready[step.req_id] = step

    def _lighter(self, gid: int) -> int | None:
        """A group of the placement rule two or more rows lighter than `gid` (None: none). Users
        arriving while fewer groups were wanted all joined the groups there were (5 and 3 of 8
        users): the biggest group sets every group's pace on a shared ring."""
        size = len(self._groups[gid].members)
        light = [g for g, grp in self._groups.items() if grp.label is None and len(grp.members) <= size - 2]
        return min(light, key=lambda g: (len(self._groups[g].members), g)) if light else None

    def _join(self, req_id: str, gid: int) -> None:
        self._groups[gid].members.append(req_id)
        self._of[req_id] = gid

    def _labelled(self, label: int) -> int:
        for gid, grp in self._groups.items():
            if grp.label == label:
                return gid
        self._next += 1
        self._groups[self._next] = _Group(label=label)
        return self._next

    def _place(self) -> int:
        open_groups = [g for g, grp in self._groups.items() if len(grp.members) < self.max_rows]
        if len(self._groups) < self.groups or not open_groups:
            self._next += 1
            self._groups[self._next] = _Group()
            return self._next
        return min(open_groups, key=lambda g: (len(self._groups[g].members), g))

    def leave(self, req_id: str) -> Any | None:
        """Take req_id out of its group; returns its step if one was waiting (the caller sends it).
        Its plan stays (a prefill chunk leaves too): `plan` replaces the whole plan."""
        gid = self._of.pop(req_id, None)
        if gid is None:
            return None
        group = self._groups[gid]
        group.members.remove(req_id)
        step = group.ready.pop(req_id, None)
        if not group.members:
            del self._groups[gid]
        return step

    def due(self) -> list[list[Any]]:
        out = []
        for group in self._groups.values():
            if group.members and len(group.ready) == len(group.members):
                out.append([group.ready[req_id] for req_id in group.members])
                group.ready.clear()
        return out

    def group_of(self, req_id: str) -> int | None:
        return self._of.get(req_id)

    @property
    def sizes(self) -> list[int]:
        return [len(g.members) for g in self._groups.values()]

    def placed(self, req_id: str) -> bool:
        return req_id in self._of

    @property
    def rows(self) -> int:
        """Requests in a group now."""
        return len(self._of)


# The share of a round that a machine running several stages may be kept computing. Its stages
# are separate processes taking turns at its cores (cores.py): every group adds hand-overs whose
# cost the stages' compute times do not show (threads and caches gone cold: a forward after 15 ms
# idle runs 1.6× as long, docs/BENCHMARKS.md "Where the ring's cost is"), and groups that meet at
# the machine wait for each other. Measured on one 2-core machine at 20 ms a hop, 8 and 16 users:
# two groups beat one by 8-10 %, three or more groups (the machine's compute filling the round)
# lost 15-25 % to one (docs/BENCHMARKS.md, "Prompts in one batch, and how many micro-batches on
# one machine").
SHARED_BUSY_SHARE = 0.75
# A group more must shorten the round by this much. A group has costs the model leaves out (its
# hand-overs, above), and requests that arrive later join the groups that exist: chosen for the
# first 3 of 8 users arriving one by one, three groups (a round 4 % shorter for 3 rows) took all
# 8 at 110 ms a token against 93 for two (20 ms a hop, one 2-core machine, 2026-12-03).
GROUP_GAIN = 0.05
# The head's fit of a decode row's cost (HeadCore.serial_cost): a row's share of a one-row trip's compute. One forward of 8 rows took 2.2× one row's time
# on the default model (bench.batch_rows --head, an Intel Xeon with AMX; 1.8-2.8× on an AMD EPYC),
# and 4 rows of the 8B shape 1.39× one (docs/BENCHMARKS.md): a row costs 0.11-0.26 of a trip.
# ROW_PRIOR_SLOPE stands in until batches of two sizes are measured; ROW_MIN_SHARE bounds the fit
# from below: on a machine whose cores several stages share, a group's measured compute holds the
# other groups' interference, and trips of 2 and 4 rows measured alike fitted a row at 0.01 of a
# trip, which made one group of 8 rows look as cheap as one row (110 ms a token against 93 for
# two groups of 4; 20 ms a hop, 2026-12-03).
ROW_PRIOR_SLOPE = 0.15
ROW_MIN_SHARE = 0.1


def best_groups(rows: int, c_ms: float, beta_ms: float, net_ms: float, others_ms: float, most: int,
                busy_share: float = 1.0) -> int:  # fmt: skip
    """How many micro-batches `rows` decode steps should go round in (1..most). A batch of r rows
    costs the busiest machine busy(r) = c + β·r; a group's trip is net_ms (the hops), the other
    machines' compute (others_ms for one row, grown as the busiest machine's) and busy(r); a
    round of every group takes the longer of one trip and the busiest machine's compute for all
    groups, g·busy(r), at most `busy_share` of a round (SHARED_BUSY_SHARE where that machine
    runs several stages). The fewest groups whose round (each round moves every row one token)
    is within GROUP_GAIN of the shortest."""
    rows = max(1, rows)
    one = max(c_ms + beta_ms, 1e-9)
    rounds = []
    for g in range(1, max(1, min(most, rows)) + 1):
        busy = c_ms + beta_ms * math.ceil(rows / g)
        rounds.append(max(net_ms + others_ms * busy / one + busy, g * busy / busy_share))
    shortest = min(rounds)
    return next(g for g, r in enumerate(rounds, 1) if r <= shortest * (1 + GROUP_GAIN) + 1e-9)


def prompt_batches(steps: Sequence[Any], most_positions: int, most_rows: int) -> list[list[Any]]:
    """Prefill steps (each with `tokens`) in arrival order, packed into batches that run as one
    forward: consecutive steps while the batch's padded size (rows × its longest step, what a
    padding backend computes) stays within `most_positions` (the prefill chunk: one stage's
    working set) and its rows within `most_rows`. A step longer than the bound goes alone."""
    batches: list[list[Any]] = []
    longest = 0  # of the last batch
    for step in steps:
        n = len(step.tokens)
        rows = len(batches[-1]) + 1 if batches else 0
        if 0 < rows <= most_rows and rows * max(longest, n) <= most_positions:
            batches[-1].append(step)
        else:
            batches.append([step])
            longest = 0
        longest = max(longest, n)
    return batches
