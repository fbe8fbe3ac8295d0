"""How the lines of one JSON Lines body are scored: which lines ride together (pure).

Each line is a request of its own (a decision, a shared-state `decisions` batch, or a System
One request). Single decisions about one state, read with one policy, are merged into
shared-state batches, wherever they sit in the body, so the state is decoded once for all
of them; a `decisions` batch or a System One request is already one state's batch and goes
as it came. A line that is not a valid request gets its own error and rides nowhere.

Invariants (tests/adapter/test_line_plan.py checks them on randomized bodies):
- every line is answered exactly once: by its error, or by exactly one group;
- a merged group holds decisions about one state with one policy, at most `max_shared` of
  them, with distinct ids (what a shared-state body itself must satisfy);
- a group's lines are in input order, and groups start in the order of their first line;
- a decision goes into the first group of its state and policy with room and without its
  id, found in time linear in the lines (`_Bucket`), whatever the body repeats.
Planning runs in a worker thread (adapter.lines), never on the event loop.
Chat lines are refused: a generation is not an offline decision, and its time has no bound
that the body's deadline could plan for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adapter.apis import select_api
from adapter.errors import ApiError, RequestError
from adapter.likelihood import Readout
from adapter.schema import Decision, DecisionRequest, Policy, parse_decision_body
from adapter.systemone import SystemOneRequest, parse_systemone


@dataclass(frozen=True)
class Group:
    """Lines scored as one request; `merged`: single-decision lines joined into one
    shared-state batch (each line answers its own `result`)."""

    lines: tuple[int, ...]
    request: DecisionRequest | SystemOneRequest
    merged: bool = False

    def halves(self) -> tuple[Group, Group]:
        """A merged group cut in two, in line order, each half merged unless it is one line:
        what a merged group that failed as a whole is tried as, so that merging never turns
        lines that each succeed alone into errors (a batch over the request budget)."""
        assert self.merged
        assert isinstance(self.request, DecisionRequest)
        middle = len(self.lines) // 2
        request = self.request
        return (
            _group(self.lines[:middle], request.decisions[:middle], request.policy),
            _group(self.lines[middle:], request.decisions[middle:], request.policy),
        )


def _group(lines: Sequence[int], decisions: Sequence[Decision], policy: Policy) -> Group:
    """Single decisions about one state as one group: merged into a shared-state batch when
    there are several, answered as it was asked when alone."""
    if len(lines) == 1:
        return Group((lines[0],), DecisionRequest("single", list(decisions), policy))
    return Group(tuple(lines), DecisionRequest("shared", list(decisions), policy), merged=True)


class _Bucket:
    """The merged groups of one state and policy, filled in order: a decision goes into the
    first group with room that does not hold its id yet.

    In time linear in the lines (near enough: path halving), however many groups the bucket
    has (a body of 20,000 identical lines makes 20,000 groups): the groups before a
    decision id's last group are all full or hold that id, so the search starts after it
    (`after`), and `skip` jumps over full groups, each pointing at a later group that may
    have room (a union-find over "full")."""

    def __init__(self, max_shared: int) -> None:
        self.max_shared = max_shared
        self.lines: list[list[int]] = []
        self.decisions: list[list[Decision]] = []
        self.skip: list[int] = []  # skip[i] == i: group i has room
        self.after: dict[str, int] = {}  # decision id -> one past its last group

    def place(self, index: int, decision: Decision) -> None:
        slot = self._with_room(self.after.get(decision.id, 0))
        if slot == len(self.lines):
            self.lines.append([])
            self.decisions.append([])
            self.skip.append(slot)
        self.lines[slot].append(index)
        self.decisions[slot].append(decision)
        self.after[decision.id] = slot + 1
        if len(self.lines[slot]) >= self.max_shared:
            self.skip[slot] = slot + 1

    def _with_room(self, start: int) -> int:
        """The first group at or after `start` with room (len(groups) when none)."""
        slot = start
        while slot < len(self.skip) and self.skip[slot] != slot:
            after = self.skip[slot]
            if after < len(self.skip):
                self.skip[slot] = self.skip[after]  # path halving
            slot = after
        return slot

    def groups(self, policy: Policy) -> list[Group]:
        return [
            _group(lines, decisions, policy)
            for lines, decisions in zip(self.lines, self.decisions, strict=True)
        ]


@dataclass(frozen=True)
class Plan:
    groups: list[Group]
    errors: dict[int, ApiError]  # line -> its own answer


def plan(lines: Sequence[Any], max_shared: int, default_readout: Readout = "letters") -> Plan:
    """Group parsed lines (each a JSON value, or the ApiError its parsing raised); a
    decision line without a readout is read with the server's `default_readout`."""
    errors: dict[int, ApiError] = {}
    starts: list[Group | tuple[Policy, _Bucket]] = []  # in the order of their first line
    buckets: dict[tuple[str, Policy], _Bucket] = {}
    for index, line in enumerate(lines):
        if isinstance(line, ApiError):
            errors[index] = line
            continue
        try:
            request = _parse(line, max_shared, default_readout)
        except ApiError as error:
            errors[index] = error
            continue
        if isinstance(request, SystemOneRequest) or request.mode == "shared":
            starts.append(Group((index,), request))
            continue
        (decision,) = request.decisions
        key = (decision.state_text, request.policy)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = _Bucket(max_shared)
            starts.append((request.policy, bucket))
        bucket.place(index, decision)
    groups: list[Group] = []
    for start in starts:
        if isinstance(start, Group):
            groups.append(start)
        else:
            groups.extend(start[1].groups(start[0]))
    groups.sort(key=lambda group: group.lines[0])
    return Plan(groups, errors)


def _parse(
    line: Any, max_shared: int, default_readout: Readout
) -> DecisionRequest | SystemOneRequest:
    api = select_api(line)
    if api == "systemone":
        return parse_systemone(line, max_shared)
    if api == "chat":
        raise RequestError(
            "messages", "chat completions are not answered in JSON Lines; send each alone"
        )
    return parse_decision_body(line, max_shared, default_readout)
