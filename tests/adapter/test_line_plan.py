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
