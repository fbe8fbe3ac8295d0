"""`semif check`'s container-series warning (client/series_check.py): the GetSeries request
as signed for CloudWatch, the PromQL alarms found through DescribeAlarms (botocore's
Stubber), the wait, and the warning that never fails the check."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

import boto3
import pytest
from botocore.stub import Stubber

from client import series_check
from client.cli import main
from client.decision_client import DecisionClient
from client.series_check import (
    SERIES,
    SeriesReader,
    promql_alarms,
    series_query,
    series_warning,
    watch_series,
)
from tests.support.scripted_endpoint import Answer, scripted_server

ENDPOINT = "semif-dev-decision"


@pytest.fixture(autouse=True)
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 signs with dummy credentials; nothing leaves loopback or a stub."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


QUERY = 'semif_requests_total{"aws.sagemaker.endpoint.name"="semif-dev-decision"}'


def _session() -> boto3.session.Session:
    return boto3.session.Session(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name="us-east-1"
    )


class FakeSeries:
    """GetSeries answered from `present` (query -> from which poll on it has a series)."""

    def __init__(self, present: Mapping[str, int]) -> None:
        self.present = present
        self.requests: list[tuple[str, dict[str, str], dict[str, list[str]]]] = []

    def send(self, url: str, headers: Mapping[str, str], body: bytes) -> bytes:
        form = parse_qs(body.decode())
        self.requests.append((url, dict(headers), form))
        (query,) = form["match[]"]
        polls = sum(1 for _, _, f in self.requests if f["match[]"] == [query])
        data = [{"__name__": query}] if polls > self.present.get(query, 10**9) else []
        return json.dumps({"status": "success", "data": data}).encode()


class FakeTime:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_query_is_the_alarms_selector() -> None:
    assert series_query(SERIES[0], ENDPOINT) == QUERY


def test_get_series_is_signed_for_cloudwatch_and_counts_series() -> None:
    series = FakeSeries({QUERY: 0})
    reader = SeriesReader(_session(), "us-east-1", series.send)
    assert reader.count(QUERY, 100.0, 200.0) == 1
    ((url, headers, form),) = series.requests
    assert url == "https://monitoring.us-east-1.amazonaws.com/api/v1/series"
    assert form == {"match[]": [QUERY], "start": ["100"], "end": ["200"], "limit": ["1"]}
    assert headers["Content-Type"] == "application/x-www-form-urlencoded"
    # SigV4 for CloudWatch's signing name, over this body (its hash is signed).
    assert "/us-east-1/monitoring/aws4_request" in headers["Authorization"]
    assert "x-amz-date" in {name.lower() for name in headers}


def _alarm(name: str, query: str | None) -> dict[str, Any]:
    alarm: dict[str, Any] = {"AlarmName": name, "StateValue": "OK"}
    if query is not None:
        alarm["EvaluationCriteria"] = {"PromQLCriteria": {"Query": query}}
    return alarm


def test_the_endpoints_promql_alarms_are_found_by_their_query() -> None:
    cloudwatch = boto3.client(
        "cloudwatch", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    alarms = [
        _alarm("unavailable", f"sum(rate({QUERY}[10m])) > 0.25"),
        _alarm("other-endpoint", QUERY.replace(ENDPOINT, "semif-prod-decision")),
        _alarm("five-xx", None),  # a metric alarm: no PromQL
    ]
    with Stubber(cloudwatch) as stub:
        stub.add_response(
            "describe_alarms", {"MetricAlarms": alarms}, {"AlarmTypes": ["MetricAlarm"]}
        )
        assert promql_alarms(cloudwatch, ENDPOINT) == ["unavailable"]


def test_series_that_show_up_within_the_wait_need_no_warning() -> None:
    series, time = FakeSeries({QUERY: 2}), FakeTime()
    reader = SeriesReader(_session(), "us-east-1", series.send)
    started = time.now
    assert (
        watch_series(reader, ENDPOINT, started, 180, ["a"], clock=time.clock, sleep=time.sleep)
        is None
    )
    assert time.sleeps == [20.0, 20.0]


def test_absent_series_warn_with_the_query_and_the_alarms() -> None:
    other = series_query(SERIES[1], ENDPOINT)
    series, time = FakeSeries({other: 0}), FakeTime()
    reader = SeriesReader(_session(), "us-east-1", series.send)
    warning = watch_series(
        reader,
        ENDPOINT,
        time.now,
        50,
        ["unavailable", "letter-mass"],
        clock=time.clock,
        sleep=time.sleep,
    )
    assert warning is not None
    assert time.sleeps == [20.0, 20.0, 10.0]  # the last poll falls on the deadline
    assert f"no semif_requests_total series for {ENDPOINT} in CloudWatch 50 s" in warning
    assert "semif_requests is there, so the alarms' metric names are not" in warning
    assert "PromQL alarms (unavailable, letter-mass) may watch nothing" in warning
    assert warning.endswith(f"Check in CloudWatch Query Studio (PromQL): {QUERY}")


class StubbedSession:
    """A boto3 session whose CloudWatch client is stubbed."""

    region_name = "us-east-1"

    def __init__(self, cloudwatch: Any) -> None:
        self.cloudwatch = cloudwatch

    def get_credentials(self) -> Any:
        return _session().get_credentials()

    def client(self, service: str, region_name: str | None = None) -> Any:
        return self.cloudwatch if service == "cloudwatch" else _session().client(service)


def test_an_unreadable_series_is_a_warning_not_a_failure() -> None:
    cloudwatch = _session().client("cloudwatch")
    with Stubber(cloudwatch) as stub:
        stub.add_client_error("describe_alarms", "AccessDenied", "not allowed", 403)
        warning = series_warning(
            StubbedSession(cloudwatch), ENDPOINT, 0.0, 60, send=FakeSeries({}).send
        )
    assert warning is not None
    assert warning.startswith(f"could not read {ENDPOINT}'s container series (")
    assert "AccessDenied" in warning
    assert warning.endswith(QUERY)


def _check_endpoint(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """`semif check --endpoint-name` against the scripted server, InService at once."""
    control = _session().client("sagemaker")
    stub = Stubber(control)
    now = datetime.now(UTC)
    described = {
        "EndpointName": ENDPOINT,
        "EndpointArn": "arn:aws:sagemaker:us-east-1:1:endpoint/x",
        "EndpointConfigName": "c",
        "EndpointStatus": "InService",
        "CreationTime": now,
        "LastModifiedTime": now,
    }
    stub.add_response("describe_endpoint", described, {"EndpointName": ENDPOINT})
    stub.activate()
    client = DecisionClient.for_endpoint(
        ENDPOINT, region="us-east-1", endpoint_url=url, control_client=control
    )
    monkeypatch.setattr("client.cli._client", lambda args: client)


ANSWER = {"result": {"option_ids": ["yes", "no"], "probabilities": [0.9, 0.1]}}


def test_semif_check_warns_without_failing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, float]] = []

    def warn(session: Any, endpoint: str, first_call_at: float, wait_s: float) -> str:
        calls.append((endpoint, wait_s))
        return "no semif_requests_total series"

    monkeypatch.setattr("client.cli.series_warning", warn)
    with scripted_server(Answer(200, ANSWER)) as server:
        _check_endpoint(monkeypatch, server.url)
        code = main(
            ["check", "--endpoint-name", ENDPOINT, "--region", "us-east-1", "--series-wait-s", "90"]
        )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "answered decision yes=0.900" in captured.out
    assert calls == [(ENDPOINT, 90.0)]
    assert captured.err.endswith("semif: warning: no semif_requests_total series\n")


@pytest.mark.parametrize(
    "extra",
    [["--series-wait-s", "0"], ["--probe", "chat"]],
    ids=["skipped", "not-the-decision-endpoint"],
)
def test_semif_check_reads_no_series_when_not_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    monkeypatch.setattr("client.cli.series_warning", lambda *a: pytest.fail("read series"))
    chat = {"choices": [{"message": {"content": "OK"}}]}
    with scripted_server(Answer(200, chat if "chat" in extra else ANSWER)) as server:
        _check_endpoint(monkeypatch, server.url)
        assert main(["check", "--endpoint-name", ENDPOINT, *extra]) == 0
    capsys.readouterr()


def test_the_deploy_check_reads_the_same_series() -> None:
    """The Lambda's twin (standard library only) asks CloudWatch the same and says the
    same: one contract for the shell and the deploy."""
    from cdk_constructs.endpoint_probe import handler

    assert handler.SERIES == series_check.SERIES
    assert handler.series_query(SERIES[0], ENDPOINT) == QUERY
    assert handler.series_form(QUERY, 1.0, 2.0) == series_check.series_form(QUERY, 1.0, 2.0)
    assert handler.absent_warning(ENDPOINT, ["a"], 180, "semif_requests") == (
        series_check.absent_warning(ENDPOINT, ["a"], 180, "semif_requests")
    )
