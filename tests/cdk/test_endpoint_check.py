"""The post-deploy check's handler, against botocore's Stubber (real request/response shapes)."""

from __future__ import annotations

import io
import json
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from cdk_constructs.endpoint_check import HANDLER_TIMEOUT, SERIES_WAIT, Probe
from cdk_constructs.endpoint_operations import ENDPOINT_LABEL
from cdk_constructs.endpoint_probe import handler
from stacks.endpoint_stacks import check_body
from tests.support.templates import Synth, resources, statements

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


# -- the container series (PromQL alarms that would watch nothing) ------------------------

ENDPOINT = "semif-dev-decision"
QUERY = handler.series_query(handler.SERIES[0], ENDPOINT)


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0
        self.slept: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _counts(present: dict[str, int]) -> tuple[Any, list[str]]:
    """count_series answered from `present` (query -> polls before its series shows up)."""
    asked: list[str] = []

    def count(query: str, start: float, end: float) -> int:
        assert end - start == handler.LOOKBACK_S
        asked.append(query)
        return int(asked.count(query) > present.get(query, 10**9))

    return count, asked


def test_series_that_arrive_in_time_need_no_warning() -> None:
    clock = Clock()
    count, asked = _counts({QUERY: 2})
    warning = handler.series_warning(
        ENDPOINT, ["a"], clock.now, 180, lambda: 600.0, count, clock.time, clock.sleep
    )
    assert warning is None
    assert (asked, clock.slept) == ([QUERY] * 3, [20.0, 20.0])


def test_absent_series_are_a_warning_within_the_functions_time() -> None:
    """Waited at most what the function has left (less a margin for the last calls)."""
    clock = Clock()
    count, _ = _counts({})
    warning = handler.series_warning(
        ENDPOINT, ["Unavailable"], clock.now, 180, lambda: 70.0, count, clock.time, clock.sleep
    )
    assert sum(clock.slept) == 70.0 - handler.SERIES_MARGIN_S
    assert warning is not None
    assert warning.startswith(f"no semif_requests_total series for {ENDPOINT} in CloudWatch 40 s")
    assert "PromQL alarms (Unavailable) may watch nothing" in warning
    assert warning.endswith(QUERY)


def test_an_unreadable_series_is_a_warning() -> None:
    def denied(query: str, start: float, end: float) -> int:
        raise OSError("HTTP Error 403: Forbidden")

    warning = handler.series_warning(ENDPOINT, [], 0.0, 180, lambda: 600.0, denied)
    assert warning == (
        f"could not read {ENDPOINT}'s container series (HTTP Error 403: Forbidden); check in "
        f"CloudWatch Query Studio (PromQL): {QUERY}"
    )


def test_a_series_warning_is_in_the_result_and_never_fails_the_deploy() -> None:
    event = _event()
    event["ResourceProperties"] |= {"SeriesWaitSeconds": "180", "PromQLAlarms": ["Unavailable"]}
    seen: list[tuple[Any, ...]] = []

    def series(*args: Any) -> str:
        seen.append(args[:4])
        return "no semif_requests_total series"

    runtime, stub = _runtime()
    _expect_invoke(stub, DECISION_BODY, GOOD_DECISION)
    with stub:
        result = handler.on_event(event, Context(), runtime=runtime, series=series)
    assert result["Data"]["Result"] == (
        "decision yes=0.900, no=0.100; WARNING: no semif_requests_total series"
    )
    ((endpoint, alarms, _, wait_s),) = seen
    assert (endpoint, alarms, wait_s) == (ENDPOINT, ["Unavailable"], 180.0)


def test_the_chat_check_reads_no_series() -> None:
    runtime, stub = _runtime()
    _expect_invoke(stub, CHAT_BODY, GOOD_CHAT)
    with stub:
        result = handler.on_event(
            _event(probe="chat"),
            Context(),
            runtime=runtime,
            series=lambda *a: pytest.fail("read series"),
        )
    assert result["Data"]["Result"] == "chat reply 'OK'"


def test_get_series_is_signed_for_cloudwatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    sent: list[Any] = []

    def urlopen(request: Any, timeout: float) -> Any:
        sent.append(request)
        return io.BytesIO(json.dumps({"status": "success", "data": [{}, {}]}).encode())

    monkeypatch.setattr("urllib.request.urlopen", urlopen)
    assert handler.count_series(QUERY, 100.0, 200.0) == 2
    (request,) = sent
    assert request.full_url == "https://monitoring.eu-west-1.amazonaws.com/api/v1/series"
    assert request.get_method() == "POST"
    assert request.data == handler.series_form(QUERY, 100.0, 200.0)
    assert "/eu-west-1/monitoring/aws4_request" in request.get_header("Authorization")


def test_the_decision_check_names_its_promql_alarms_and_may_read_series(synth: Synth) -> None:
    raw = synth.raw("dev", "decision")
    ((_, check),) = resources(raw, "Custom::EndpointCheck")
    properties = check["Properties"]
    assert properties["SeriesWaitSeconds"] == SERIES_WAIT.to_seconds()
    promql = {
        name
        for name, alarm in resources(raw, "AWS::CloudWatch::Alarm")
        if f'"{ENDPOINT_LABEL}"="{ENDPOINT}"'
        in json.dumps(alarm["Properties"].get("EvaluationCriteria", {})).replace('\\"', '"')
    }
    assert promql, "the decision stack has PromQL alarms on its endpoint"
    assert {ref["Ref"] for ref in properties["PromQLAlarms"]} == promql
    # The alarms' own metric is the one the check waits for.
    queries = json.dumps([raw["Resources"][name]["Properties"] for name in promql])
    assert handler.SERIES[0] in queries
    assert handler.ENDPOINT_LABEL == ENDPOINT_LABEL
    reads = [s for _, s in statements(raw) if s["Action"] == "cloudwatch:ListMetrics"]
    assert [s["Resource"] for s in reads] == ["*"]
    functions = [f for _, f in resources(raw, "AWS::Lambda::Function")]
    assert HANDLER_TIMEOUT.to_seconds() in [f["Properties"].get("Timeout") for f in functions]


def test_the_standard_check_reads_no_series(synth: Synth) -> None:
    raw = synth.raw("dev", "standard")
    ((_, check),) = resources(raw, "Custom::EndpointCheck")
    assert "SeriesWaitSeconds" not in check["Properties"]
    assert not [s for _, s in statements(raw) if s["Action"] == "cloudwatch:ListMetrics"]
