"""What a request looks like on the wire: content types, the header and CustomAttributes
names, the prefix-aware routing id and the order of a body's keys.

Both transports and the batch paths send what this module describes, and the retry-token
names must match the server's (adapter/http.py), so they live in one place below all of
them; it imports nothing else of the client.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

JSON = "application/json"
JSON_LINES = "application/jsonlines"  # one request per line (the endpoint's offline form)
# A streamed chat's answer (Server-Sent Events, OpenAI's chunks); a streamed decision
# answer is JSON_LINES, asked for with that Accept header.
EVENT_STREAM = "text/event-stream"
# A refusal's place in the endpoint's retry line (`client.error_mapping.retry_token_of`) is
# sent back as `semif-retry-token=<token>` in InvokeEndpoint's CustomAttributes, which
# SageMaker forwards as the header below (sent as such to a URL).
RETRY_TOKEN_ATTRIBUTE = "semif-retry-token"  # noqa: S105 - a name, not a secret
CUSTOM_ATTRIBUTES_HEADER = "x-amzn-sagemaker-custom-attributes"
# SageMaker's prefix-aware routing hint (InvokeEndpoint `PrefixAwareId`): 1-64 printable
# characters, not starting with a space.
PREFIX_AWARE_ID_HEADER = "x-amzn-sagemaker-prefix-aware-id"
_PREFIX_AWARE_ID = re.compile(r"[!-~][ -~]{0,63}")
# The keys that hold a state, put first in every body (`state_first`).
_STATE_KEYS = ("decision", "decisions", "state")


def media_type(content_type: str) -> str:
    """A Content-Type's media type alone, lower case: `text/event-stream; charset=utf-8`
    -> `text/event-stream`."""
    return content_type.split(";", 1)[0].strip().lower()


def custom_attributes(retry_token: str) -> str:
    """The CustomAttributes (or header) value that hands a retry token back."""
    return f"{RETRY_TOKEN_ATTRIBUTE}={retry_token}"


def check_prefix_aware_id(value: str | None) -> str | None:
    """A prefix-aware id as SageMaker takes it, else a ValueError saying why."""
    if value is not None and not _PREFIX_AWARE_ID.fullmatch(value):
        raise ValueError(
            f"prefix_aware_id {value!r}: 1 to 64 printable ASCII characters, not starting "
            "with a space"
        )
    return value


def state_first(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body with its state first: at the top, `decision`, `decisions` or `state`, and
    inside each decision its `state`; every other key keeps its place after them. Requests
    about one state then share their leading bytes up to the end of it, whatever their ids,
    questions and options, which is what SageMaker's prefix-aware routing keys on (it reads
    the first PrefixLength bytes of the body). The endpoint accepts any key order."""

    def ordered(item: Any, first: Sequence[str]) -> Any:
        if not isinstance(item, Mapping):
            return item
        keys = [key for key in first if key in item]
        return {key: item[key] for key in (*keys, *(k for k in item if k not in first))}

    top = ordered(body, _STATE_KEYS)
    if "decision" in top:
        top["decision"] = ordered(top["decision"], ("state",))
    if isinstance(top.get("decisions"), list):
        top["decisions"] = [ordered(item, ("state",)) for item in top["decisions"]]
    return dict(top)
