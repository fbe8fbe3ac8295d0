"""What an error answer means: an HTTP status and body, or botocore's ClientError for a
SageMaker call (a container's ModelError carries its OriginalStatusCode and
OriginalMessage), turned into the exception the client raises, with the endpoint's own
message, its retry hint and its retry token.

Both transports map answers the same way through here, so a refusal means the same over a
URL as through SageMaker; the exceptions themselves are in `client.errors`, and what to do
about a busy one is `client.retry`'s.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any

from client.errors import BusyError, EndpointError, ScaledToZeroError
from client.retry import parse_retry_after

_BUSY_AWS_ERRORS = ("ThrottlingException", "ServiceUnavailable", "ModelNotReadyException")
_RETRYABLE_STATUSES = (429, 503)
# SageMaker is not known to pass a container's headers on in a ModelError: a hint meant for
# SageMaker callers has to ride in the JSON body, under this name.
RETRY_AFTER_FIELD = "retry_after_seconds"
# A refusal's place in the endpoint's retry line: the body's `retry_token`, sent back with
# the retry (`client.wire.custom_attributes`).
RETRY_TOKEN_FIELD = "retry_token"  # noqa: S105 - names, not secrets
_RETRY_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# What SageMaker answers a call that finds an inference component with no copy (HTTP 400,
# `ValidationError`): "Inference Component has no capacity to process this request.
# ApplicationAutoScaling may be in-progress (if configured) or try to increase the capacity
# by invoking UpdateInferenceComponentRuntimeConfig API." botocore's service model does not
# list it; the text is AWS's own, quoted in its scale-to-zero post
# (https://aws.amazon.com/blogs/machine-learning/unlock-cost-savings-with-the-new-scale-down-to-zero-feature-in-amazon-sagemaker-inference/).
NO_CAPACITY_CODE = "ValidationError"
NO_CAPACITY_MESSAGE = "Inference Component has no capacity to process this request"


def _retry_after_s(header: str | None, body: Any) -> float | None:
    """The endpoint's retry hint: a valid Retry-After header, else the body's
    `retry_after_seconds` (the only hint that survives SageMaker's ModelError)."""
    parsed = None if header is None else parse_retry_after(header, time.time())
    if parsed is not None:
        return parsed
    hint = body.get(RETRY_AFTER_FIELD) if isinstance(body, dict) else None
    if isinstance(hint, bool) or not isinstance(hint, int | float) or not hint >= 0:  # NaN too
        return None
    return float(hint)


def retry_token_of(body: Any) -> str | None:
    """The refusal's place in the retry line, when the body carries a well-formed one."""
    token = body.get(RETRY_TOKEN_FIELD) if isinstance(body, dict) else None
    return token if isinstance(token, str) and _RETRY_TOKEN.fullmatch(token) else None


def error_from_answer(status: int, text: str, retry_after: str | None) -> EndpointError:
    """Keep the endpoint's own message: the `error` field of a JSON body, else the text.
    429 and 503 are busy unless the body says `"retryable": false` (an unhealthy model)."""
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    return error_from_body(status, body, retry_after, text)


def error_from_body(
    status: int, body: Any, retry_after: str | None = None, text: str | None = None
) -> EndpointError:
    """`error_from_answer` for a body already parsed: also an error line that ends a
    streamed answer part-way, which carries its status in the line (the HTTP status was
    200). `text` is the answer as sent, the message when the body names none."""
    message = body.get("error") if isinstance(body, dict) else None
    if not isinstance(message, str):
        shown = text if text is not None else json.dumps(body)
        message = shown.strip() or f"HTTP {status}"
    refused = isinstance(body, dict) and body.get("retryable") is False
    if status in _RETRYABLE_STATUSES and not refused:
        return BusyError(
            status,
            message,
            body,
            retry_after_s=_retry_after_s(retry_after, body),
            retry_token=retry_token_of(body),
        )
    return EndpointError(status, message, body)


def error_from_client_error(response: Mapping[str, Any]) -> EndpointError:
    """ModelError -> the container's own status and message; no copy of the inference
    component -> scaled to zero; throttling -> busy. A
    Retry-After on the AWS answer itself is honoured (the local serve's SageMaker route
    keeps the container's; SageMaker is not known to)."""
    code = response.get("Error", {}).get("Code", "")
    message = response.get("Error", {}).get("Message", "")
    metadata = response.get("ResponseMetadata", {})
    retry_after = metadata.get("HTTPHeaders", {}).get("retry-after")
    if code == "ModelError" and "OriginalStatusCode" in response:
        original = str(response.get("OriginalMessage", message))
        return error_from_answer(int(response["OriginalStatusCode"]), original, retry_after)
    status = int(metadata.get("HTTPStatusCode", 0))
    if code == NO_CAPACITY_CODE and NO_CAPACITY_MESSAGE in message:
        return ScaledToZeroError(
            status, f"scaled to zero, a copy is starting: {message}", dict(response)
        )
    if code in _BUSY_AWS_ERRORS:
        hint = _retry_after_s(retry_after, None)
        return BusyError(status, f"{code}: {message}", dict(response), retry_after_s=hint)
    return EndpointError(status, f"{code}: {message}", dict(response))
