"""JevBench task files: parse each line and map it onto the decision API.

A JevBench task asks one System One question (`noul`, `choice` or `score`) about a state
and names the label it expects. The decision API takes options, so the mapping is fixed
here, once, for every runner and report: noul -> options `yes`/`no`, choice -> the criteria
keys in order, score -> the ordered levels `0`..`N-1`. The task's `labels` must name exactly
the options the mapping produces; otherwise no answer could ever be valid and the file is
rejected with its line number instead of silently scoring zero.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from adapter.errors import RequestError
from adapter.schema import Decision, Option, parse_decision
from adapter.systemone import question_options

SMOKE_TASKS = Path(__file__).resolve().parent / "tasks" / "smoke.jsonl"
NOUL_LABELS = {"true": "yes", "false": "no"}  # JevBench labels noul answers yes/no
# The question types a task may have: one expected answer each.
TaskKind = Literal["noul", "choice", "score"]
TASK_KINDS: tuple[TaskKind, ...] = ("noul", "choice", "score")


class Identified(Protocol):
    """What `parse_lines` needs of a parsed line: an id unique in its file."""

    @property
    def id(self) -> str: ...


Item = TypeVar("Item", bound=Identified)


class TaskFormatError(ValueError):
    """A task line does not follow the JevBench format; the message names file and line."""


@dataclass(frozen=True)
class Task:
    """One benchmark decision and the label a correct answer puts first."""

    id: str
    family: str
    question_type: TaskKind
    decision: Decision
    expected: str

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(self.decision.option_ids)

    def body(self) -> dict[str, Any]:
        return single_body(self.decision)


def decision_json(decision: Decision) -> dict[str, Any]:
    """A decision as the API receives it (the inverse of adapter.schema.parse_decision)."""
    kind = {} if decision.kind == "choice" else {"kind": decision.kind}
    return {
        "id": decision.id,
        "state": decision.state,
        "question": decision.question,
        "options": [option_json(option) for option in decision.options],
        **kind,
    }


def option_json(option: Option) -> dict[str, Any]:
    """An option as the API receives it; `label` and `threshold` only where it has them."""
    named: dict[str, Any] = {} if option.label is None else {"label": option.label}
    if option.threshold is not None:
        named["threshold"] = option.threshold
    return {"id": option.id, "description": option.description, **named}


def single_body(decision: Decision) -> dict[str, Any]:
    """The /invocations body for one decision."""
    return {"decision": decision_json(decision)}


def shared_body(decisions: Sequence[Decision]) -> dict[str, Any]:
    """The /invocations body for decisions about one state, scored together."""
    return {"decisions": [decision_json(decision) for decision in decisions]}


def parse_task(raw: Any) -> Task:
    """Map one parsed JSON line to a Task; ValueError says which rule it broke."""
    if not isinstance(raw, Mapping):
        raise ValueError("a task must be a JSON object")
    missing = [key for key in ("id", "state", "question", "labels", "expected") if key not in raw]
    if missing:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    question = raw["question"]
    if not isinstance(question, Mapping) or question.get("type") not in TASK_KINDS:
        raise ValueError('question must be an object with type "noul", "choice" or "score"')
    question_type: TaskKind = question["type"]
    try:  # System One's translation of the same question object, then the decision rules
        options = question_options(question_type, question.get("criteria"), "question.criteria")
        if question_type == "noul":
            options = tuple(Option(NOUL_LABELS[o.id], o.description) for o in options)
        candidate = Decision(
            id=str(raw["id"]),
            state=raw["state"],
            question=question.get("instructions", ""),
            options=options,
        )
        decision = parse_decision(decision_json(candidate), "task")
    except RequestError as error:
        raise ValueError(str(error)) from None
    labels = raw["labels"]
    if not isinstance(labels, list) or sorted(map(str, labels)) != sorted(decision.option_ids):
        raise ValueError(
            f"labels {labels} must be exactly the {question_type} options {decision.option_ids}"
        )
    expected = str(raw["expected"])
    if expected not in decision.option_ids:
        raise ValueError(f"expected {expected!r} is not one of the labels {decision.option_ids}")
    return Task(
        id=decision.id,
        family=str(raw.get("family") or question_type),
        question_type=question_type,
        decision=decision,
        expected=expected,
    )


def parse_tasks(lines: Iterable[str], source: str) -> list[Task]:
    """Parse JevBench JSONL text (`parse_lines`' rules)."""
    return parse_lines(lines, source, parse_task, "task")


def parse_lines(
    lines: Iterable[str], source: str, parse: Callable[[Any], Item], what: str
) -> list[Item]:
    """Parse JSONL text whose lines `parse` maps to items with an id (tasks, and other
    benchmarks' cases): blank lines are skipped, ids must be unique, and a bad line is a
    TaskFormatError naming the file and line, so a hand-written file is fixed at once."""
    items: list[Item] = []
    seen: set[str] = set()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = parse(json.loads(line))
        except ValueError as error:
            raise TaskFormatError(f"{source}:{number}: {error}") from None
        if item.id in seen:
            raise TaskFormatError(f"{source}:{number}: duplicate {what} id {item.id!r}")
        seen.add(item.id)
        items.append(item)
    if not items:
        raise TaskFormatError(f"{source}: no {what}s")
    return items


def load_tasks(path: Path = SMOKE_TASKS) -> list[Task]:
    with path.open(encoding="utf-8") as handle:
        return parse_tasks(handle, str(path))
