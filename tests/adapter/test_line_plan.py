"""The JSON Lines planner (adapter/line_plan.py): its invariants on randomized bodies."""

from __future__ import annotations

import random
from typing import Any

import pytest

from adapter.errors import ApiError, RequestError
from adapter.line_plan import plan
from adapter.schema import DecisionRequest
from adapter.systemone import SystemOneRequest
from tests.support.serving import decision

STATES = ["alpha", "beta", {"k": 1}]


def _line(rng: random.Random) -> Any:
    roll = rng.random()
    state = rng.choice(STATES)
    if roll < 0.6:
        body: dict[str, Any] = {"decision": decision(f"id{rng.randint(0, 4)}", state)}
        if rng.random() < 0.3:
            body["min_confidence"] = 0.5
        return body
    if roll < 0.7:
        return {"decisions": [decision("a", state), decision("b", state)]}
    if roll < 0.8:
        return {
            "state": state,
            "questions": {"q": {"type": "noul", "instructions": "Is it?"}},
        }
    if roll < 0.9:
        return RequestError("body", "invalid JSON")
    return {"decision": {"id": "broken"}}


@pytest.mark.parametrize("seed", range(40))
def test_every_line_is_answered_once_and_groups_are_valid_batches(seed: int) -> None:
    rng = random.Random(seed)
    lines = [_line(rng) for _ in range(rng.randint(1, 60))]
    max_shared = rng.choice([1, 2, 3, 64])
    result = plan(lines, max_shared)
    covered = [line for group in result.groups for line in group.lines]
    assert sorted(covered + list(result.errors)) == list(range(len(lines)))
    assert [group.lines[0] for group in result.groups] == sorted(
        group.lines[0] for group in result.groups
    )
    for index in result.errors:
        assert isinstance(result.errors[index], ApiError)
    for group in result.groups:
        assert list(group.lines) == sorted(group.lines)
        request = group.request
        if isinstance(request, SystemOneRequest):
            assert len(group.lines) == 1
            assert not group.merged
            continue
        assert isinstance(request, DecisionRequest)
        if not group.merged:
            assert len(group.lines) == 1
            continue
        assert request.mode == "shared"
        assert 2 <= len(group.lines) <= max_shared
        assert len(request.decisions) == len(group.lines)
        ids = [d.id for d in request.decisions]
        assert len(set(ids)) == len(ids)
        assert len({d.state_text for d in request.decisions}) == 1
        for line, asked in zip(group.lines, request.decisions, strict=True):
            assert lines[line]["decision"]["id"] == asked.id
            assert lines[line].get("min_confidence") == request.policy.min_confidence


def test_singles_about_one_state_merge_across_the_body() -> None:
    lines = [
        {"decision": decision("a", "s")},
        {"decision": decision("b", "t")},
        {"decision": decision("c", "s")},
    ]
    result = plan(lines, 64)
    assert [(group.lines, group.merged) for group in result.groups] == [
        ((0, 2), True),
        ((1,), False),
    ]
    assert result.groups[1].request.mode == "single"  # type: ignore[union-attr]


def test_chat_lines_are_refused_by_name() -> None:
    result = plan([{"messages": []}], 64)
    assert result.errors[0].body()["field"] == "messages"


def _first_fit(lines: list[Any], max_shared: int) -> list[tuple[int, ...]]:
    """The placement rule written plainly (quadratic): each single decision into the first
    group of its state and policy with room and without its id."""
    groups: list[tuple[tuple[Any, ...], list[int], set[str]]] = []
    for index, line in enumerate(lines):
        request = line["decision"]
        key = (repr(request["state"]), line.get("min_confidence"))
        for group_key, members, ids in groups:
            if group_key == key and len(members) < max_shared and request["id"] not in ids:
                members.append(index)
                ids.add(request["id"])
                break
        else:
            groups.append((key, [index], {request["id"]}))
    return sorted(tuple(members) for _, members, _ in groups)


@pytest.mark.parametrize("seed", range(30))
def test_placement_is_first_fit(seed: int) -> None:
    rng = random.Random(seed)
    lines: list[Any] = []
    for _ in range(rng.randint(1, 200)):
        body: dict[str, Any] = {
            "decision": decision(f"id{rng.randint(0, rng.choice([1, 3, 20]))}", rng.choice(STATES))
        }
        if rng.random() < 0.2:
            body["min_confidence"] = 0.5
        lines.append(body)
    max_shared = rng.choice([1, 2, 3, 5, 64])
    planned = sorted(group.lines for group in plan(lines, max_shared).groups)
    assert planned == _first_fit(lines, max_shared)


def test_identical_lines_each_get_a_group_of_their_own() -> None:
    """20,000 copies of one decision (one id) cannot share a batch: 20,000 groups, planned
    without scanning every earlier group per line (the old planner took 31.9 s here)."""
    lines = [{"decision": decision("same", "s")}] * 20_000
    result = plan(lines, 64)
    assert [group.lines for group in result.groups] == [(index,) for index in range(20_000)]


def test_a_merged_group_splits_into_halves_in_line_order() -> None:
    lines = [{"decision": decision(f"d{index}", "s")} for index in range(5)]
    (group,) = plan(lines, 64).groups
    first, second = group.halves()
    assert (first.lines, first.merged) == ((0, 1), True)
    assert (second.lines, second.merged) == ((2, 3, 4), True)
    assert [d.id for d in second.request.decisions] == ["d2", "d3", "d4"]  # type: ignore[union-attr]
    single, other = first.halves()
    assert other.lines == (1,)
    assert (single.lines, single.merged) == ((0,), False)
    assert single.request.mode == "single"  # type: ignore[union-attr]
