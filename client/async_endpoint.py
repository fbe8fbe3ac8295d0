"""`semif batch async` and `DecisionClient.batch_async`: a JSON Lines file through
SageMaker's asynchronous endpoint (docs/deploy.md, "Offline batches").

The file is uploaded to the stack's async input prefix, InvokeEndpointAsync queues it
(SageMaker starts an instance if it scaled to zero), and the answer object is downloaded
when it appears (or the failure object read); the answers are summarised like every batch's.

It sits below the client rather than beside the transform jobs (client.batch_aws) because
`DecisionClient.batch_async` runs it: the client imports it, and it imports nothing of the
client or of the batch paths above it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from client.aws import INVOCATIONS_TIMEOUT_S, split_s3_uri
from client.errors import BatchInputError, EndpointError
from client.summary import Summary, count_statuses
from client.wire import JSON_LINES


def run_async(
    runtime: Any,
    s3: Any,
    *,
    endpoint_name: str,
    source: Path,
    input_prefix: str,
    out: Path,
    timeout_s: float = 3600.0,
    poll_s: float = 10.0,
    progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Summary:
    """Upload `source`, queue it on the asynchronous endpoint, wait for its answer and
    write it to `out` (through a temporary file and a rename)."""
    from botocore.exceptions import ClientError

    try:
        data = source.read_bytes()
    except OSError as error:
        raise BatchInputError(f"cannot read {source}: {error.strerror or error}") from None
    if not data.strip():
        raise BatchInputError(f"{source} holds no lines")
    bucket, prefix = split_s3_uri(input_prefix)
    key = f"{prefix.rstrip('/')}/{source.stem}-{hashlib.sha256(data).hexdigest()[:16]}.jsonl"
    key = key.lstrip("/")
    s3.put_object(Bucket=bucket, Key=key, Body=data, ContentType=JSON_LINES)
    started = time.monotonic()
    queued = runtime.invoke_endpoint_async(
        EndpointName=endpoint_name,
        InputLocation=f"s3://{bucket}/{key}",
        ContentType=JSON_LINES,
        Accept=JSON_LINES,
        InvocationTimeoutSeconds=int(min(timeout_s, INVOCATIONS_TIMEOUT_S)),
    )
    answer_at = split_s3_uri(queued["OutputLocation"])
    failure = queued.get("FailureLocation")
    failure_at = split_s3_uri(failure) if failure else None
    while True:
        for where, failed in ((answer_at, False), (failure_at, True)):
            if where is None:
                continue
            try:
                body = s3.get_object(Bucket=where[0], Key=where[1])["Body"].read()
            except ClientError:
                continue
            if failed:
                raise EndpointError(0, f"{endpoint_name} failed the batch: {body[:500]!r}")
            temporary = out.with_name(out.name + ".tmp")
            temporary.write_bytes(body)
            temporary.replace(out)
            statuses = count_statuses(body.splitlines())
            seconds = time.monotonic() - started
            return Summary(sum(statuses.values()), dict(statuses), seconds, 0)
        elapsed = time.monotonic() - started
        if elapsed >= timeout_s:
            raise EndpointError(0, f"{endpoint_name}: no answer after {timeout_s:.0f} s")
        if progress is not None:
            progress(
                f"{endpoint_name}: queued as {queued.get('InferenceId', '?')} ({elapsed:.0f} s)"
            )
        sleep(poll_s)
