"""`semif batch submit` and `semif batch async`: JSON Lines files through SageMaker's two
offline paths (docs/deploy.md, "Offline batches").

- A **batch transform job** on the deployed decision model: every object under an S3 input
  prefix, split into lines (SplitType `Line`), sent as mini-batches (`MultiRecord`), the
  answers assembled by line (AssembleWith `Line`) into `<object>.out` under the output
  prefix, encrypted with the environment's key. N instances split the objects between
  them. The input prefix is listed before the job is created: an empty or unreadable one
  fails here, with the reason, instead of as a failed job minutes later.
- An **asynchronous endpoint**: the file is uploaded to the stack's async input prefix,
  InvokeEndpointAsync queues it (SageMaker starts an instance if it scaled to zero), and the
  answer object is downloaded when it appears (or the failure object read).

Both summarise the answers: lines, errors by status, time, and for a transform job the
cost at the hourly price given.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from client.batch_local import BatchInputError, Summary
from client.decision_client import JSON_LINES, EndpointError

# A mini-batch may take long on CPU: SageMaker's longest invocation timeout.
INVOCATIONS_TIMEOUT_S = 3600
MAX_PAYLOAD_MB = 6  # the container's own choice (adapter/lines.py, /execution-parameters)
_JOB_DONE = ("Completed", "Failed", "Stopped")


def aws_client(service: str, region: str | None) -> Any:
    """A boto3 client with botocore's own retries (control-plane and S3 calls here are
    cheap to repeat, unlike an invocation under the client's retry policy)."""
    import boto3

    return boto3.client(service, region_name=region)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key or prefix) of an s3:// URI, else a BatchInputError naming it."""
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise BatchInputError(f"{uri!r} is not an s3://bucket/prefix URI")
    return bucket, key


def count_statuses(lines: Iterable[bytes | str]) -> Counter[int]:
    """Answer lines by status (an answer without one is a 200)."""
    statuses: Counter[int] = Counter()
    for line in lines:
        if line.strip():
            answer = json.loads(line)
            statuses[int(answer.get("status", 200)) if isinstance(answer, dict) else 0] += 1
    return statuses


def input_objects(s3: Any, uri: str) -> list[tuple[str, int]]:
    """The (key, size) of every object under `uri`; an empty or unreadable prefix is a
    BatchInputError that says which and why."""
    from botocore.exceptions import ClientError

    bucket, prefix = split_s3_uri(uri)
    found: list[tuple[str, int]] = []
    try:
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found += [(item["Key"], int(item["Size"])) for item in page.get("Contents", [])]
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "error")
        raise BatchInputError(f"cannot list {uri}: {code}") from None
    found = [(key, size) for key, size in found if size > 0 and not key.endswith("/")]
    if not found:
        raise BatchInputError(f"{uri} holds no objects to transform")
    return found


@dataclass(frozen=True)
class TransformJob:
    """What `semif batch submit` asks SageMaker for."""

    model_name: str
    input_uri: str
    output_uri: str
    kms_key_id: str
    instances: int = 1
    instance_type: str = "ml.c6i.2xlarge"
    job_name: str = ""

    def name(self, now: datetime) -> str:
        return self.job_name or f"semif-batch-{now:%Y%m%d-%H%M%S}"

    def request(self, now: datetime) -> dict[str, Any]:
        """CreateTransformJob's arguments."""
        split_s3_uri(self.input_uri)
        split_s3_uri(self.output_uri)
        return {
            "TransformJobName": self.name(now),
            "ModelName": self.model_name,
            "MaxConcurrentTransforms": 2,
            "MaxPayloadInMB": MAX_PAYLOAD_MB,
            "BatchStrategy": "MultiRecord",
            "ModelClientConfig": {
                "InvocationsTimeoutInSeconds": INVOCATIONS_TIMEOUT_S,
                "InvocationsMaxRetries": 1,
            },
            "TransformInput": {
                "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": self.input_uri}},
                "ContentType": JSON_LINES,
                "SplitType": "Line",
            },
            "TransformOutput": {
                "S3OutputPath": self.output_uri,
                "Accept": JSON_LINES,
                "AssembleWith": "Line",
                "KmsKeyId": self.kms_key_id,
            },
            "TransformResources": {
                "InstanceType": self.instance_type,
                "InstanceCount": self.instances,
                "VolumeKmsKeyId": self.kms_key_id,
            },
        }


def submit(
    sagemaker: Any,
    s3: Any,
    job: TransformJob,
    *,
    poll_s: float = 30.0,
    progress: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str, Summary]:
    """Create the transform job, wait for it, and summarise its output (the job name, and
    what its answers say); a failed or stopped job is an EndpointError with SageMaker's
    reason."""
    objects = input_objects(s3, job.input_uri)
    outputs = _output_keys(job, [key for key, _ in objects])
    out_bucket, out_prefix = split_s3_uri(job.output_uri)
    request = job.request(datetime.now(UTC))
    name = request["TransformJobName"]
    started = time.monotonic()
    sagemaker.create_transform_job(**request)
    while True:
        described = sagemaker.describe_transform_job(TransformJobName=name)
        status = described["TransformJobStatus"]
        if progress is not None:
            elapsed = time.monotonic() - started
            written = _written(s3, out_bucket, out_prefix, outputs)
            progress(
                f"{name}: {status} ({elapsed:.0f} s, {written}/{len(outputs)} objects answered)"
            )
        if status in _JOB_DONE:
            break
        sleep(poll_s)
    if status != "Completed":
        reason = described.get("FailureReason", "no reason given")
        raise EndpointError(0, f"transform job {name} {status}: {reason}")
    statuses: Counter[int] = Counter()
    for output_key in outputs:
        body = s3.get_object(Bucket=out_bucket, Key=output_key)["Body"]
        statuses += count_statuses(body.iter_lines())
    seconds = _job_seconds(described, time.monotonic() - started)
    return name, Summary(sum(statuses.values()), dict(statuses), seconds, 0)


def _output_keys(job: TransformJob, input_keys: list[str]) -> list[str]:
    """Where SageMaker writes each input object's answers: <output>/<its key below the
    input prefix>.out."""
    in_prefix = split_s3_uri(job.input_uri)[1]
    out_prefix = split_s3_uri(job.output_uri)[1].rstrip("/")
    keys = []
    for key in input_keys:
        relative = key[len(in_prefix) :].lstrip("/") if key.startswith(in_prefix) else key
        keys.append(f"{out_prefix}/{relative}.out".lstrip("/"))
    return keys


def _written(s3: Any, bucket: str, prefix: str, keys: list[str]) -> int:
    """How many of `keys` exist under `prefix` yet (the job's progress, object by object)."""
    found: set[str] = set()
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found.update(item["Key"] for item in page.get("Contents", []))
    return sum(1 for key in keys if key in found)


def _job_seconds(described: dict[str, Any], waited: float) -> float:
    start, end = described.get("TransformStartTime"), described.get("TransformEndTime")
    if isinstance(start, datetime) and isinstance(end, datetime):
        return (end - start).total_seconds()
    return waited


def cost(seconds: float, instances: int, price_per_hour: float) -> float:
    """What the job's instances cost at `price_per_hour` each (SageMaker bills by the
    second while the job runs)."""
    return seconds / 3600 * instances * price_per_hour


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
