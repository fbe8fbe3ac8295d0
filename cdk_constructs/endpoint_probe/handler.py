"""Post-deploy check: invoke the endpoint once and fail the deploy unless it answers right.

A CloudFormation custom resource (CDK Provider framework, `on_event` only) created after the
endpoint is InService, and updated whenever the endpoint's config changes. Create/Update
sends the request in the resource's `Body` property through `sagemaker-runtime`
InvokeEndpoint (the same files `semif check` sends, `client/examples/check-*.json`):

- `decision`: one decision; the answer must carry its id and option ids and probabilities
  that form a distribution;
- `chat`: one short chat completion; the answer must carry a message.

A wrong answer, or an endpoint error (the container's status and body from ModelError),
raises, so CloudFormation fails the resource and rolls the stack back. Busy (429, 503),
throttled or not-yet-ready answers are retried until shortly before the Lambda's timeout.
An endpoint whose model is an inference component (`InferenceComponentName`) is invoked
through it; at zero copies SageMaker refuses the call with a ValidationError that says the
component has no capacity, and that refusal is what starts a copy, so it is retried too.

After a right decision answer, the check waits up to `SeriesWaitSeconds` for the
endpoint's container series (`semif_requests_total`, what its PromQL alarms read) to reach
CloudWatch, through CloudWatch's Prometheus-compatible GetSeries API (botocore has no call
for it: SigV4 for `monitoring`, IAM `cloudwatch:ListMetrics`). Absent series are a warning
in the result and the log, never a failure: a PromQL alarm that matches nothing stays OK
forever, and the warning names the query and the alarms (`PromQLAlarms`). The shell's
`semif check` does the same (client/series_check.py, held to the same queries and words by
the tests).
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
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

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
# InvokeEndpoint's ValidationError for an inference component with no copy: "Inference
# Component has no capacity to process this request. ApplicationAutoScaling may be
# in-progress ..."; the refusal itself starts one (NoCapacityInvocationFailures).
NO_CAPACITY = "no capacity"
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 70  # above SageMaker's 60 s invocation limit
# Another attempt starts only if a worst-case one (connect + read) still ends before the
# Lambda's timeout, so the handler always answers CloudFormation itself.
SAFETY_MARGIN_S = float(CONNECT_TIMEOUT_S + READ_TIMEOUT_S + 10)
ROLLBACK_STATUSES = {"UPDATE_ROLLBACK_IN_PROGRESS", "ROLLBACK_IN_PROGRESS"}
# The container series the decision endpoint's PromQL alarms read; then the name the
# OpenTelemetry conversion would give that counter (client/series_check.py: the same).
SERIES = ("semif_requests_total", "semif_requests")
ENDPOINT_LABEL = "aws.sagemaker.endpoint.name"
LOOKBACK_S = 3600
SERIES_POLL_S = 20.0
SERIES_CALL_TIMEOUT_S = 10
SERIES_MARGIN_S = 3 * SERIES_CALL_TIMEOUT_S  # the last polls must end before the Lambda


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


def invoke_once(
    runtime: Any, endpoint: str, body: Mapping[str, Any], *, component: str | None = None
) -> Any:
    """One InvokeEndpoint (through inference component `component` when given);
    `_RetryError` for answers worth retrying, CheckFailedError otherwise."""
    target = {"EndpointName": endpoint}
    if component is not None:
        target["InferenceComponentName"] = component
    try:
        answer = runtime.invoke_endpoint(
            **target,
            ContentType="application/json",
            Accept="application/json",
            Body=json.dumps(body).encode(),
        )
    except ClientError as error:
        response = error.response
        code = str(response.get("Error", {}).get("Code", ""))
        message = str(response.get("Error", {}).get("Message", ""))
        status = response.get("OriginalStatusCode")
        waking = component is not None and code == "ValidationError" and NO_CAPACITY in message
        if (
            code in RETRYABLE_CODES
            or (code == "ModelError" and status in RETRYABLE_MODEL_STATUS)
            or waking
        ):
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
    *,
    component: str | None = None,
) -> str:
    """Send `body` (through inference component `component` when given) and check the
    answer as `kind` asks, retrying busy answers while time remains; the summary."""
    if kind not in PROBES:
        raise CheckFailedError(f"unknown probe {kind!r}; choose one of {sorted(PROBES)}")
    check = PROBES[kind]
    delay = 2.0
    while True:
        try:
            return check(body, invoke_once(runtime, endpoint, body, component=component))
        except _RetryError as busy:
            if remaining_s() < delay + SAFETY_MARGIN_S:
                raise CheckFailedError(f"{endpoint} still not answering: {busy}") from None
            LOG.info("retrying in %.0f s: %s", delay, busy)
            sleep(delay)
            delay = min(delay * 2, 30.0)


def series_query(metric: str, endpoint_name: str) -> str:
    return f'{metric}{{"{ENDPOINT_LABEL}"="{endpoint_name}"}}'


def series_form(query: str, start: float, end: float) -> bytes:
    fields = [("match[]", query), ("start", str(int(start))), ("end", str(int(end)))]
    return urlencode([*fields, ("limit", "1")]).encode()


def absent_warning(endpoint_name: str, alarms: Sequence[str], waited_s: float, found: str) -> str:
    query = series_query(SERIES[0], endpoint_name)
    named = ", ".join(alarms) if alarms else "none found"
    other = (
        f"; {found} is there, so the alarms' metric names are not what CloudWatch publishes"
        if found
        else ""
    )
    return (
        f"no {SERIES[0]} series for {endpoint_name} in CloudWatch {waited_s:.0f} s after its "
        f"first call{other}: its PromQL alarms ({named}) may watch nothing and stay OK. "
        f"Check in CloudWatch Query Studio (PromQL): {query}"
    )


def count_series(query: str, start: float, end: float) -> int:
    """GetSeries, signed with the function's credentials: how many series match."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest

    session = boto3.session.Session()
    url = session.client("cloudwatch").meta.endpoint_url + "/api/v1/series"
    body = series_form(query, start, end)
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    request = AWSRequest("POST", url, data=body, headers=headers)
    SigV4Auth(session.get_credentials(), "monitoring", session.region_name).add_auth(request)
    # https: the URL is botocore's own CloudWatch endpoint, not from the event.
    sent = urllib.request.Request(url, data=body, headers=dict(request.headers.items()))  # noqa: S310
    with urllib.request.urlopen(sent, timeout=SERIES_CALL_TIMEOUT_S) as answer:  # noqa: S310
        return len(json.loads(answer.read()).get("data") or [])


def series_warning(
    endpoint_name: str,
    alarms: Sequence[str],
    first_call_at: float,
    wait_s: float,
    remaining_s: Callable[[], float],
    count: Callable[[str, float, float], int] = count_series,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """None once the alarms' series are in CloudWatch; else the warning (also when they
    cannot be read). Waits at most `wait_s` after the first call, and never past the
    function's own time."""
    try:
        deadline = min(first_call_at + wait_s, clock() + remaining_s() - SERIES_MARGIN_S)
        while True:
            now = clock()
            if count(series_query(SERIES[0], endpoint_name), now - LOOKBACK_S, now):
                return None
            if now >= deadline:
                found = [
                    name
                    for name in SERIES[1:]
                    if count(series_query(name, endpoint_name), now - LOOKBACK_S, now)
                ]
                waited = now - first_call_at
                return absent_warning(endpoint_name, alarms, waited, ", ".join(found))
            sleep(min(SERIES_POLL_S, deadline - now))
    except Exception as error:  # a warning is all this may ever be
        query = series_query(SERIES[0], endpoint_name)
        return (
            f"could not read {endpoint_name}'s container series ({error}); check in "
            f"CloudWatch Query Studio (PromQL): {query}"
        )


def rolling_back(cloudformation: Any, stack_id: str) -> bool:
    stacks = cloudformation.describe_stacks(StackName=stack_id).get("Stacks", [])
    return bool(stacks) and stacks[0].get("StackStatus") in ROLLBACK_STATUSES


def on_event(
    event: Mapping[str, Any],
    context: Any,
    runtime: Any = None,
    cloudformation: Any = None,
    series: Callable[[str, Sequence[str], float, float, Callable[[], float]], str | None]
    | None = None,
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
        first_call_at = time.time()
        component = props.get("InferenceComponentName")
        summary = probe(
            runtime or _runtime(),
            endpoint,
            str(props["Probe"]),
            body,
            remaining_s,
            component=None if component is None else str(component),
        )
    except Exception as failure:  # any failure: a rollback must never be the one that fails
        if event["RequestType"] == "Update" and rolling_back(
            cloudformation or boto3.client("cloudformation"), str(event["StackId"])
        ):
            LOG.warning("check failed during rollback, not failing the rollback: %s", failure)
            return {"PhysicalResourceId": physical_id, "Data": {"Result": f"rollback: {failure}"}}
        raise
    LOG.info("%s answered: %s", endpoint, summary)
    wait_s = float(props.get("SeriesWaitSeconds", 0))
    if wait_s > 0:
        alarms = [str(name) for name in props.get("PromQLAlarms", [])]
        warning = (series or series_warning)(endpoint, alarms, first_call_at, wait_s, remaining_s)
        if warning is not None:
            LOG.warning("%s", warning)
            summary = f"{summary}; WARNING: {warning}"
    return {"PhysicalResourceId": physical_id, "Data": {"Result": summary}}
