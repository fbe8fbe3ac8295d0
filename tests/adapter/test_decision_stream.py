"""Streamed decisions (`Accept: application/jsonlines` on the decision API: adapter.handlers
.decide_streamed) on the real server and the tiny models: a line per decision as soon as it
is scored, the first after a pass of its own, then the closing line; the results are the
whole answer's bit for bit on every memory kind and in every option order; errors before
the first line are the usual JSON answers, after it a last error line; a client that
leaves frees the scheduler."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from adapter.app import create_app
from adapter.core.failures import CapacityError
from adapter.settings import Settings
from tests.support.live_server import live_server, runtime_of
from tests.support.serving import JSON_HEADERS, decision, post_ok, serving

STREAM_HEADERS = {**JSON_HEADERS, "accept": "application/jsonlines"}
STATE = "Order 1182: the customer was charged twice and the parcel has not arrived."
QUESTIONS = [
    "Which queue should handle this request?",
    "Which team owns the follow-up?",
    "Where should the ticket go first?",
    "Who should answer the customer?",
]


def shared(count: int, **policy: Any) -> dict[str, Any]:
    """A shared-state request of `count` decisions about STATE."""
    asked = [
        decision(f"d{index}", STATE, QUESTIONS[index % len(QUESTIONS)] + f" (case {index})")
        for index in range(count)
    ]
    return {"decisions": asked, **policy}


def stream_lines(client: TestClient, body: Any, **headers: str) -> list[dict[str, Any]]:
    response = client.post(
        "/invocations", content=json.dumps(body), headers={**STREAM_HEADERS, **headers}
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/jsonlines")
    return [json.loads(text) for text in response.text.splitlines()]


def without_timing(result: dict[str, Any]) -> dict[str, Any]:
    """A result but its per-result timing: what its prompts found resident depends on how
    the request was cut into passes, not on what was decided."""
    return {key: value for key, value in result.items() if key != "timing"}


@pytest.mark.parametrize("option_order", ["as_given", "canonical", "debiased"])
def test_streamed_results_are_the_whole_answers(
    tiny_any_gguf: Path, tmp_path: Path, option_order: str
) -> None:
    """Every decision once, by its index; the first line is the first decision, scored in a
    pass of its own; then the closing line; and each result equal, bit for bit, to the same
    request answered whole."""
    shutil.copy(tiny_any_gguf, tmp_path / tiny_any_gguf.name)
    body = shared(6, option_order=option_order)
    with serving(Settings(model_dir=tmp_path, max_tokens=1024, threads=2)) as client:
        whole = post_ok(client, body)
        lines = stream_lines(client, body)
    *answers, closing = lines
    assert answers[0]["index"] == 0
    assert sorted(line["index"] for line in answers) == list(range(6))
    by_index = {line["index"]: line["result"] for line in answers}
    for index, result in enumerate(whole["results"]):
        assert without_timing(by_index[index]) == without_timing(result)
        assert by_index[index]["id"] == f"d{index}"
    assert closing["done"] is True
    assert closing["model"] == whole["model"]
    assert closing["request_id"]
    assert closing["timing"]["passes"] > 1  # the first decision's pass was its own


def test_a_single_decision_streams_one_line_and_the_closing_one(tiny_client: TestClient) -> None:
    body = {"decision": decision("one"), "audit_id": "case-1"}
    whole = post_ok(tiny_client, body)
    (answer, closing) = stream_lines(tiny_client, body)
    assert answer["index"] == 0
    assert without_timing(answer["result"]) == without_timing(whole["result"])
    assert closing["done"] is True


def test_the_sagemaker_forwarded_accept_asks_for_a_stream_too(tiny_client: TestClient) -> None:
    lines = stream_lines(
        tiny_client, shared(2), accept="*/*", **{"x-amzn-sagemaker-accept": "application/jsonlines"}
    )
    assert [line.get("done") for line in lines] == [None, None, True]


def test_errors_before_the_first_line_are_the_usual_json_answers(tiny_client: TestClient) -> None:
    response = tiny_client.post(
        "/invocations",
        content=json.dumps({"decisions": [decision("a"), decision("a")]}),
        headers=STREAM_HEADERS,
    )
    assert response.status_code == 400
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["field"].startswith("decisions")


def test_a_failure_after_the_first_line_ends_the_stream_with_an_error_line(
    tiny_client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The KV cache gives out in the second pass: the first decision's line was sent, so the
    stream ends with a last line carrying the 503's status and fields instead of the
    closing line, logged as the 503 it is; the admission is given back."""
    runtime = runtime_of(tiny_client.app)
    service = runtime.service
    assert service is not None
    real_score = service.engine.score
    passes = 0

    def failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal passes
        passes += 1
        if passes == 2:
            raise CapacityError("no KV cache room for the rest of the batch")
        return real_score(*args, **kwargs)

    service.engine.score = failing  # type: ignore[method-assign]
    try:
        with caplog.at_level(logging.INFO, logger="adapter.requests"):
            lines = stream_lines(tiny_client, shared(4))
    finally:
        service.engine.score = real_score  # type: ignore[method-assign]
    first, error = lines
    assert first["index"] == 0
    assert error["status"] == 503
    assert error["error"] == "no KV cache room for the rest of the batch"
    assert error["retryable"] is True
    assert error["request_id"]
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "adapter.requests"]
    assert [(line["status"], line["streamed"]) for line in logged] == [(503, True)]
    assert runtime.in_flight == 0
    assert stream_lines(tiny_client, shared(2))[-1]["done"] is True


def test_the_records_and_metrics_of_a_stream_are_the_whole_answers(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, audit="digest")
    with serving(settings) as client:
        lines = stream_lines(client, {**shared(3), "audit_id": "ticket-9"})
    records = [json.loads(text)["audit"] for text in capsys.readouterr().out.splitlines()]
    assert [record["decision_id"] for record in records] == ["d0", "d1", "d2"]
    assert {record["audit_id"] for record in records} == {"ticket-9"}
    by_index = {line["index"]: line["result"] for line in lines[:-1]}
    assert [record["probabilities"] for record in records] == [
        by_index[index]["probabilities"] for index in range(3)
    ]


def test_a_client_that_leaves_mid_stream_frees_the_scheduler(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a real socket: the client reads the first line of a long request and closes; the
    rest of the work is cancelled, the admission given back, the next request answered, and
    the log has a 499 and no 5xx."""
    app = create_app(Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=1))
    with caplog.at_level(logging.INFO, logger="adapter.requests"), live_server(app) as url:
        runtime = runtime_of(app)
        body = shared(16, option_order="debiased")
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{url}/invocations", json=body, headers=STREAM_HEADERS) as got,
        ):
            assert got.status_code == 200
            first = json.loads(next(got.iter_lines()))
            assert first["index"] == 0
        answered = httpx.post(f"{url}/invocations", json={"decision": decision()}, timeout=60)
        assert answered.status_code == 200
        assert runtime.in_flight == 0
    statuses = [
        json.loads(r.getMessage())["status"] for r in caplog.records if r.name == "adapter.requests"
    ]
    assert statuses == [499, 200]
