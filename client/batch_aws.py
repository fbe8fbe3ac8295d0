"""`semif batch submit`: JSON Lines files through a SageMaker **batch transform job** on
the deployed decision model (docs/deploy.md, "Offline batches").

Every object under an S3 input prefix is split into lines (SplitType `Line`), sent as
mini-batches (`MultiRecord`), the answers assembled by line (AssembleWith `Line`) into
`<object>.out` under the output prefix, encrypted with the environment's key (as is the
instances' EBS volume; types with local NVMe storage encrypt it in hardware). N instances
split the objects between them. What SageMaker would refuse or the image cannot run (a GPU
type or model: no transform AMI has a driver for CUDA 13), an unknown model and an empty or
unreadable input prefix fail here, with the reason, instead of as a failed job minutes
later. The answers are summarised: lines, errors by status, time, and the cost at the
hourly price given.

SageMaker's other offline path, the asynchronous endpoint (`semif batch async`), is
client.async_endpoint: `DecisionClient.batch_async` runs it, so it sits below the client.
"""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from client.aws import INVOCATIONS_TIMEOUT_S, split_s3_uri
from client.errors import BatchInputError, EndpointError
from client.summary import Summary, count_statuses
from client.wire import JSON_LINES

# No retry of a failed mini-batch (SageMaker's default is 3): a retry re-runs up to an hour
# of scoring, the lines a mini-batch could answer already come back as answer lines (each
# with its own status), and a mini-batch that fails whole (the container died or ran out of
# time) would most likely fail the same way again, so retrying quadruples the bill of a job
# that fails anyway. `semif batch local` resends the lines answered with a retryable error.
INVOCATIONS_MAX_RETRIES = 0
MAX_PAYLOAD_MB = 6  # the container's own choice (adapter/lines.py, /execution-parameters)
_JOB_DONE = ("Completed", "Failed", "Stopped")
# CreateTransformJob's TransformJobName: at most 63 letters, digits and inner hyphens.
_JOB_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")
_INSTANCE_TYPE = re.compile(
    r"ml\.(?P<family>[a-z]+(?P<generation>[0-9]+)(?P<suffix>[a-z-]*))\.[a-z0-9]+"
)
# Instance families with local NVMe instance storage beyond those whose name says so (a "d"
# after the generation: c5d, m6id, g4dn, p4d). SageMaker refuses VolumeKmsKeyId on them; the
# instance store is encrypted by the hardware instead (see `has_local_storage`).
_LOCAL_STORAGE_FAMILIES = frozenset(
    {"g5", "g6", "g6e", "gr6", "p5", "p5e", "p5en", "trn1", "trn1n", "trn2"}
)
# The model environment variable that asks the adapter for GPU layers (the CUDA image).
GPU_LAYERS_VARIABLE = "SEMIF_N_GPU_LAYERS"
_NO_GPU_AMI = (
    "no TransformAmiVersion has an NVIDIA driver for the CUDA 13 image (the offered "
    "al2-ami-sagemaker-batch-gpu-470 and -535 have drivers 470 and 535; CUDA 13 needs 580 "
    "or newer). Score the file through the endpoint instead (`semif batch local "
    "--endpoint-name ...`), or on a CPU model with a CPU instance type"
)


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


def has_local_storage(instance_type: str) -> bool:
    """Whether the type has local NVMe instance storage, where SageMaker refuses a
    VolumeKmsKeyId: "Certain Nitro-based instances include local storage ... encrypted
    using a hardware module on the instance. You can't request a VolumeKmsKeyId when using
    an instance type with local storage" (TransformResources, SageMaker API reference; the
    types are EC2's list of instance store volumes)."""
    match = _INSTANCE_TYPE.fullmatch(instance_type)
    if match is None:
        return False
    return "d" in match["suffix"] or match["family"] in _LOCAL_STORAGE_FAMILIES


def is_gpu_type(instance_type: str) -> bool:
    """The NVIDIA GPU families SageMaker sells (g4dn, g5, g6, g6e, p4d, p5, ...)."""
    match = _INSTANCE_TYPE.fullmatch(instance_type)
    return match is not None and match["family"][0] in "gp"


@dataclass(frozen=True)
class TransformJob:
    """What `semif batch submit` asks SageMaker for; a request it would refuse, or that
    cannot run the decision image, is refused here with the reason."""

    model_name: str
    input_uri: str
    output_uri: str
    kms_key_id: str
    instances: int = 1
    instance_type: str = "ml.c6i.2xlarge"
    job_name: str = ""

    def __post_init__(self) -> None:
        if not _INSTANCE_TYPE.fullmatch(self.instance_type):
            raise BatchInputError(
                f"instance type {self.instance_type!r} is not a SageMaker one "
                "(ml.<family>.<size>, e.g. ml.c6i.2xlarge)"
            )
        if is_gpu_type(self.instance_type):
            raise BatchInputError(
                f"instance type {self.instance_type} is a GPU type: {_NO_GPU_AMI}"
            )
        if self.job_name and not _JOB_NAME.fullmatch(self.job_name):
            raise BatchInputError(
                f"job name {self.job_name!r}: 1 to 63 letters, digits and hyphens, starting "
                "and ending with a letter or digit"
            )

    def name(self, now: datetime) -> str:
        """The given name, else `semif-batch-<UTC second>-<8 random hex>` (36 characters):
        two jobs submitted in the same second get different names."""
        return self.job_name or f"semif-batch-{now:%Y%m%d-%H%M%S}-{secrets.token_hex(4)}"

    def request(self, now: datetime) -> dict[str, Any]:
        """CreateTransformJob's arguments. The volume key goes only to types with an EBS
        volume: on local NVMe storage SageMaker refuses it, and the hardware encrypts that
        storage anyway (`has_local_storage`)."""
        split_s3_uri(self.input_uri)
        split_s3_uri(self.output_uri)
        resources: dict[str, Any] = {
            "InstanceType": self.instance_type,
            "InstanceCount": self.instances,
        }
        if not has_local_storage(self.instance_type):
            resources["VolumeKmsKeyId"] = self.kms_key_id
        return {
            "TransformJobName": self.name(now),
            "ModelName": self.model_name,
            "MaxConcurrentTransforms": 2,
            "MaxPayloadInMB": MAX_PAYLOAD_MB,
            "BatchStrategy": "MultiRecord",
            "ModelClientConfig": {
                "InvocationsTimeoutInSeconds": INVOCATIONS_TIMEOUT_S,
                "InvocationsMaxRetries": INVOCATIONS_MAX_RETRIES,
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
            "TransformResources": resources,
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
    check_model(sagemaker, job.model_name)
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


def check_model(sagemaker: Any, model_name: str) -> None:
    """Refuse a model the job cannot run: one SageMaker does not know, or the gpu
    environment's (the CUDA image asks for GPU layers, and no transform AMI can give it a
    GPU it can use; on a CPU type it would fail its start minutes later)."""
    from botocore.exceptions import ClientError

    try:
        model = sagemaker.describe_model(ModelName=model_name)
    except ClientError as error:
        message = error.response.get("Error", {}).get("Message", "")
        raise BatchInputError(f"model {model_name}: {message or error}") from None
    containers = [model.get("PrimaryContainer") or {}, *model.get("Containers", [])]
    for container in containers:
        layers = str(container.get("Environment", {}).get(GPU_LAYERS_VARIABLE, "0"))
        if layers != "0":
            raise BatchInputError(
                f"model {model_name} serves on a GPU ({GPU_LAYERS_VARIABLE}={layers}): "
                + _NO_GPU_AMI
            )


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
