"""Which API a body is for: the names every layer labels calls with, and the one rule that
reads a body's distinguishing field.

`/invocations` answers three APIs, told apart by the body's own field, so the reference
sample's decision bodies work unchanged. This small module sits below the handlers (which
map each name to its function, adapter.handlers.BY_API) and the JSON Lines planner (which
refuses chat lines), so neither needs the other, and the planner stays free of the model.
Pure.
"""

from __future__ import annotations

from typing import Any, Literal

Api = Literal["decision", "systemone", "chat"]
APIS: tuple[Api, ...] = ("decision", "systemone", "chat")
# The field that names a body's API; the decision API is the default.
API_BY_FIELD: dict[str, Api] = {"questions": "systemone", "messages": "chat"}


def select_api(body: Any) -> Api:
    """The API a body is for (its name labels the log line and the metrics)."""
    if isinstance(body, dict):
        for key, api in API_BY_FIELD.items():
            if key in body:
                return api
    return "decision"
