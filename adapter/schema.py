"""The decision request schema (drop-in for the AWS SemIf sample) and its validation.

Every rule violation raises RequestError with the JSON path of the offending field and the
rule it broke, e.g. `decision.options[2].id: duplicate "billing"`, so callers can fix a
request without reading server logs. The field rules themselves live in `adapter.fields`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from adapter import fields
from adapter.errors import RequestError
from adapter.fields import JsonState

MIN_OPTIONS = 2
MAX_OPTIONS = 16
MAX_ID_CHARS = 256
Mode = Literal["single", "shared"]


@dataclass(frozen=True)
class Option:
    id: str
    description: str


@dataclass(frozen=True)
class Decision:
    """One question about a state, with the options the application allows."""

    id: str
    state: JsonState
    question: str
    options: tuple[Option, ...]

    @property
    def state_text(self) -> str:
        """The state as the model reads it: strings verbatim, JSON compactly and key-ordered
        as sent, so equal states always render to equal prompt prefixes."""
        if isinstance(self.state, str):
            return self.state
        return json.dumps(self.state, ensure_ascii=False)

    @property
    def option_ids(self) -> list[str]:
        return [option.id for option in self.options]


def _options(container: dict[str, Any], path: str) -> tuple[Option, ...]:
    options_path = f"{path}.options"
    raw = fields.required(container, "options", path)
    if not isinstance(raw, list):
        raise RequestError(options_path, "must be an array")
    fields.count(raw, options_path, MIN_OPTIONS, MAX_OPTIONS, "options")
    options: list[Option] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        item_path = f"{options_path}[{index}]"
        entry = fields.json_object(item, item_path)
        fields.only_fields(entry, item_path, ("id", "description"))
        id_path = f"{item_path}.id"
        option_id = fields.text(
            fields.required(entry, "id", item_path), id_path, max_chars=MAX_ID_CHARS
        )
        if option_id in seen:
            raise RequestError(id_path, f"duplicate {json.dumps(option_id)}")
        seen.add(option_id)
        description = fields.required(entry, "description", item_path)
        options.append(Option(option_id, fields.text(description, f"{item_path}.description")))
    return tuple(options)


def parse_decision(value: Any, path: str) -> Decision:
    """Validate one decision object found at `path`."""
    entry = fields.json_object(value, path)
    fields.only_fields(entry, path, ("id", "state", "question", "options"))
    return Decision(
        id=fields.text(fields.required(entry, "id", path), f"{path}.id", max_chars=MAX_ID_CHARS),
        state=fields.state(fields.required(entry, "state", path), f"{path}.state"),
        question=fields.text(fields.required(entry, "question", path), f"{path}.question"),
        options=_options(entry, path),
    )


def parse_decisions(value: Any, max_shared: int) -> list[Decision]:
    """Validate a shared-state batch: 1..max_shared decisions, one state, unique ids."""
    if not isinstance(value, list) or not value:
        raise RequestError("decisions", "must be a non-empty array")
    if len(value) > max_shared:
        raise RequestError(
            "decisions",
            f"has {len(value)} decisions; the limit is {max_shared} (SEMIF_MAX_SHARED_DECISIONS)",
        )
    decisions = [parse_decision(item, f"decisions[{index}]") for index, item in enumerate(value)]
    first = decisions[0]
    seen: set[str] = set()
    for index, decision in enumerate(decisions):
        if decision.id in seen:
            raise RequestError(f"decisions[{index}].id", f"duplicate {json.dumps(decision.id)}")
        seen.add(decision.id)
        if decision.state_text != first.state_text:
            raise RequestError(
                f"decisions[{index}].state", "must be exactly equal to decisions[0].state"
            )
    return decisions


def parse_decision_request(body: Any, max_shared: int) -> tuple[Mode, list[Decision]]:
    """Return ("single", [d]) or ("shared", [d, ...]) for a decision API body."""
    entry = fields.json_object(body, "body")
    has_single, has_shared = "decision" in entry, "decisions" in entry
    if has_single == has_shared:
        raise RequestError("body", 'give exactly one of "decision" or "decisions"')
    fields.only_fields(entry, "body", ("decision",) if has_single else ("decisions",))
    if has_single:
        return "single", [parse_decision(entry["decision"], "decision")]
    return "shared", parse_decisions(entry["decisions"], max_shared)
