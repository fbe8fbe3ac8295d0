"""Field validators shared by every request schema (decision, System One, chat).

One rule, one wording: each validator raises `shape_error` (the format's "wrong shape"
error: 400 for the decision API, 422 for System One) when a value has the wrong JSON type,
and `RequestError` (400) when it has the right type but breaks a rule. Every message starts
with the JSON path of the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence, Sized
from typing import Any

from adapter.errors import RequestError

JsonState = str | dict[str, Any] | list[Any]
ShapeError = type[RequestError]
_SIMPLE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
MAX_KEY_ECHO = 64  # characters of a key an error message repeats


def shown(value: Any) -> str:
    """A request's value as an error message repeats it: JSON, ASCII-escaped, and a string
    longer than MAX_KEY_ECHO characters cut there with its length named, so an error never
    echoes a huge value back (a 500 KB key or enum value is not a 1 MB answer)."""
    if isinstance(value, str) and len(value) > MAX_KEY_ECHO:
        return f'{json.dumps(value[:MAX_KEY_ECHO])[:-1]}..." ({len(value)} characters)'
    text = json.dumps(value)
    return (
        text if len(text) <= MAX_KEY_ECHO else f"{text[:MAX_KEY_ECHO]}... ({len(text)} characters)"
    )


def member_path(parent: str, key: str) -> str:
    """The JSON path of `key` in the object at `parent` ("" is the body itself):
    `decision.state` for plain keys, `body[""]` or `questions["a b"]` (JSON-quoted,
    ASCII-escaped) for any other, so a path is never empty and never ambiguous; a long key
    is cut (`shown`)."""
    if _SIMPLE_KEY.match(key) and len(key) <= MAX_KEY_ECHO:
        return f"{parent}.{key}" if parent else key
    return f"{parent or 'body'}[{shown(key)}]"


def one_of(
    value: Any, path: str, allowed: Sequence[str], shape_error: ShapeError = RequestError
) -> str:
    """One of `allowed`: a 400 naming the field and the choices for another string (cut,
    `shown`), and `shape_error` for a value that is no string (System One answers those
    with a 422)."""
    if not isinstance(value, str):
        raise shape_error(path, "must be a string")
    if value in allowed:
        return value
    raise RequestError(path, f"{shown(value)} is not one of {', '.join(allowed)}")


def json_object(value: Any, path: str, shape_error: ShapeError = RequestError) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise shape_error(path, "must be a JSON object")
    return value


def only_fields(
    value: Mapping[str, Any],
    path: str,
    allowed: Sequence[str],
    shape_error: ShapeError = RequestError,
) -> None:
    """Refuse unknown keys: a misspelt optional field must not be silently ignored."""
    for key in value:
        if key not in allowed:
            raise shape_error(
                member_path(path, key), f"unknown field; allowed: {', '.join(allowed)}"
            )


def required(
    container: Mapping[str, Any], key: str, path: str, shape_error: ShapeError = RequestError
) -> Any:
    if key not in container:
        raise shape_error(member_path(path, key), "is required")
    return container[key]


def text(
    value: Any,
    path: str,
    *,
    max_chars: int | None = None,
    shape_error: ShapeError = RequestError,
) -> str:
    """A string that is not blank and, when `max_chars` is given, not longer than that."""
    if not isinstance(value, str):
        raise shape_error(path, "must be a string")
    if not value.strip():
        raise RequestError(path, "must not be empty")
    if max_chars is not None and len(value) > max_chars:
        raise RequestError(path, f"is {len(value)} characters; the limit is {max_chars}")
    return value


def state(value: Any, path: str, shape_error: ShapeError = RequestError) -> JsonState:
    """The evidence: a non-blank string, or a non-empty JSON object or array."""
    if not isinstance(value, str | dict | list):
        raise shape_error(path, "must be a string, a JSON object or an array")
    if not (value.strip() if isinstance(value, str) else value):
        raise RequestError(path, "must not be empty")
    return value


def count(items: Sized, path: str, low: int, high: int, what: str = "entries") -> None:
    if not low <= len(items) <= high:
        raise RequestError(path, f"has {len(items)} {what}; allowed {low}..{high}")
