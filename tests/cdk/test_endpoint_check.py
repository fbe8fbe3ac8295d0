"""The post-deploy check's handler, against botocore's Stubber (real request/response shapes)."""

from __future__ import annotations

import io
import json
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from cdk_constructs.endpoint_check import Probe
from cdk_constructs.endpoint_probe import handler
from stacks.endpoint_stacks import check_body

DECISION_BODY = check_body(Probe.DECISION)
CHAT_BODY = check_body(Probe.CHAT)

GOOD_DECISION = {
    "result": {
        "id": "post-deploy-check",
        "option_ids": ["yes", "no"],
        "probabilities": [0.9, 0.1],
    }
}
GOOD_CHAT = {"choices": [{"message": {"role": "assistant", "content": "OK"}}]}


class Context:
    def __init__(self, remaining_ms: int = 300_000) -> None:
        self.remaining_ms = remaining_ms

    def get_remaining_time_in_millis(self) -> int:
        return self.remaining_ms


def _event(request: str = "Create", probe: str = "decision") -> dict[str, Any]:
    return {
        "RequestType": request,
        "StackId": "arn:aws:cloudformation:us-east-1:498765432107:stack/semif-dev-decision/x",
        "ResourceProperties": {
            "EndpointName": "semif-dev-decision",
            "Probe": probe,
            "Body": json.dumps(check_body(Probe(probe))),
        },
    }


def _body(answer: Any) -> StreamingBody:
    raw = json.dumps(answer).encode()
    return StreamingBody(io.BytesIO(raw), len(raw))


def _runtime() -> tuple[Any, Stubber]:
    client = boto3.client(
        "sagemaker-runtime",
        region_name="us-east-1",
        aws_access_key_id="x",
        aws_secret_access_key="x",
    )
    return client, Stubber(client)


def _expect_invoke(stub: Stubber, body: dict[str, Any], answer: Any) -> None:
    stub.add_response(
        "invoke_endpoint",
        {"Body": _body(answer), "ContentType": "application/json"},
        {
            "EndpointName": "semif-dev-decision",
            "ContentType": "application/json",
            "Accept": "application/json",
            "Body": json.dumps(body).encode(),
        },
    )


def test_decision_probe_passes_and_reports_the_answer() -> None:
    runtime, stub = _runtime()
    _expect_invoke(stub, DECISION_BODY, GOOD_DECISION)
    with stub:
        result = handler.on_event(_event(), Context(), runtime=runtime)
    assert result["PhysicalResourceId"] == "check:semif-dev-decision"
    assert result["Data"]["Result"] == "decision yes=0.900, no=0.100"
    stub.assert_no_pending_responses()


def test_chat_probe_passes() -> None:
    runtime, stub = _runtime()
    _expect_invoke(stub, CHAT_BODY, GOOD_CHAT)
    with stub:
        result = handler.on_event(_event(probe="chat"), Context(), runtime=runtime)
    assert result["Data"]["Result"] == "chat reply 'OK'"


@pytest.mark.parametrize(
    "answer",
    [
        {"result": {**GOOD_DECISION["result"], "option_ids": ["no", "yes"]}},
        {"result": {**GOOD_DECISION["result"], "probabilities": [0.9, 0.9]}},
        {"results": []},
        {"error": "x"},
    ],
)
def test_a_wrong_answer_fails_the_deploy(answer: dict[str, Any]) -> None:
    runtime, stub = _runtime()
    _expect_invoke(stub, DECISION_BODY, answer)
    with stub, pytest.raises(handler.CheckFailedError):
        handler.on_event(_event(), Context(), runtime=runtime)


def test_the_endpoint_error_is_the_failure_reason() -> None:
    runtime, stub = _runtime()
    stub.add_client_error(
        "invoke_endpoint",
        service_error_code="ModelError",
        service_message='Received client error (400) from primary: {"error": "bad options"}',
        http_status_code=424,
        response_meta={},
    )
    with stub, pytest.raises(handler.CheckFailedError, match=r"ModelError.*bad options"):
        handler.on_event(_event(), Context(), runtime=runtime)


def test_busy_answers_are_retried_then_pass() -> None:
    runtime, stub = _runtime()
    stub.add_client_error("invoke_endpoint", "ThrottlingException", "slow down", 400)
    _expect_invoke(stub, DECISION_BODY, GOOD_DECISION)
    slept: list[float] = []
    with stub:
        summary = handler.probe(
            runtime, "semif-dev-decision", "decision", DECISION_BODY, lambda: 300.0, slept.append
        )
    assert summary.startswith("decision yes=")
    assert slept == [2.0]


def test_retries_stop_before_the_lambda_timeout() -> None:
    runtime, stub = _runtime()
    stub.add_client_error("invoke_endpoint", "ThrottlingException", "slow down", 400)
    with stub, pytest.raises(handler.CheckFailedError, match="still not answering"):
        handler.probe(
            runtime, "semif-dev-decision", "decision", DECISION_BODY, lambda: 10.0, lambda _: None
        )


def _cloudformation(status: str) -> tuple[Any, Stubber]:
    client = boto3.client(
        "cloudformation", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    stub = Stubber(client)
    stub.add_response(
        "describe_stacks",
        {
            "Stacks": [
                {
                    "StackName": "semif-dev-decision",
                    "CreationTime": "2026-01-01T00:00:00Z",
                    "StackStatus": status,
                }
            ]
        },
        {"StackName": _event()["StackId"]},
    )
    return client, stub


def test_a_failure_during_update_rollback_does_not_fail_the_rollback() -> None:
    runtime, stub = _runtime()
    _expect_invoke(stub, DECISION_BODY, {"error": "x"})
    cloudformation, cfn_stub = _cloudformation("UPDATE_ROLLBACK_IN_PROGRESS")
    with stub, cfn_stub:
        result = handler.on_event(
            _event("Update"), Context(), runtime=runtime, cloudformation=cloudformation
        )
    assert result["Data"]["Result"].startswith("rollback: ")


def test_a_failure_during_an_update_fails_it() -> None:
    runtime, stub = _runtime()
    _expect_invoke(stub, DECISION_BODY, {"error": "x"})
    cloudformation, cfn_stub = _cloudformation("UPDATE_IN_PROGRESS")
    with stub, cfn_stub, pytest.raises(handler.CheckFailedError):
        handler.on_event(
            _event("Update"), Context(), runtime=runtime, cloudformation=cloudformation
        )


def test_delete_invokes_nothing() -> None:
    event = {**_event("Delete"), "PhysicalResourceId": "check:semif-dev-decision"}
    assert handler.on_event(event, Context(), runtime=object()) == {
        "PhysicalResourceId": "check:semif-dev-decision"
    }


def test_an_unexpected_error_during_update_rollback_does_not_fail_the_rollback() -> None:
    """Not only a wrong answer: anything the handler raises (here the runtime client
    itself breaks) is logged during a rollback, never left to fail it."""

    class Broken:
        def invoke_endpoint(self, **_: Any) -> Any:
            raise OSError("socket closed")

    cloudformation, cfn_stub = _cloudformation("UPDATE_ROLLBACK_IN_PROGRESS")
    with cfn_stub:
        result = handler.on_event(
            _event("Update"), Context(), runtime=Broken(), cloudformation=cloudformation
        )
    assert result["Data"]["Result"] == "rollback: socket closed"


def test_a_malformed_chat_answer_is_a_check_failure() -> None:
    with pytest.raises(handler.CheckFailedError, match="no message content"):
        handler.check_chat(CHAT_BODY, {"choices": ["not an object"]})


def test_another_attempt_starts_only_if_a_worst_case_one_fits() -> None:
    assert handler.SAFETY_MARGIN_S > handler.CONNECT_TIMEOUT_S + handler.READ_TIMEOUT_S
