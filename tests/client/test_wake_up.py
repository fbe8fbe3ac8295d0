"""Calls to an endpoint that scaled to zero (issue 41): SageMaker's answer to a call that
finds its inference component without a copy is told apart from a failure
(ScaledToZeroError), raised at once without a wake-up budget and waited out with one; the
call names the component (InferenceComponentName, checked against InvokeEndpoint's input
shape by botocore's Stubber); and a real server started late, as a copy is, behind a
loopback SageMaker that refuses until it is up, is reached through the wake-up."""

from __future__ import annotations

import io
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from botocore.stub import Stubber
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from adapter.app import create_app
from adapter.settings import Settings
from client.cli import main
from client.decision_client import (
    DecisionClient,
    EndpointError,
    SageMakerTransport,
    ScaledToZeroError,
    WakeUp,
    state_first,
)
from client.error_mapping import NO_CAPACITY_MESSAGE, error_from_client_error
from tests.client.test_retry import FakeTime
from tests.support.live_server import live_server
from tests.support.serving import REPO, decision

# SageMaker's message, whole (client.error_mapping cites where it is from).
NO_CAPACITY = (
    f"{NO_CAPACITY_MESSAGE}. ApplicationAutoScaling may be in-progress (if configured) or try "
    "to increase the capacity by invoking UpdateInferenceComponentRuntimeConfig API."
)
COMPONENT = "semif-dev-decision-model"
REQUEST = {"decision": decision("route")}


@pytest.fixture(autouse=True)
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def test_the_wait_doubles_up_to_its_cap_and_ends_with_the_budget() -> None:
    wake = WakeUp(100, first_delay_s=5, max_delay_s=30)
    assert [wake.delay_s(n, 0) for n in range(5)] == [5, 10, 20, 30, 30]
    assert wake.delay_s(3, 95) == 5  # never past the budget
    assert wake.delay_s(0, 100) is None
    with pytest.raises(ValueError, match=">= 0"):
        WakeUp(-1)


def test_no_capacity_is_told_apart_from_other_validation_errors() -> None:
    def answer(message: str) -> dict[str, Any]:
        return {
            "Error": {"Code": "ValidationError", "Message": message},
            "ResponseMetadata": {"HTTPStatusCode": 400},
        }

    zero = error_from_client_error(answer(NO_CAPACITY))
    assert isinstance(zero, ScaledToZeroError)
    assert zero.status == 400
    assert "scaled to zero" in zero.message
    other = error_from_client_error(answer("1 validation error detected: EndpointName"))
    assert type(other) is EndpointError


def _stubbed(stubber: Stubber, refusals: int, body: dict[str, Any]) -> None:
    call = {
        "EndpointName": "semif-dev-decision",
        "ContentType": "application/json",
        "Accept": "application/json",
        "Body": json.dumps(state_first(REQUEST)).encode(),
        "InferenceComponentName": COMPONENT,
    }
    for _ in range(refusals):
        stubber.add_client_error(
            "invoke_endpoint",
            service_error_code="ValidationError",
            service_message=NO_CAPACITY,
            http_status_code=400,
            expected_params=call,
        )
    stubber.add_response("invoke_endpoint", {"Body": io.BytesIO(json.dumps(body).encode())}, call)


def _client(runtime: Any, fake: FakeTime, wake_up: WakeUp | None, heard: list[float]) -> Any:
    transport = SageMakerTransport(
        "semif-dev-decision", runtime_client=runtime, inference_component=COMPONENT
    )
    return DecisionClient(
        transport, sleep=fake.sleep, clock=fake.clock, wake_up=wake_up, on_wait=heard.append
    )


def test_a_wake_up_budget_carries_a_call_through_the_copys_start() -> None:
    """Three refusals, then the copy answers: the client waited 5, 10 and 20 s, telling
    its caller each time how long it had waited, and the call through the component
    returns the answer."""
    runtime = boto3.client("sagemaker-runtime", region_name="us-east-1")
    fake, heard = FakeTime(), list[float]()
    with Stubber(runtime) as stubber:
        _stubbed(stubber, 3, {"ok": True})
        client = _client(runtime, fake, WakeUp(600), heard)
        assert client.invoke(REQUEST) == {"ok": True}
        stubber.assert_no_pending_responses()
    assert fake.sleeps == [5, 10, 20]
    assert heard == [0, 5, 15]


def test_without_a_budget_the_call_says_at_once_that_the_endpoint_sleeps() -> None:
    runtime = boto3.client("sagemaker-runtime", region_name="us-east-1")
    fake, heard = FakeTime(), list[float]()
    with Stubber(runtime) as stubber:
        _stubbed(stubber, 1, {"ok": True})
        with pytest.raises(ScaledToZeroError, match=r"scaled to zero.*wake-up budget"):
            _client(runtime, fake, None, heard).invoke(REQUEST)
    assert (fake.sleeps, heard) == ([], [])


def test_a_spent_budget_says_how_long_it_waited() -> None:
    runtime = boto3.client("sagemaker-runtime", region_name="us-east-1")
    fake = FakeTime()
    with Stubber(runtime) as stubber:
        _stubbed(stubber, 3, {"ok": True})
        client = _client(runtime, fake, WakeUp(12), [])
        with pytest.raises(ScaledToZeroError, match=r"still no copy after 12 s \(wake-up budget"):
            client.invoke(REQUEST)
    assert fake.sleeps == [5, 7]


class _SleepingEndpoint:
    """A loopback SageMaker for one endpoint whose component has no copy: InvokeEndpoint
    is refused as SageMaker refuses it until a copy (a real serve) is up, then passed to
    it. `components` records the InferenceComponentName of each call."""

    def __init__(self) -> None:
        self.copy_url: str | None = None
        self.components: list[str | None] = []

    async def invoke(self, request: Request) -> Response:
        self.components.append(request.headers.get("x-amzn-sagemaker-inference-component"))
        if self.copy_url is None:
            return JSONResponse(
                {"message": NO_CAPACITY}, 400, {"x-amzn-errortype": "ValidationError"}
            )
        name = request.path_params["name"]
        async with httpx.AsyncClient(timeout=60) as copy:
            forwarded = await copy.post(
                f"{self.copy_url}/endpoints/{name}/invocations",
                content=await request.body(),
                headers={"content-type": request.headers["content-type"]},
            )
        # The copy's answer as SageMaker passes it on: its body and content type (its own
        # framing headers belong to its connection, not this one).
        return Response(
            forwarded.content,
            forwarded.status_code,
            media_type=forwarded.headers.get("content-type"),
        )


@pytest.fixture
def sleeping(tiny_gguf: Path, tmp_path: Path) -> Iterator[tuple[str, _SleepingEndpoint]]:
    """The loopback SageMaker, and a real serve that starts a second after the first call
    finds no copy (as a copy does, minutes later)."""
    endpoint = _SleepingEndpoint()
    shutil.copy(tiny_gguf, tmp_path / tiny_gguf.name)
    app = create_app(Settings(model_dir=tmp_path, max_tokens=1024, threads=1))
    stop = threading.Event()

    def start_copy() -> None:
        while not endpoint.components:
            if stop.wait(0.05):
                return
        stop.wait(1.0)
        with live_server(app) as url:
            endpoint.copy_url = url
            stop.wait()

    starter = threading.Thread(target=start_copy, daemon=True)
    starter.start()

    async def ping(request: Request) -> Response:
        return JSONResponse({"status": "ok"})  # the endpoint is InService, without a copy

    gateway = Starlette(
        routes=[
            Route("/ping", ping),
            Route("/endpoints/{name}/invocations", endpoint.invoke, methods=["POST"]),
        ]
    )
    try:
        with live_server(gateway, timeout_s=10) as url:
            yield url, endpoint
    finally:
        stop.set()
        starter.join(30)


def test_a_server_started_late_is_reached_through_the_wake_up(
    sleeping: tuple[str, _SleepingEndpoint],
) -> None:
    url, endpoint = sleeping
    heard: list[float] = []
    client = DecisionClient.for_endpoint(
        "semif-dev-decision",
        region="us-east-1",
        endpoint_url=url,
        inference_component=COMPONENT,
        wake_up=WakeUp(60, first_delay_s=0.2, max_delay_s=0.5),
        on_wait=heard.append,
    )
    result = client.decide(decision("route"))
    assert result.id == "route"
    assert heard  # it waited for the copy
    assert set(endpoint.components) == {COMPONENT}
    assert len(endpoint.components) == len(heard) + 1


def test_semif_waits_with_a_line_or_says_the_endpoint_sleeps(
    sleeping: tuple[str, _SleepingEndpoint], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = sleeping
    target = ["--endpoint-name", "semif-dev-decision", "--endpoint-url", url, "--region",
              "us-east-1", "--inference-component", COMPONENT]  # fmt: skip
    example = str(REPO / "client" / "examples" / "decision.json")
    assert main(["decide", example, *target]) == 1
    assert "scaled to zero" in capsys.readouterr().err
    assert main(["decide", example, *target, "--wake-up-s", "120"]) == 0
    captured = capsys.readouterr()
    assert f"{COMPONENT} scaled to zero: waiting for a copy to start (0 s)" in captured.err
    assert "account_access" in captured.out
