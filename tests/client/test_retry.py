"""How the client waits on a busy endpoint: Retry-After (header, HTTP-date, JSON body),
full-jitter backoff without one, the total budget, and no retries of refusals, over a real
socket in both transports. A fake clock stands in for time: nothing here sleeps."""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Callable
from email.utils import formatdate
from time import asctime, gmtime, time

import pytest

from client.decision_client import (
    BusyError,
    DecisionClient,
    EndpointError,
    HttpTransport,
    RetryPolicy,
    SageMakerTransport,
    parse_retry_after,
)
from tests.support.scripted_endpoint import (
    OK,
    Answer,
    ScriptedServer,
    aws_error,
    busy,
    model_error,
    scripted_server,
)

REQUEST = {"decision": {"id": "scripted"}}


class FakeTime:
    """A monotonic clock that only sleeping (or a scripted attempt) moves."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Draws(random.Random):
    """Every jitter draw is `unit`, so the expected sleeps are exact numbers."""

    def __init__(self, unit: float) -> None:
        super().__init__()
        self.unit = unit

    def random(self) -> float:
        return self.unit


@pytest.fixture
def fake() -> FakeTime:
    return FakeTime()


@pytest.fixture(autouse=True)
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SageMaker transport talks to the scripted server; boto3 still signs."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def over_http(
    server: ScriptedServer, fake: FakeTime, policy: RetryPolicy, rng: random.Random
) -> DecisionClient:
    return DecisionClient(
        HttpTransport(server.url), retry=policy, sleep=fake.sleep, rng=rng, clock=fake.clock
    )


def over_sagemaker(
    server: ScriptedServer, fake: FakeTime, policy: RetryPolicy, rng: random.Random
) -> DecisionClient:
    """The transport `for_endpoint` builds (its own boto3 client), aimed at the server."""
    transport = SageMakerTransport("semif", region="us-east-1", endpoint_url=server.url)
    return DecisionClient(transport, retry=policy, sleep=fake.sleep, rng=rng, clock=fake.clock)


Connect = Callable[[ScriptedServer, FakeTime, RetryPolicy, random.Random], DecisionClient]


@pytest.fixture(params=[over_http, over_sagemaker], ids=["url", "sagemaker"])
def connect(request: pytest.FixtureRequest) -> Connect:
    transport: Connect = request.param
    return transport


# -- Retry-After --------------------------------------------------------------------------

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("7", 7.0),
        (" 0 ", 0.0),
        (formatdate(NOW + 90, usegmt=True), 90.0),  # IMF-fixdate
        (asctime(gmtime(NOW + 30)), 30.0),  # asctime: no zone, read as GMT
        (formatdate(NOW - 5, usegmt=True), 0.0),  # already past: retry now
        ("1.5", None),  # delta-seconds are whole
        ("-1", None),
        ("soon", None),
        ("", None),
    ],
)
def test_parse_retry_after(value: str, seconds: float | None) -> None:
    assert parse_retry_after(value, NOW) == seconds


@pytest.mark.parametrize("status", [503, 429])
def test_retry_after_is_waited_plus_jitter(fake: FakeTime, status: int) -> None:
    with scripted_server(busy(status, "4"), busy(status, "2"), OK) as server:
        client = over_http(server, fake, RetryPolicy(), Draws(0.5))
        assert client.invoke(REQUEST) == OK.body
    assert fake.sleeps == [4.25, 2.25]  # hint + 0.5 * retry_after_jitter_s
    assert len(server.paths) == 3


def test_retry_after_in_the_body_when_no_header_survives(fake: FakeTime, connect: Connect) -> None:
    """SageMaker drops the container's headers: the JSON body's hint still counts."""
    answer = busy(retry_after_seconds=3)
    sagemaker = connect is over_sagemaker
    with scripted_server(model_error(answer) if sagemaker else answer, OK) as server:
        assert connect(server, fake, RetryPolicy(), Draws(0.0)).invoke(REQUEST) == OK.body
    assert fake.sleeps == [3.0]
    assert server.paths[0] == ("/endpoints/semif/invocations" if sagemaker else "/invocations")


def test_a_retry_brings_back_the_place_its_refusal_gave(fake: FakeTime, connect: Connect) -> None:
    """The refusal's retry_token goes back with the next attempt (a header to a URL,
    CustomAttributes through InvokeEndpoint, which SageMaker forwards as that header); a
    refusal without one, or with a malformed one, sends the next attempt without."""
    answers = [busy(retry_token="place-1"), busy(retry_token="bad token!"), busy(), OK]
    if connect is over_sagemaker:
        answers = [model_error(answer) for answer in answers[:-1]] + [OK]
    with scripted_server(*answers) as server:
        assert connect(server, fake, RetryPolicy(), Draws(0.0)).invoke(REQUEST) == OK.body
    assert server.attributes == [None, "semif-retry-token=place-1", None, None]


def test_the_last_refusals_token_is_on_the_busy_error(fake: FakeTime) -> None:
    policy = RetryPolicy(max_attempts=2)
    with (
        scripted_server(busy(retry_token="first"), busy(retry_token="second")) as server,
        pytest.raises(BusyError) as raised,
    ):
        over_http(server, fake, policy, Draws(0.0)).invoke(REQUEST)
    assert raised.value.retry_token == "second"
    assert server.attributes == [None, "semif-retry-token=first"]


def test_a_valid_header_wins_over_the_body_and_a_bad_one_yields_to_it(fake: FakeTime) -> None:
    header_and_body = busy(retry_after="2", retry_after_seconds=9)
    bad_header = busy(retry_after="soon", retry_after_seconds=5)
    with scripted_server(header_and_body, bad_header, OK) as server:
        over_http(server, fake, RetryPolicy(), Draws(0.0)).invoke(REQUEST)
    assert fake.sleeps == [2.0, 5.0]


def test_a_hint_past_the_budget_gives_up_at_once(fake: FakeTime) -> None:
    """Coming back before the server asked only adds load, so the client stops instead."""
    in_an_hour = busy(retry_after=formatdate(time() + 3600, usegmt=True))
    with scripted_server(in_an_hour) as server, pytest.raises(BusyError) as raised:
        over_http(server, fake, RetryPolicy(), Draws(0.5)).invoke(REQUEST)
    assert (fake.sleeps, len(server.paths)) == ([], 1)
    assert re.fullmatch(
        r"gave up after 1 attempt over 0\.0 s \(the endpoint asked to retry after 3[56]\d\d\.\d s, "
        r"more than the 30\.0 s left of the 30 s retry budget\); last answer: queue full",
        raised.value.message,
    )


def test_jitter_never_sleeps_past_the_budget(fake: FakeTime) -> None:
    policy = RetryPolicy(max_total_s=4.2)
    with scripted_server(busy(retry_after="4")) as server, pytest.raises(BusyError) as raised:
        over_http(server, fake, policy, Draws(0.99)).invoke(REQUEST)
    assert fake.sleeps == [4.2]  # 4 + 0.495 jitter, cut to the budget
    assert raised.value.message == (
        "gave up after 2 attempts over 4.2 s (the 4.2 s retry budget is spent); "
        "last answer: queue full"
    )
    assert raised.value.status == 503
    assert raised.value.retry_after_s == 4.0
    assert isinstance(raised.value.__cause__, BusyError)


# -- backoff without a hint ---------------------------------------------------------------


def test_without_a_hint_backoff_is_exponential_with_full_jitter(
    fake: FakeTime, connect: Connect
) -> None:
    answer = busy()
    if connect is over_sagemaker:
        answer = model_error(answer)
    policy = RetryPolicy(base_delay_s=0.5, max_delay_s=1.5)
    with scripted_server(answer, answer, answer, answer, OK) as server:
        assert connect(server, fake, policy, random.Random(3)).invoke(REQUEST) == OK.body
    draws = random.Random(3)
    caps = [0.5, 1.0, 1.5, 1.5]
    assert fake.sleeps == [cap * draws.random() for cap in caps]
    assert len(server.paths) == 5


def test_the_budget_cuts_the_last_backoff_then_ends_the_call(fake: FakeTime) -> None:
    policy = RetryPolicy(base_delay_s=8, max_delay_s=8, max_total_s=10)
    with scripted_server(busy()) as server, pytest.raises(BusyError) as raised:
        over_http(server, fake, policy, Draws(0.75)).invoke(REQUEST)
    assert fake.sleeps == [6.0, 4.0]
    assert len(server.paths) == 3
    assert raised.value.message.startswith("gave up after 3 attempts over 10.0 s (the 10 s")


def test_time_spent_in_attempts_counts_against_the_budget(fake: FakeTime) -> None:
    """A 503 after waiting out the server's queue deadline takes its time: 8 s here."""
    with scripted_server(busy(retry_after="1")) as server:
        server.on_request = lambda: setattr(fake, "now", fake.now + 8)
        with pytest.raises(BusyError) as raised:
            over_http(server, fake, RetryPolicy(), Draws(0.0)).invoke(REQUEST)
    assert fake.sleeps == [1.0, 1.0, 1.0]
    assert raised.value.message.startswith("gave up after 4 attempts over 35.0 s (the 30 s")


def test_the_attempt_limit_ends_the_call(fake: FakeTime) -> None:
    with scripted_server(busy(retry_after="0")) as server, pytest.raises(BusyError) as raised:
        over_http(server, fake, RetryPolicy(max_attempts=3), Draws(0.0)).invoke(REQUEST)
    assert len(server.paths) == 3
    assert raised.value.message.startswith("gave up after 3 attempts over 0.0 s (the attempt")


# -- never retried ------------------------------------------------------------------------

REFUSALS = [
    Answer(503, {"error": "model is not healthy", "retryable": False}, {"retry-after": "1"}),
    Answer(429, {"error": "quota", "retryable": False}),
    Answer(400, {"error": "decision.id: is required"}, {"retry-after": "1"}),
    Answer(500, {"error": "scoring failed"}),
]


@pytest.mark.parametrize("refusal", REFUSALS, ids=lambda answer: str(answer.status))
def test_refusals_are_never_retried(fake: FakeTime, connect: Connect, refusal: Answer) -> None:
    answer = model_error(refusal) if connect is over_sagemaker else refusal
    with scripted_server(answer, OK) as server, pytest.raises(EndpointError) as raised:
        connect(server, fake, RetryPolicy(), Draws(0.0)).invoke(REQUEST)
    assert raised.type is EndpointError
    assert (raised.value.status, raised.value.message) == (refusal.status, refusal.body["error"])
    assert (len(server.paths), fake.sleeps) == (1, [])


# -- SageMaker's own answers and botocore's retries ---------------------------------------


@pytest.mark.parametrize(
    ("status", "code"),
    [(400, "ThrottlingException"), (503, "ServiceUnavailable"), (429, "ModelNotReadyException")],
)
def test_sagemaker_busy_errors_are_retried_by_the_policy_alone(
    fake: FakeTime, status: int, code: str
) -> None:
    """botocore's standard mode retries throttling and 503s itself (and its `max_attempts`
    1 means one retry): one request per attempt shows the client's boto3 has that off.
    ModelNotReadyException (429) it leaves alone; the policy retries it."""
    with scripted_server(aws_error(status, code, "Rate exceeded")) as server:
        client = over_sagemaker(server, fake, RetryPolicy(max_attempts=3), Draws(0.0))
        with pytest.raises(BusyError) as raised:
            client.invoke(REQUEST)
    assert len(server.paths) == 3
    assert len(fake.sleeps) == 2
    assert raised.value.status == status
    assert raised.value.message.endswith(f"last answer: {code}: Rate exceeded")


# What reaches an InvokeEndpoint caller when the container refuses for load with 429: a
# ModelError (HTTP 424) carrying OriginalStatusCode 429 and the container's body, as for any
# container 4xx/5xx; SageMaker's own ThrottlingException is retried all the same.
OVERLOAD = busy(429, retry_after_seconds=2, retry_token="place-7")


@pytest.mark.parametrize(
    "shape",
    [model_error(OVERLOAD), aws_error(400, "ThrottlingException", "Rate exceeded")],
    ids=["model-error-429", "throttling"],
)
def test_an_overloaded_endpoint_is_retried_in_either_shape(fake: FakeTime, shape: Answer) -> None:
    with scripted_server(shape, OK) as server:
        client = over_sagemaker(server, fake, RetryPolicy(), Draws(0.0))
        assert client.invoke(REQUEST) == OK.body
    container = shape.status == 424  # the ModelError, not SageMaker's own throttling
    # The container's hint and its place in the retry line survive the ModelError.
    assert fake.sleeps == ([2.0] if container else [0.0])
    assert server.attributes == [None, "semif-retry-token=place-7" if container else None]


def test_the_retry_token_goes_back_through_invoke_endpoint(fake: FakeTime) -> None:
    """The same through botocore's Stubber: the 429 ModelError's token is the next call's
    CustomAttributes, checked against InvokeEndpoint's input shape."""
    import boto3
    from botocore.stub import Stubber

    runtime = boto3.client("sagemaker-runtime", region_name="us-east-1")
    body = json.dumps(OVERLOAD.body)
    sent = json.dumps(REQUEST).encode()
    call = {
        "EndpointName": "semif",
        "ContentType": "application/json",
        "Accept": "application/json",
        "Body": sent,
    }
    with Stubber(runtime) as stubber:
        stubber.add_client_error(
            "invoke_endpoint",
            service_error_code="ModelError",
            service_message="Received client error (429) from primary",
            http_status_code=424,
            modeled_fields={"OriginalStatusCode": 429, "OriginalMessage": body},
            expected_params=call,
        )
        stubber.add_response(
            "invoke_endpoint",
            {"Body": io.BytesIO(json.dumps(OK.body).encode())},
            {**call, "CustomAttributes": "semif-retry-token=place-7"},
        )
        client = DecisionClient(
            SageMakerTransport("semif", runtime_client=runtime),
            sleep=fake.sleep,
            rng=Draws(0.0),
            clock=fake.clock,
        )
        assert client.invoke(REQUEST) == OK.body
        stubber.assert_no_pending_responses()
    assert fake.sleeps == [2.0]


def test_runtime_client_and_endpoint_url_exclude_each_other() -> None:
    with pytest.raises(ValueError, match="not both"):
        DecisionClient.for_endpoint("semif", runtime_client=object(), endpoint_url="http://x")


def test_the_client_speaks_the_servers_retry_token_contract() -> None:
    """The client (which imports nothing of the adapter) names the header, the attribute
    and the body field as the server does."""
    from adapter import http
    from adapter.errors import BusyError
    from client import decision_client

    assert decision_client.CUSTOM_ATTRIBUTES_HEADER == http.CUSTOM_ATTRIBUTES_HEADER
    assert decision_client.RETRY_TOKEN_ATTRIBUTE == http.RETRY_TOKEN_ATTRIBUTE
    refused = BusyError("busy", cause="overloaded", retry_token="abc")
    assert decision_client.retry_token_of(refused.body()) == "abc"
