"""The decision request schema (drop-in for the AWS SemIf sample) and its validation.

Every rule violation raises RequestError with the JSON path of the offending field and the
rule it broke, e.g. `decision.options[2].id: duplicate "billing"`, so callers can fix a
request without reading server logs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

MIN_OPTIONS = 2
MAX_OPTIONS = 16
MAX_ID_CHARS = 256
JsonState = str | dict[str, Any] | list[Any]
Mode = Literal["single", "shared"]


class RequestError(ValueError):
    """A request broke a schema rule; the message starts with the JSON path."""

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"{path}: {rule}")
        self.path = path


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


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise RequestError(path, "must be a JSON object")
    return value


def _reject_unknown(value: Mapping[str, Any], path: str, allowed: tuple[str, ...]) -> None:
    for key in value:
        if key not in allowed:
            raise RequestError(f"{path}.{key}", f"unknown field; allowed: {', '.join(allowed)}")


def _text(container: Mapping[str, Any], key: str, path: str, max_chars: int | None = None) -> str:
    if key not in container:
        raise RequestError(f"{path}.{key}", "is required")
    value = container[key]
    if not isinstance(value, str) or not value.strip():
        raise RequestError(f"{path}.{key}", "must be a non-empty string")
    if max_chars is not None and len(value) > max_chars:
        raise RequestError(f"{path}.{key}", f"is {len(value)} characters; the limit is {max_chars}")
    return value


def _state(container: Mapping[str, Any], path: str) -> JsonState:
    if "state" not in container:
        raise RequestError(f"{path}.state", "is required")
    state = container["state"]
    if isinstance(state, str):
        if not state.strip():
            raise RequestError(f"{path}.state", "must not be empty")
        return state
    if isinstance(state, dict | list):
        if not state:
            raise RequestError(f"{path}.state", "must not be an empty object or array")
        return state
    raise RequestError(f"{path}.state", "must be a non-empty string or a JSON object or array")


def _options(container: Mapping[str, Any], path: str) -> tuple[Option, ...]:
    options_path = f"{path}.options"
    raw = container.get("options")
    if not isinstance(raw, list):
        raise RequestError(options_path, "is required and must be an array")
    if not MIN_OPTIONS <= len(raw) <= MAX_OPTIONS:
        raise RequestError(
            options_path, f"has {len(raw)} options; allowed {MIN_OPTIONS}..{MAX_OPTIONS}"
        )
    options: list[Option] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        item_path = f"{options_path}[{index}]"
        entry = _object(item, item_path)
        _reject_unknown(entry, item_path, ("id", "description"))
        option_id = _text(entry, "id", item_path, MAX_ID_CHARS)
        if option_id in seen:
            raise RequestError(f"{item_path}.id", f"duplicate {json.dumps(option_id)}")
        seen.add(option_id)
        options.append(Option(option_id, _text(entry, "description", item_path)))
    return tuple(options)


def parse_decision(value: Any, path: str) -> Decision:
    """Validate one decision object found at `path`."""
    entry = _object(value, path)
    _reject_unknown(entry, path, ("id", "state", "question", "options"))
    return Decision(
        id=_text(entry, "id", path, MAX_ID_CHARS),
        state=_state(entry, path),
        question=_text(entry, "question", path),
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
    entry = _object(body, "body")
    has_single, has_shared = "decision" in entry, "decisions" in entry
    if has_single == has_shared:
        raise RequestError("body", 'give exactly one of "decision" or "decisions"')
    _reject_unknown(entry, "body", ("decision",) if has_single else ("decisions",))
    if has_single:
        return "single", [parse_decision(entry["decision"], "decision")]
    return "shared", parse_decisions(entry["decisions"], max_shared)
