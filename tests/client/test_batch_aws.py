"""`semif batch submit` and `semif batch async` (client/batch_aws.py) against moto: the
transform job SageMaker is asked for (botocore validates it against the service model),
the refusals before a job starts, the summary read back from S3, and the asynchronous
round trip through S3. What moto cannot do, it is said where: it completes every transform
job at once without writing output (the test writes what SageMaker would), and answers
InvokeEndpointAsync from a queue of canned results (the container is not run)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws
from moto.sagemakerruntime.models import sagemakerruntime_backends

from client.async_endpoint import run_async
from client.batch_aws import TransformJob, cost, has_local_storage, is_gpu_type, submit
from client.cli import main
from client.decision_client import DecisionClient, EndpointError
from client.errors import BatchInputError

REGION = "us-east-1"
BUCKET = "semif-dev-artifacts"
ANSWERS = [{"result": {"id": "a"}, "line": 0}, {"line": 1, "status": 400, "error": "x"}]


MODEL = "semif-dev-decision-model"


def _create_model(name: str, gpu_layers: str) -> None:
    boto3.client("sagemaker", region_name=REGION).create_model(
        ModelName=name,
        ExecutionRoleArn="arn:aws:iam::123456789012:role/semif-dev-decision",
        PrimaryContainer={
            "Image": f"123456789012.dkr.ecr.{REGION}.amazonaws.com/adapter@sha256:{'1' * 64}",
            "Environment": {"SEMIF_N_GPU_LAYERS": gpu_layers},
        },
    )


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    with mock_aws():
        boto3.client("s3", region_name=REGION).create_bucket(Bucket=BUCKET)
        _create_model(MODEL, gpu_layers="0")
        yield


def _job(**changes: Any) -> TransformJob:
    settings: dict[str, Any] = {
        "model_name": MODEL,
        "input_uri": f"s3://{BUCKET}/batch/input/",
        "output_uri": f"s3://{BUCKET}/batch/output/",
        "kms_key_id": "arn:aws:kms:us-east-1:123456789012:key/abc",
        "instances": 2,
    }
    return TransformJob(**{**settings, **changes})


def _lines(answers: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(answer) + "\n" for answer in answers).encode()


def _put_inputs_and_outputs(s3: Any) -> None:
    """Two input objects, and the output SageMaker would write for each (moto does not)."""
    for name in ("day1.jsonl", "day2.jsonl"):
        s3.put_object(Bucket=BUCKET, Key=f"batch/input/{name}", Body=b'{"decision": {}}\n')
        s3.put_object(Bucket=BUCKET, Key=f"batch/output/{name}.out", Body=_lines(ANSWERS))


def test_submit_creates_the_job_and_sums_its_answers(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    sagemaker = boto3.client("sagemaker", region_name=REGION)
    _put_inputs_and_outputs(s3)
    shown: list[str] = []
    name, summary = submit(sagemaker, s3, _job(job_name="nightly"), poll_s=0, progress=shown.append)
    assert name == "nightly"
    described = sagemaker.describe_transform_job(TransformJobName="nightly")
    assert described["ModelName"] == "semif-dev-decision-model"
    assert described["BatchStrategy"] == "MultiRecord"
    assert described["TransformInput"]["SplitType"] == "Line"
    assert described["TransformInput"]["ContentType"] == "application/jsonlines"
    assert described["TransformOutput"]["AssembleWith"] == "Line"
    assert described["TransformOutput"]["KmsKeyId"] == _job().kms_key_id
    assert described["TransformResources"]["InstanceCount"] == 2
    assert described["TransformResources"]["VolumeKmsKeyId"] == _job().kms_key_id  # EBS: c6i
    # An hour-long mini-batch is not run again: its lines carry their own errors.
    assert described["ModelClientConfig"] == {
        "InvocationsTimeoutInSeconds": 3600,
        "InvocationsMaxRetries": 0,
    }
    assert summary.statuses == {200: 2, 400: 2}
    assert shown[-1].startswith("nightly: Completed (")
    assert shown[-1].endswith(" s, 2/2 objects answered)")
    assert cost(3600, 2, 0.5) == pytest.approx(1.0)


def test_an_empty_or_unreadable_input_fails_before_any_job(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    sagemaker = boto3.client("sagemaker", region_name=REGION)
    with pytest.raises(BatchInputError, match="holds no objects"):
        submit(sagemaker, s3, _job(), poll_s=0)
    with pytest.raises(BatchInputError, match="NoSuchBucket"):
        submit(sagemaker, s3, _job(input_uri="s3://missing-bucket/x/"), poll_s=0)
    with pytest.raises(BatchInputError, match="not an s3://"):
        submit(sagemaker, s3, _job(input_uri="/tmp/x"), poll_s=0)
    assert sagemaker.list_transform_jobs()["TransformJobSummaries"] == []


class _FailingJobs:
    """SageMaker's answer to a job that failed (moto completes every job)."""

    def describe_model(self, ModelName: str) -> dict[str, Any]:  # noqa: N803
        return {"PrimaryContainer": {"Environment": {"SEMIF_N_GPU_LAYERS": "0"}}}

    def create_transform_job(self, **request: Any) -> None:
        self.request = request

    def describe_transform_job(self, TransformJobName: str) -> dict[str, Any]:  # noqa: N803
        return {"TransformJobStatus": "Failed", "FailureReason": "ClientError: bad line"}


def test_a_failed_job_says_why(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    _put_inputs_and_outputs(s3)
    with pytest.raises(EndpointError, match="Failed: ClientError: bad line"):
        submit(_FailingJobs(), s3, _job(), poll_s=0)


def _queue_async_result(data: bytes, failure: bool = False) -> None:
    backend = sagemakerruntime_backends["123456789012"][REGION]
    backend.async_results_queue.append((failure, data.decode()))


def test_async_uploads_queues_and_downloads(aws: None, tmp_path: Path) -> None:
    source = tmp_path / "tickets.jsonl"
    source.write_text('{"decision": {}}\n{"decision": {}}\n')
    out = tmp_path / "answers.jsonl"
    _queue_async_result(_lines(ANSWERS))
    s3 = boto3.client("s3", region_name=REGION)
    summary = run_async(
        boto3.client("sagemaker-runtime", region_name=REGION),
        s3,
        endpoint_name="semif-dev-decision-async",
        source=source,
        input_prefix=f"s3://{BUCKET}/async/input/",
        out=out,
        poll_s=0,
    )
    assert out.read_bytes() == _lines(ANSWERS)
    assert summary.statuses == {200: 1, 400: 1}
    uploaded = s3.list_objects_v2(Bucket=BUCKET, Prefix="async/input/")["Contents"]
    assert len(uploaded) == 1
    assert uploaded[0]["Key"].startswith("async/input/tickets-")


def test_async_failure_is_an_error_and_writes_nothing(aws: None, tmp_path: Path) -> None:
    source = tmp_path / "tickets.jsonl"
    source.write_text('{"decision": {}}\n')
    out = tmp_path / "answers.jsonl"
    _queue_async_result(b"the container failed", failure=True)
    client = DecisionClient.for_endpoint(
        "semif-dev-decision-async",
        runtime_client=boto3.client("sagemaker-runtime", region_name=REGION),
        region=REGION,
    )
    with pytest.raises(EndpointError, match="failed the batch"):
        client.batch_async(source, input_prefix=f"s3://{BUCKET}/async/input/", out=out)
    assert not out.exists()


def _submit_argv(job: TransformJob, *extra: str) -> list[str]:
    """`semif batch submit` for `job`, with `extra` options."""
    return [
        "batch",
        "submit",
        "--model-name",
        job.model_name,
        "--input",
        job.input_uri,
        "--output",
        job.output_uri,
        "--kms-key-id",
        job.kms_key_id,
        *extra,
    ]


def test_the_cli_submits_and_prints_the_cost(aws: None, capsys: pytest.CaptureFixture[str]) -> None:
    _put_inputs_and_outputs(boto3.client("s3", region_name=REGION))
    job = _job()
    code = main(
        _submit_argv(job, "--job-name", "cli-job", "--price-per-hour", "0.408", "--poll-s", "0")
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.startswith("cli-job: 4 lines answered: 2 errors (2 x 400)")
    assert "at $0.408/h x 1" in captured.out


@pytest.mark.parametrize(
    ("instance_type", "local"),
    [
        ("ml.c6i.2xlarge", False),
        ("ml.m7i.large", False),
        ("ml.inf2.xlarge", False),
        ("ml.c6in.xlarge", False),  # "n" is networking, not storage
        ("ml.trn1.2xlarge", True),
        ("ml.m5d.xlarge", True),
        ("ml.c6id.2xlarge", True),
        ("ml.g4dn.xlarge", True),
        ("ml.g5.2xlarge", True),
        ("ml.g6e.xlarge", True),
        ("ml.p4de.24xlarge", True),
    ],
)
def test_local_storage_types_get_no_volume_key(instance_type: str, local: bool) -> None:
    assert has_local_storage(instance_type) is local
    if is_gpu_type(instance_type):
        return  # refused before any request (below)
    request = _job(instance_type=instance_type).request(datetime.now(UTC))
    assert ("VolumeKmsKeyId" in request["TransformResources"]) is not local
    assert request["TransformOutput"]["KmsKeyId"] == _job().kms_key_id  # output: always


def test_a_local_storage_job_is_accepted_by_the_service_model(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    sagemaker = boto3.client("sagemaker", region_name=REGION)
    _put_inputs_and_outputs(s3)
    name, _ = submit(sagemaker, s3, _job(instance_type="ml.trn1.2xlarge"), poll_s=0)
    described = sagemaker.describe_transform_job(TransformJobName=name)
    assert "VolumeKmsKeyId" not in described["TransformResources"]


@pytest.mark.parametrize(
    "instance_type",
    ["ml.g4dn.xlarge", "ml.g5.2xlarge", "ml.g6.xlarge", "ml.g6e.xlarge", "ml.p4d.24xlarge"],
)
def test_gpu_types_are_refused_until_an_ami_fits_cuda_13(instance_type: str) -> None:
    with pytest.raises(BatchInputError, match=rf"{instance_type} is a GPU type: no Transform"):
        _job(instance_type=instance_type)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"instance_type": "c6i.2xlarge"}, "not a SageMaker one"),
        ({"job_name": "-nightly"}, "1 to 63 letters"),
        ({"job_name": "a" * 64}, "1 to 63 letters"),
        ({"job_name": "night_ly"}, "1 to 63 letters"),
    ],
)
def test_bad_job_settings_are_refused_by_name(changes: dict[str, str], message: str) -> None:
    with pytest.raises(BatchInputError, match=message):
        _job(**changes)


def test_default_job_names_differ_within_one_second() -> None:
    now = datetime(2026, 11, 3, 4, 5, 6, tzinfo=UTC)
    names = {_job().name(now) for _ in range(20)}
    assert len(names) == 20
    for name in names:
        assert re.fullmatch(r"semif-batch-20261103-040506-[0-9a-f]{8}", name)
        assert len(name) <= 63


def test_a_gpu_model_or_an_unknown_one_fails_before_any_job(aws: None) -> None:
    s3 = boto3.client("s3", region_name=REGION)
    sagemaker = boto3.client("sagemaker", region_name=REGION)
    _put_inputs_and_outputs(s3)
    _create_model("semif-gpu-decision-model", gpu_layers="-1")
    with pytest.raises(BatchInputError, match=r"serves on a GPU \(SEMIF_N_GPU_LAYERS=-1\): no Tr"):
        submit(sagemaker, s3, _job(model_name="semif-gpu-decision-model"), poll_s=0)
    with pytest.raises(BatchInputError, match="model missing-model: "):
        submit(sagemaker, s3, _job(model_name="missing-model"), poll_s=0)
    assert sagemaker.list_transform_jobs()["TransformJobSummaries"] == []


def test_the_cli_refuses_a_gpu_type_as_usage(capsys: pytest.CaptureFixture[str]) -> None:
    job = _job()
    code = main(_submit_argv(job, "--instance-type", "ml.g6e.xlarge"))
    assert code == 2
    assert "ml.g6e.xlarge is a GPU type" in capsys.readouterr().err
