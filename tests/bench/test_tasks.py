"""JevBench task files: the mapping onto the decision API, and the shipped smoke set."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adapter.schema import parse_decision_body
from bench.tasks import TaskFormatError, load_tasks, parse_task, parse_tasks


def task(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "id": "t1",
        "family": "policy",
        "state": "The order total is 80 EUR.",
        "question": {"type": "noul", "instructions": "Does it ship for free?"},
        "labels": ["yes", "no"],
        "expected": "yes",
    }
    raw.update(overrides)
    return raw


def test_smoke_set_covers_every_family_and_question_type() -> None:
    tasks = load_tasks()
    assert 36 <= len(tasks) <= 44
    families = {t.family for t in tasks}
    assert families == {"routing", "priority", "policy", "score"}
    assert {t.question_type for t in tasks} == {"noul", "choice", "score"}
    for family in families:
        assert sum(t.family == family for t in tasks) >= 8
    for one in tasks:
        # Every body passes the server's own validation, and the expected label is an option.
        request = parse_decision_body(one.body(), max_shared=1)
        assert request.mode == "single"
        assert one.expected in request.decisions[0].option_ids


def test_noul_maps_to_yes_no_with_criteria_descriptions() -> None:
    criteria = {"true": "Free shipping applies.", "false": "Shipping is charged."}
    parsed = parse_task(
        task(question={"type": "noul", "instructions": "Free?", "criteria": criteria})
    )
    assert parsed.body()["decision"]["options"] == [
        {"id": "yes", "description": "Free shipping applies."},
        {"id": "no", "description": "Shipping is charged."},
    ]
    assert parsed.body()["decision"]["question"] == "Free?"
    bare = parse_task(task())
    assert [o.id for o in bare.decision.options] == ["yes", "no"]


def test_choice_keeps_key_order_and_null_descriptions_use_the_key() -> None:
    criteria = {"sales": "Sales team.", "billing": None, "support": "Support."}
    parsed = parse_task(
        task(
            question={"type": "choice", "instructions": "Which team?", "criteria": criteria},
            labels=["billing", "sales", "support"],
            expected="billing",
        )
    )
    assert parsed.labels == ("sales", "billing", "support")
    assert parsed.decision.options[1].description == "billing"


def test_score_maps_to_ordered_levels() -> None:
    levels = ["None.", "Some.", "A lot."]
    parsed = parse_task(
        task(
            state={"ticket": 7, "text": "It is broken."},
            question={"type": "score", "instructions": "How bad?", "criteria": levels},
            labels=["0", "1", "2"],
            expected="2",
        )
    )
    assert [(o.id, o.description) for o in parsed.decision.options] == [
        ("0", "None."),
        ("1", "Some."),
        ("2", "A lot."),
    ]
    assert parsed.body()["decision"]["state"] == {"ticket": 7, "text": "It is broken."}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"labels": ["true", "false"]}, "labels"),
        ({"expected": "maybe"}, "expected"),
        ({"question": {"type": "rank", "instructions": "?"}}, "type"),
        ({"question": {"type": "noul"}}, "question"),
        ({"state": ""}, "state"),
        ({"question": {"type": "score", "instructions": "?", "criteria": ["only one"]}}, "2..10"),
    ],
)
def test_format_errors_name_file_and_line(overrides: dict[str, Any], message: str) -> None:
    lines = [json.dumps(task(id="ok")), "", json.dumps(task(**overrides))]
    with pytest.raises(TaskFormatError, match=rf"^tasks\.jsonl:3: .*{message}"):
        parse_tasks(lines, "tasks.jsonl")


def test_duplicate_ids_and_empty_files_are_rejected() -> None:
    with pytest.raises(TaskFormatError, match="duplicate task id"):
        parse_tasks([json.dumps(task()), json.dumps(task())], "f")
    with pytest.raises(TaskFormatError, match="no tasks"):
        parse_tasks(["", "  "], "f")
