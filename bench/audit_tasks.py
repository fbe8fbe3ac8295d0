"""Labelled tasks from what was served: `semif-calibrate --from-audit RECORDS --labels LABELS`.

The adapter's `full` audit records (adapter/audit.py, `SEMIF_AUDIT=full`) keep each
decision's state, question and options as sent; labels that arrive later name the right
option by the record's join key. Joined, they are tasks like a JevBench file's, and
semif-calibrate fits and reports on them exactly as on a task file: the server scores each
one again in every order the fit needs (a record's own probabilities are one reading in
one order, not enough for the prior or the held-out report).

RECORDS: a file or an `s3://bucket/key` object of lines, each holding one JSON object whose
`audit` key is a record; other lines are skipped, and anything before a line's first `{`
(a CloudWatch Logs export's timestamp) is ignored (client.audit_records reads them).
LABELS: JSON Lines of `{"decision_id", "label"}`, with `request_id` where decision ids
repeat across requests (it then must match).
A labelled record that is not `full` (no request text) or names a label that is not one of
its options is an error naming it; records without a label are left out, and counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from adapter.errors import RequestError
from adapter.schema import Decision, parse_decision
from bench.tasks import Task

# Reading records is the client's (a pipeline reads them without llama.cpp); semif-calibrate
# imports them from here beside the rest of --from-audit.
from client.audit_records import read_source as read_source
from client.audit_records import records as records


class AuditTasksError(ValueError):
    """The records or the labels cannot give tasks; the message names the line or record."""


@dataclass(frozen=True)
class AuditTasks:
    """The labelled tasks, and how many records had no label."""

    tasks: list[Task]
    unlabelled: int


def recorded_decision(request: Mapping[str, Any], name: str) -> Decision:
    """A full record's decision as it was sent (its request text), named `name`, validated
    as the server validates one (RequestError naming what is malformed)."""
    body = {key: request.get(key) for key in ("state", "question", "options")}
    return parse_decision({"id": name, **body}, name)


def read_labels(lines: Iterable[str], source: str) -> dict[tuple[str | None, str], str]:
    """(request id or None, decision id) -> label, from LABELS' JSON lines."""
    found: dict[tuple[str | None, str], str] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise AuditTasksError(f"{source}:{number}: not JSON ({error.msg})") from None
        if not isinstance(value, dict) or not all(
            isinstance(value.get(key), str) for key in ("decision_id", "label")
        ):
            raise AuditTasksError(f"{source}:{number}: needs string decision_id and label")
        request_id = value.get("request_id")
        found[(request_id if isinstance(request_id, str) else None, value["decision_id"])] = value[
            "label"
        ]
    return found


def audit_tasks(
    served: Iterable[Mapping[str, Any]], known: Mapping[tuple[str | None, str], str]
) -> AuditTasks:
    """The labelled records as tasks (a choice question each: a multi-label record is not
    one), in record order; a decision answered twice under one request id is one task."""
    tasks: dict[str, Task] = {}
    unlabelled = 0
    for record in served:
        request_id, decision_id = str(record.get("request_id")), str(record.get("decision_id"))
        label = known.get((request_id, decision_id), known.get((None, decision_id)))
        if label is None:
            unlabelled += 1
            continue
        name = f"{request_id}/{decision_id}"
        request = record.get("request")
        if not isinstance(request, dict) or record.get("kind", "choice") != "choice":
            raise AuditTasksError(
                f"record {name}: a labelled record must be a full one (SEMIF_AUDIT=full) of a "
                "choice question"
            )
        try:
            decision = recorded_decision(request, name)
        except RequestError as error:
            raise AuditTasksError(f"record {name}: its request is malformed: {error}") from None
        if label not in decision.option_ids:
            raise AuditTasksError(f"record {name}: label {label!r} is not one of its options")
        tasks[name] = Task(name, "audit", "choice", decision, label)
    return AuditTasks(list(tasks.values()), unlabelled)
