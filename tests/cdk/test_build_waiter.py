"""The deploy-time build handler: start, poll, succeed with outputs, fail with the log link.

botocore's Stubber checks every CodeBuild call's parameters; one moto test runs the real
client end to end (moto's builds "succeed" instantly).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from cdk_constructs.build_waiter import handler

PROJECT = "semif-dev-images-CpuImageProject"
BUILD_ID = f"{PROJECT}:0a1b2c3d"
LOG_LINK = "https://console.aws.amazon.com/cloudwatch/home?region=us-east-1#logsV2:log-groups"
IMAGE_URI = "111111111111.dkr.ecr.us-east-1.amazonaws.com/adapter@sha256:" + "a" * 64


@pytest.fixture
def codebuild() -> Iterator[tuple[Any, Stubber]]:
    client = boto3.client(
        "codebuild",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    with Stubber(client) as stubber:
        yield client, stubber
        stubber.assert_no_pending_responses()


def event(request_type: str, **extra: Any) -> dict[str, Any]:
    return {
        "RequestType": request_type,
        "ResourceProperties": {
            "ServiceToken": "arn:aws:lambda:us-east-1:111111111111:function:x",
            "ProjectName": PROJECT,
            "Trigger": "cpu-" + "0" * 32,
            "OutputVariables": ["IMAGE_URI"],
        },
        **extra,
    }


def build(status: str, exported: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "id": BUILD_ID,
        "buildStatus": status,
        "logs": {"deepLink": LOG_LINK},
        "exportedEnvironmentVariables": exported or [],
    }


TRIGGER = "cpu-" + "0" * 32
START = {
    "projectName": PROJECT,
    "environmentVariablesOverride": [
        {"name": handler.TRIGGER_VARIABLE, "value": TRIGGER, "type": "PLAINTEXT"}
    ],
}
HISTORY = {"projectName": PROJECT, "sortOrder": "DESCENDING"}


def tagged(build_id: str, status: str, trigger: str) -> dict[str, Any]:
    variables = [{"name": handler.TRIGGER_VARIABLE, "value": trigger, "type": "PLAINTEXT"}]
    return {
        "id": build_id,
        "buildStatus": status,
        "environment": {
            "type": "LINUX_CONTAINER",
            "image": "x",
            "computeType": "BUILD_GENERAL1_MEDIUM",
            "environmentVariables": variables,
        },
    }


def test_create_starts_one_build_and_keeps_the_project_as_physical_id(
    codebuild: tuple[Any, Stubber],
) -> None:
    client, stubber = codebuild
    stubber.add_response("list_builds_for_project", {}, HISTORY)
    stubber.add_response("start_build", {"build": {"id": BUILD_ID}}, START)
    result = handler.on_event(event("Create"), None, client)
    assert result == {"PhysicalResourceId": PROJECT, "Data": {"BuildId": BUILD_ID}}


def test_update_with_new_inputs_starts_a_new_build(codebuild: tuple[Any, Stubber]) -> None:
    client, stubber = codebuild
    older = f"{PROJECT}:older"
    stubber.add_response("list_builds_for_project", {"ids": [older]}, HISTORY)
    stubber.add_response(
        "batch_get_builds", {"builds": [tagged(older, "SUCCEEDED", "cpu-" + "9" * 32)]}
    )
    stubber.add_response("start_build", {"build": {"id": BUILD_ID}}, START)
    result = handler.on_event(event("Update", PhysicalResourceId=PROJECT), None, client)
    assert result == {"PhysicalResourceId": PROJECT, "Data": {"BuildId": BUILD_ID}}


def test_rollback_reuses_the_build_that_succeeded_for_its_trigger(
    codebuild: tuple[Any, Stubber],
) -> None:
    """A rollback's Update carries the previous trigger: no new build, the old outputs."""
    client, stubber = codebuild
    failed, earlier = f"{PROJECT}:failed", f"{PROJECT}:earlier"
    stubber.add_response("list_builds_for_project", {"ids": [failed, earlier]}, HISTORY)
    stubber.add_response(
        "batch_get_builds",
        {"builds": [tagged(earlier, "SUCCEEDED", TRIGGER), tagged(failed, "FAILED", TRIGGER)]},
    )
    result = handler.on_event(event("Update", PhysicalResourceId=PROJECT), None, client)
    assert result == {"PhysicalResourceId": PROJECT, "Data": {"BuildId": earlier}}


def test_delete_starts_nothing_and_completes_at_once(codebuild: tuple[Any, Stubber]) -> None:
    client, _ = codebuild  # no stubbed response: any call would fail the test
    result = handler.on_event(event("Delete", PhysicalResourceId=PROJECT), None, client)
    assert result == {"PhysicalResourceId": PROJECT}
    assert handler.is_complete(event("Delete", PhysicalResourceId=PROJECT), None, client) == {
        "IsComplete": True
    }


def poll(client: Any) -> dict[str, Any]:
    return handler.is_complete(event("Create", Data={"BuildId": BUILD_ID}), None, client)


def test_running_build_is_not_complete(codebuild: tuple[Any, Stubber]) -> None:
    client, stubber = codebuild
    stubber.add_response(
        "batch_get_builds", {"builds": [build("IN_PROGRESS")]}, {"ids": [BUILD_ID]}
    )
    assert poll(client) == {"IsComplete": False}


def test_succeeded_build_returns_its_exported_variables(codebuild: tuple[Any, Stubber]) -> None:
    client, stubber = codebuild
    exported = [{"name": "IMAGE_URI", "value": IMAGE_URI}, {"name": "OTHER", "value": "x"}]
    stubber.add_response("batch_get_builds", {"builds": [build("SUCCEEDED", exported)]})
    assert poll(client) == {
        "IsComplete": True,
        "Data": {"BuildId": BUILD_ID, "LogLink": LOG_LINK, "IMAGE_URI": IMAGE_URI},
    }


@pytest.mark.parametrize("status", ["FAILED", "FAULT", "STOPPED", "TIMED_OUT"])
def test_failed_build_fails_the_deploy_with_the_log_link(
    codebuild: tuple[Any, Stubber], status: str
) -> None:
    client, stubber = codebuild
    stubber.add_response("batch_get_builds", {"builds": [build(status)]})
    with pytest.raises(handler.BuildFailedError, match=status) as failure:
        poll(client)
    assert LOG_LINK in str(failure.value)


def test_success_without_the_declared_output_fails(codebuild: tuple[Any, Stubber]) -> None:
    client, stubber = codebuild
    stubber.add_response("batch_get_builds", {"builds": [build("SUCCEEDED", [])]})
    with pytest.raises(handler.BuildFailedError, match="IMAGE_URI"):
        poll(client)


def test_unknown_build_fails(codebuild: tuple[Any, Stubber]) -> None:
    client, stubber = codebuild
    stubber.add_response("batch_get_builds", {"builds": []})
    with pytest.raises(handler.BuildFailedError, match="not found"):
        poll(client)


def test_round_trip_against_moto(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start and poll a real (moto) CodeBuild project with the module's own client."""
    from moto import mock_aws

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    with mock_aws():
        boto3.client("codebuild").create_project(
            name=PROJECT,
            source={"type": "S3", "location": "bucket/source.zip"},
            artifacts={"type": "NO_ARTIFACTS"},
            environment={
                "type": "LINUX_CONTAINER",
                "image": "aws/codebuild/amazonlinux-x86_64-standard:5.0",
                "computeType": "BUILD_GENERAL1_MEDIUM",
            },
            serviceRole="arn:aws:iam::123456789012:role/build",
        )
        props = {"ProjectName": PROJECT, "Trigger": TRIGGER, "OutputVariables": []}
        created = handler.on_event({"RequestType": "Create", "ResourceProperties": props}, None)
        polled = handler.is_complete(
            {"RequestType": "Create", "ResourceProperties": props, **created}, None
        )
    assert created["Data"]["BuildId"].startswith(f"{PROJECT}:")
    assert polled["IsComplete"] is True
    assert polled["Data"]["BuildId"] == created["Data"]["BuildId"]
