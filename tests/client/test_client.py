"""The client against a real local server (uvicorn on loopback, the tiny model): typed
results, typed errors, the retry policy, and boto3's own invoke_endpoint through the
server's SageMaker runtime route."""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest
from botocore.stub import Stubber

from adapter.app import create_app
from adapter.core.retry_line import Refusal
from adapter.settings import Settings
from client.answers import DecisionResult
from client.cli import format_decision, main
from client.decision_client import (
    BusyError,
    ChoiceAnswer,
    DecisionClient,
    EndpointError,
    HttpTransport,
    NoulAnswer,
    RetryPolicy,
    SageMakerTransport,
    ScoreAnswer,
    UnreachableError,
)
from tests.support.live_server import BusyFirst, live_server, runtime_of
from tests.support.serving import decision

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.001, max_delay_s=0.002)


@pytest.fixture(scope="module")
def server(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BusyFirst]:
    model_dir = tmp_path_factory.mktemp("client-model")
    shutil.copy(tiny_gguf, model_dir / tiny_gguf.name)
    app = create_app(Settings(model_dir=model_dir, max_tokens=1024, threads=1))
    flaky = BusyFirst(app, runtime_of(app))
    with live_server(flaky) as url:
        flaky.url = url
        yield flaky


@pytest.fixture
def url(server: BusyFirst) -> str:
    server.busy = 0
    return server.url


def runtime_client(url: str) -> Any:
    """The real boto3 SageMaker runtime client, pointed at the local server."""
    return boto3.client(
        "sagemaker-runtime",
        region_name="us-east-1",
        endpoint_url=url,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",  # dummy credentials: loopback or stubbed only
    )


# -- typed calls --------------------------------------------------------------------------


def test_decide_and_decide_many(url: str) -> None:
    client = DecisionClient.for_url(url, retry=FAST)
    result = client.decide(decision())
    assert result.id == "support-route"
    assert result.option_ids == ["account_access", "billing", "sales"]
    assert result.choice == result.option_ids[result.probabilities.index(max(result.probabilities))]
    assert result.probability("billing") == result.probabilities[1]
    assert len(result.prompt_sha256) == 64
    shared = client.decide_many([decision("a"), decision("b", question="Is it urgent?")])
    assert [r.id for r in shared] == ["a", "b"]
    assert result.readout == "letters"
    likely = client.decide(decision(), readout="likelihood", normalization="mean")
    assert (likely.readout, likely.raw["normalization"]) == ("likelihood", "mean")
    assert likely.option_ids == result.option_ids


def test_systemone_and_chat_return_typed_answers(url: str) -> None:
    client = DecisionClient.for_url(url, retry=FAST)
    answers = client.systemone(
        {"text": "Charged twice."},
        {
            "refund": {"type": "noul", "instructions": "Is a refund requested?"},
            "queue": {
                "type": "choice",
                "instructions": "Which queue?",
                "criteria": {"billing": None, "sales": None},
            },
            "urgency": {
                "type": "score",
                "instructions": "How urgent?",
                "criteria": ["low", "high"],
            },
        },
    )
    assert answers.model == "tiny.gguf"
    assert isinstance(answers["refund"], NoulAnswer)
    assert isinstance(answers["queue"], ChoiceAnswer)
    assert answers["queue"].choice in {"billing", "sales"}
    assert isinstance(answers["urgency"], ScoreAnswer)
    assert answers.input_tokens > 0
    completion = client.chat([{"role": "user", "content": "Hi"}], max_tokens=5)
    assert completion.completion_tokens <= 5
    assert completion.finish_reason in {"stop", "length"}
    assert completion.model == "tiny.gguf"


def test_endpoint_errors_keep_the_message_and_are_not_retried(server: BusyFirst, url: str) -> None:
    client = DecisionClient.for_url(url, retry=FAST)
    posts = server.posts
    with pytest.raises(EndpointError) as raised:
        client.decide({**decision(), "options": []})
    assert raised.type is EndpointError
    assert raised.value.status == 400
    assert raised.value.message == "decision.options: has 0 options; allowed 2..16"
    assert raised.value.body["request_id"]
    assert server.posts == posts + 1  # a 4xx is never retried
    with pytest.raises(EndpointError) as schema:
        client.systemone("s", {"q": {"type": "noul"}})
    assert (schema.value.status, schema.value.body["field"]) == (422, "questions.q.instructions")


def test_an_unhealthy_model_is_not_retried(server: BusyFirst, url: str) -> None:
    service = server.runtime.service
    assert service is not None
    service.health.healthy = False  # /ping 503 and refusals with "retryable": false
    posts = server.posts
    try:
        with pytest.raises(EndpointError) as raised:
            DecisionClient.for_url(url, retry=FAST).decide(decision())
    finally:
        service.health.healthy = True
    assert raised.type is EndpointError
    assert (raised.value.status, raised.value.message) == (503, "model is not healthy")
    assert server.posts == posts + 1


def test_unreachable_server_is_a_typed_error() -> None:
    client = DecisionClient.for_url("http://127.0.0.1:9", retry=FAST, timeout_s=2)
    with pytest.raises(UnreachableError) as raised:
        client.decide(decision())
    assert raised.value.status == 0


# -- retry policy -------------------------------------------------------------------------


def waiting(sleeps: list[float]) -> Callable[[float], None]:
    """A client's sleep that records each wait and waits it: a retry that brings its place
    back before the place is due is told to wait again (see `draining`)."""

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        time.sleep(seconds)

    return sleep


@pytest.fixture
def draining(server: BusyFirst, monkeypatch: pytest.MonkeyPatch) -> None:
    """The queue BusyFirst shows as full drains at once: places in the retry line fall due
    about a second apart, so a test of retries waits seconds, not the drain of 256."""
    service = server.runtime.service
    assert service is not None
    monkeypatch.setattr(service.scheduler.admission, "_drain_seconds", lambda waiting: 0.0)


@pytest.mark.usefixtures("draining")
def test_the_servers_retry_after_is_waited_plus_jitter_and_its_token_sent_back(
    server: BusyFirst, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real server's busy 429 carries its Retry-After and a place in its retry line:
    the client waits the hint plus jitter and sends the token back with the retry, which
    keeps the place (the same token, never an earlier time); backoff without a hint, the
    budget and the other hints are in test_retry.py."""
    service = server.runtime.service
    assert service is not None
    line = service.scheduler.admission._line
    given: list[Refusal] = []
    brought: list[str | None] = []
    refuse = line.refuse

    def spy(
        now: float, *, earliest_s: float, request_s: float, token: str | None = None
    ) -> Refusal:
        brought.append(token)
        given.append(refuse(now, earliest_s=earliest_s, request_s=request_s, token=token))
        return given[-1]

    monkeypatch.setattr(line, "refuse", spy)
    sleeps: list[float] = []
    policy = RetryPolicy()
    client = DecisionClient(
        HttpTransport(url), retry=policy, sleep=waiting(sleeps), rng=random.Random(3)
    )
    server.busy = 3
    posts = server.posts
    assert client.decide(decision()).id == "support-route"
    assert server.posts == posts + 4
    draws = random.Random(3)
    assert len(given) == 3
    first = given[0].token
    assert first is not None
    assert brought == [None, first, first]  # each retry brought the place back
    assert [refusal.token for refusal in given] == [first] * 3  # and kept it
    told = [refusal.retry_after for refusal in given]
    assert sleeps == [hint + policy.retry_after_jitter_s * draws.random() for hint in told]


def test_busy_through_every_attempt_raises_busy_error(server: BusyFirst, url: str) -> None:
    sleeps: list[float] = []
    client = DecisionClient(HttpTransport(url), retry=FAST, sleep=sleeps.append)
    server.busy = 10
    posts = server.posts
    with pytest.raises(BusyError) as raised:
        client.decide(decision())
    assert server.posts == posts + FAST.max_attempts
    assert len(sleeps) == FAST.max_attempts - 1
    assert raised.value.status == 429
    assert raised.value.message.startswith("gave up after 4 attempts over ")
    assert raised.value.message.endswith(
        "(the attempt limit is 4); last answer: busy: 256 requests are queued (SEMIF_MAX_QUEUE=256)"
    )
    assert raised.value.body["retryable"] is True


def test_backoff_is_exponential_then_capped_by_delay_and_budget() -> None:
    policy = RetryPolicy(base_delay_s=0.2, max_delay_s=1.0, max_total_s=30)
    assert [policy.delay_s(n, 0.0, None, 1.0) for n in range(5)] == [0.2, 0.4, 0.8, 1.0, 1.0]
    assert policy.delay_s(3, 0.0, None, 0.0) == 0.0
    assert policy.delay_s(0, 29.5, 2.0, 0.0) == 0.5  # never past the budget
    assert policy.give_up_reason(1, 29.5, 2.0) is not None
    for wrong in ({"max_attempts": 0}, {"max_total_s": -1.0}):
        with pytest.raises(ValueError, match="max_attempts"):
            RetryPolicy(**wrong)


# -- the SageMaker path: real boto3 against the local server --------------------------------


def test_boto3_invoke_endpoint_works_unchanged_against_the_local_server(url: str) -> None:
    answer = runtime_client(url).invoke_endpoint(
        EndpointName="semif-decision",
        ContentType="application/json",
        Body=json.dumps({"decision": decision()}),
    )
    assert answer["ContentType"] == "application/json"
    assert json.loads(answer["Body"].read())["result"]["id"] == "support-route"


def test_container_errors_reach_boto3_as_model_error(url: str) -> None:
    with pytest.raises(botocore.exceptions.ClientError) as raised:
        runtime_client(url).invoke_endpoint(
            EndpointName="semif-decision",
            ContentType="application/json",
            Body=json.dumps({"decision": {}}),
        )
    response = raised.value.response
    assert response["Error"]["Code"] == "ModelError"
    assert response["OriginalStatusCode"] == 400
    assert json.loads(response["OriginalMessage"])["error"] == "decision.id: is required"


@pytest.mark.usefixtures("draining")
def test_client_on_the_sagemaker_path(server: BusyFirst, url: str) -> None:
    """Errors and busy answers through boto3's InvokeEndpoint: the retry token travels back
    in CustomAttributes (the retries would otherwise be newcomers behind their own places)."""
    sleeps: list[float] = []
    client = DecisionClient.for_endpoint("semif-decision", runtime_client=runtime_client(url))
    client = DecisionClient(client.transport, retry=FAST, sleep=waiting(sleeps))
    assert client.decide(decision()).id == "support-route"
    with pytest.raises(EndpointError) as raised:
        client.decide({**decision(), "options": []})
    assert (raised.value.status, raised.value.message) == (
        400,
        "decision.options: has 0 options; allowed 2..16",
    )
    server.busy = 2  # the container's 429 arrives as a ModelError and is retried
    assert client.systemone("s", {"q": {"type": "noul", "instructions": "Yes?"}}).answers
    assert len(sleeps) == 2
    assert min(sleeps) >= 1  # the local SageMaker route keeps the container's Retry-After


def test_wait_for_a_sagemaker_endpoint_reports_progress() -> None:
    control = boto3.client(
        "sagemaker",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",  # dummy credentials: loopback or stubbed only
    )
    stubber = Stubber(control)
    for status in ("Creating", "InService"):
        stubber.add_response("describe_endpoint", _endpoint(status), {"EndpointName": "semif"})
    stubber.add_response("describe_endpoint", _endpoint("Failed"), {"EndpointName": "semif"})
    lines: list[str] = []
    transport = SageMakerTransport(
        "semif", runtime_client=object(), control_client=control, poll_s=0.0
    )
    client = DecisionClient(transport)
    with stubber:
        client.wait_until_ready(timeout_s=60, progress=lines.append)
        with pytest.raises(EndpointError, match="is Failed: image not found"):
            client.wait_until_ready(timeout_s=60)
    assert [line.split(" (")[0] for line in lines] == ["semif: Creating", "semif: InService"]


def _endpoint(status: str) -> dict[str, Any]:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    answer: dict[str, Any] = {
        "EndpointName": "semif",
        "EndpointArn": "arn:aws:sagemaker:us-east-1:123456789012:endpoint/semif",
        "EndpointConfigName": "semif-config",
        "EndpointStatus": status,
        "CreationTime": now,
        "LastModifiedTime": now,
    }
    if status == "Failed":
        answer["FailureReason"] = "image not found"
    return answer


def test_wait_for_a_url_returns_when_ready(url: str) -> None:
    DecisionClient.for_url(url).wait_until_ready(timeout_s=10)


def test_api_key_reaches_a_guarded_local_server(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside SageMaker a key guards /invocations: the client sends it as a bearer token,
    and the CLI takes it from SEMIF_API_KEY (never from argv)."""
    shutil.copy(tiny_gguf, tmp_path / tiny_gguf.name)
    app = create_app(Settings(model_dir=tmp_path, max_tokens=1024, threads=1, api_key="k3y"))
    with live_server(app) as base:
        with pytest.raises(EndpointError) as refused:
            DecisionClient.for_url(base, retry=FAST).decide(decision())
        assert refused.value.status == 401
        result = DecisionClient.for_url(base, retry=FAST, api_key="k3y").decide(decision())
        assert sorted(result.option_ids) == ["account_access", "billing", "sales"]
        monkeypatch.setenv("SEMIF_API_KEY", "k3y")
        assert (
            main(
                [
                    "decide",
                    str(
                        Path(__file__).resolve().parents[2]
                        / "client"
                        / "examples"
                        / "decision.json"
                    ),
                    "--url",
                    base,
                    "--json",
                ]
            )
            == 0
        )


def test_a_prediction_set_reaches_the_typed_result_and_the_cli_line() -> None:
    """The fields a coverage request adds (adapter.decisions), read by the client; a result
    without them keeps None."""
    base = {
        "id": "d",
        "option_ids": ["a", "b", "c"],
        "probabilities": [0.5, 0.3, 0.2],
        "allowed_token_mass": 0.9,
        "input_tokens": 40,
        "prompt_sha256": "0" * 64,
    }
    plain = DecisionResult.from_json(base)
    assert (plain.prediction_set, plain.coverage) == (None, None)
    with_set = DecisionResult.from_json(
        {**base, "prediction_set": ["a", "b"], "set_size": 2, "coverage": 0.9}
    )
    assert (with_set.prediction_set, with_set.coverage) == (["a", "b"], 0.9)
    assert format_decision(with_set).endswith("set at 0.9: {a, b}")
    assert "set at" not in format_decision(plain)
