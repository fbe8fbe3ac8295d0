"""Post-deploy check: invoke the endpoint once and fail the deploy unless it answers right.

A CloudFormation custom resource (CDK Provider framework, `on_event` only) created after the
endpoint is InService, and updated whenever the endpoint's config changes. Create/Update
sends the request in the resource's `Body` property through `sagemaker-runtime`
InvokeEndpoint (the same files `semif check` sends, `client/examples/check-*.json`):

- `decision`: one decision; the answer must carry its id and option ids and probabilities
  that form a distribution;
- `chat`: one short chat completion; the answer must carry a message.

A wrong answer, or an endpoint error (the container's status and body from ModelError),
raises, so CloudFormation fails the resource and rolls the stack back. Busy (503),
throttled or not-yet-ready answers are retried until shortly before the Lambda's timeout.
During an update rollback (the stack is UPDATE_ROLLBACK_IN_PROGRESS) a failure is logged but
not raised: the rollback returns to the previous endpoint config, and failing there would
leave the stack in UPDATE_ROLLBACK_FAILED. Delete does nothing.

stdlib + boto3 only (the Lambda runtime provides boto3).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

RETRYABLE_CODES = {
    "ThrottlingException",
    "ServiceUnavailable",
    "InternalFailure",
    "ModelNotReadyException",
}
RETRYABLE_MODEL_STATUS = {429, 503}
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 70  # above SageMaker's 60 s invocation limit
# Another attempt starts only if a worst-case one (connect + read) still ends before the
# Lambda's timeout, so the handler always answers CloudFormation itself.
SAFETY_MARGIN_S = float(CONNECT_TIMEOUT_S + READ_TIMEOUT_S + 10)
ROLLBACK_STATUSES = {"UPDATE_ROLLBACK_IN_PROGRESS", "ROLLBACK_IN_PROGRESS"}


class CheckFailedError(RuntimeError):
    """The endpoint did not answer the probe correctly; CloudFormation shows this reason."""


class _RetryError(Exception):
    """An answer worth asking again (busy, throttled, not ready)."""


def check_decision(body: Mapping[str, Any], answer: Any) -> str:
    """The answer must be a distribution over exactly the decision's option ids."""
    result = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(result, dict):
        raise CheckFailedError(f"decision answer has no 'result': {str(answer)[:300]}")
    decision = body["decision"]
    expected = [option["id"] for option in decision["options"]]
    if result.get("id") != decision["id"] or result.get("option_ids") != expected:
        raise CheckFailedError(f"decision answer does not match the request: {str(result)[:300]}")
    try:
        probabilities = [float(p) for p in result.get("probabilities", [])]
    except (TypeError, ValueError):
        raise CheckFailedError(f"probabilities are not numbers: {str(result)[:300]}") from None
    valid = (
        len(probabilities) == len(expected)
        and all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in probabilities)
        and math.isclose(sum(probabilities), 1.0, abs_tol=1e-3)
    )
    if not valid:
        raise CheckFailedError(f"probabilities {probabilities} are not a distribution")
    return "decision " + ", ".join(
        f"{o}={p:.3f}" for o, p in zip(expected, probabilities, strict=True)
    )


def check_chat(body: Mapping[str, Any], answer: Any) -> str:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise CheckFailedError(f"chat answer has no message content: {str(answer)[:300]}")
    return f"chat reply {content.strip()[:40]!r}"


PROBES: dict[str, Callable[[Mapping[str, Any], Any], str]] = {
    "decision": check_decision,
    "chat": check_chat,
}


def _runtime() -> Any:
    config = Config(
        retries={"max_attempts": 1, "mode": "standard"},
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
    )
    return boto3.client("sagemaker-runtime", config=config)


def invoke_once(runtime: Any, endpoint: str, body: Mapping[str, Any]) -> Any:
    """One InvokeEndpoint; `_RetryError` for answers worth retrying, CheckFailedError otherwise."""
    try:
        answer = runtime.invoke_endpoint(
            EndpointName=endpoint,
            ContentType="application/json",
            Accept="application/json",
            Body=json.dumps(body).encode(),
        )
    except ClientError as error:
        response = error.response
        code = str(response.get("Error", {}).get("Code", ""))
        message = str(response.get("Error", {}).get("Message", ""))
        status = response.get("OriginalStatusCode")
        if code in RETRYABLE_CODES or (code == "ModelError" and status in RETRYABLE_MODEL_STATUS):
            raise _RetryError(f"{code} {status or ''}: {message}") from None
        detail = f" (container status {status})" if status is not None else ""
        raise CheckFailedError(
            f"{endpoint} answered {code}{detail}: {message[:500]}"
            + (f" log: {response['LogStreamArn']}" if response.get("LogStreamArn") else "")
        ) from None
    except BotoCoreError as error:
        raise _RetryError(str(error)) from None
    raw = answer["Body"].read()
    try:
        return json.loads(raw)
    except ValueError:
        raise CheckFailedError(f"{endpoint} answered non-JSON: {raw[:300]!r}") from None


def probe(
    runtime: Any,
    endpoint: str,
    kind: str,
    body: Mapping[str, Any],
    remaining_s: Callable[[], float],
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Send `body` and check the answer as `kind` asks, retrying busy answers while time
    remains; the summary."""
    if kind not in PROBES:
        raise CheckFailedError(f"unknown probe {kind!r}; choose one of {sorted(PROBES)}")
    check = PROBES[kind]
    delay = 2.0
    while True:
        try:
            return check(body, invoke_once(runtime, endpoint, body))
        except _RetryError as busy:
            if remaining_s() < delay + SAFETY_MARGIN_S:
                raise CheckFailedError(f"{endpoint} still not answering: {busy}") from None
            LOG.info("retrying in %.0f s: %s", delay, busy)
            sleep(delay)
            delay = min(delay * 2, 30.0)


def rolling_back(cloudformation: Any, stack_id: str) -> bool:
    stacks = cloudformation.describe_stacks(StackName=stack_id).get("Stacks", [])
    return bool(stacks) and stacks[0].get("StackStatus") in ROLLBACK_STATUSES


def on_event(
    event: Mapping[str, Any],
    context: Any,
    runtime: Any = None,
    cloudformation: Any = None,
) -> dict[str, Any]:
    props = event["ResourceProperties"]
    endpoint = str(props["EndpointName"])
    physical_id = event.get("PhysicalResourceId") or f"check:{endpoint}"
    if event["RequestType"] == "Delete":
        return {"PhysicalResourceId": physical_id}

    def remaining_s() -> float:
        return float(context.get_remaining_time_in_millis()) / 1000.0

    try:
        body = json.loads(str(props["Body"]))
        summary = probe(runtime or _runtime(), endpoint, str(props["Probe"]), body, remaining_s)
    except Exception as failure:  # any failure: a rollback must never be the one that fails
        if event["RequestType"] == "Update" and rolling_back(
            cloudformation or boto3.client("cloudformation"), str(event["StackId"])
        ):
            LOG.warning("check failed during rollback, not failing the rollback: %s", failure)
            return {"PhysicalResourceId": physical_id, "Data": {"Result": f"rollback: {failure}"}}
        raise
    LOG.info("%s answered: %s", endpoint, summary)
    return {"PhysicalResourceId": physical_id, "Data": {"Result": summary}}
