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
- a group's lines are in input order, and groups start in the order of their first line.
Chat lines are refused: a generation is not an offline decision, and its time has no bound
that the body's deadline could plan for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from adapter import handlers
from adapter.errors import ApiError, RequestError
from adapter.likelihood import Readout
from adapter.schema import DecisionRequest, Policy, parse_decision_body
from adapter.systemone import SystemOneRequest, parse_systemone


@dataclass(frozen=True)
class Group:
    """Lines scored as one request; `merged`: single-decision lines joined into one
    shared-state batch (each line answers its own `result`)."""

    lines: tuple[int, ...]
    request: DecisionRequest | SystemOneRequest
    merged: bool = False


@dataclass
class _Open:
    """A merged group still taking lines."""

    lines: list[int]
    request: DecisionRequest
    ids: set[str]


@dataclass(frozen=True)
class Plan:
    groups: list[Group]
    errors: dict[int, ApiError]  # line -> its own answer


def plan(lines: Sequence[Any], max_shared: int, default_readout: Readout = "letters") -> Plan:
    """Group parsed lines (each a JSON value, or the ApiError its parsing raised); a
    decision line without a readout is read with the server's `default_readout`."""
    errors: dict[int, ApiError] = {}
    starts: list[tuple[int, Group | list[_Open]]] = []  # by first line
    buckets: dict[tuple[str, Policy], list[_Open]] = {}
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
            starts.append((index, Group((index,), request)))
            continue
        (decision,) = request.decisions
        key = (decision.state_text, request.policy)
        bucket = buckets.get(key)
        if bucket is None:
            bucket = buckets[key] = []
            starts.append((index, bucket))
        _place(bucket, index, request, max_shared)
    groups: list[Group] = []
    for _, start in starts:
        if isinstance(start, Group):
            groups.append(start)
            continue
        groups.extend(_merged(open_group) for open_group in start)
    groups.sort(key=lambda group: group.lines[0])
    return Plan(groups, errors)


def _parse(
    line: Any, max_shared: int, default_readout: Readout
) -> DecisionRequest | SystemOneRequest:
    api = handlers.select_api(line)
    if api == "systemone":
        return parse_systemone(line, max_shared)
    if api == "chat":
        raise RequestError(
            "messages", "chat completions are not answered in JSON Lines; send each alone"
        )
    return parse_decision_body(line, max_shared, default_readout)


def _place(bucket: list[_Open], index: int, request: DecisionRequest, max_shared: int) -> None:
    """Into the first group of the bucket with room and without this decision's id."""
    (decision,) = request.decisions
    for open_group in bucket:
        if len(open_group.lines) < max_shared and decision.id not in open_group.ids:
            open_group.lines.append(index)
            open_group.ids.add(decision.id)
            open_group.request.decisions.append(decision)
            return
    shared = DecisionRequest("shared", [decision], request.policy)
    bucket.append(_Open([index], shared, {decision.id}))


def _merged(open_group: _Open) -> Group:
    request = open_group.request
    if len(open_group.lines) == 1:  # alone after all: answered as it was asked
        request = DecisionRequest("single", request.decisions, request.policy)
        return Group((open_group.lines[0],), request)
    return Group(tuple(open_group.lines), request, merged=True)
