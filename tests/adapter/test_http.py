"""The HTTP contract on a real tiny model: every status code, admission and health."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter import runtime as runtime_module
from adapter.app import create_app
from adapter.core.failures import NativeFailureError
from adapter.http import CUSTOM_ATTRIBUTES_HEADER, RETRY_TOKEN_ATTRIBUTE
from adapter.model_files import calibration_summary
from adapter.prompts import PROMPT_VERSION
from adapter.readout import softmax
from adapter.runtime import Runtime
from adapter.settings import Settings
from model_build.calibration import Calibration
from tests.support.manifests import write_manifest
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}
TIMING_FIELDS = {
    "input_tokens",
    "reused_tokens",
    "evaluated_tokens",
    "pad_tokens",
    "queue_seconds",
    "scoring_seconds",
    "total_seconds",
    "passes",
    "batch_requests",
    "batch_prompts",
}


def post(client: TestClient, body: Any, **headers: str) -> Any:
    return client.post("/invocations", content=json.dumps(body), headers={**HEADERS, **headers})


def runtime_of(client: TestClient) -> Runtime:
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    assert isinstance(runtime, Runtime)
    return runtime


def test_ping_reports_model_backends_and_the_kv_cache(tiny_client: TestClient) -> None:
    response = tiny_client.get("/ping")
    assert response.status_code == 200
    body = response.json()
    assert (body["status"], body["model"], body["backends"]) == ("ok", "tiny.gguf", ["CPU"])
    serving = body["serving"]
    assert serving["kv_streams"] * serving["stream_cells"] > 0
    assert serving["kv_cache_mib"] > 0


def test_single_decision_contract(tiny_client: TestClient) -> None:
    response = post(tiny_client, {"decision": decision()}, **{"x-request-id": "req-1"})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-1"
    body = response.json()
    result = body["result"]
    assert result["id"] == "support-route"
    assert result["option_ids"] == ["account_access", "billing", "sales"]
    assert len(result["probabilities"]) == len(result["option_logits"]) == 3
    assert abs(sum(result["probabilities"]) - 1.0) < 1e-6
    assert 0.0 < result["allowed_token_mass"] <= 1.0
    assert len(result["prompt_sha256"]) == 64
    assert result["prompt_version"] == "semif-direct-options/1"
    assert (result["readout"], result["normalization"]) == ("letters", None)
    assert "no generated tokens" in result["readout_detail"]
    assert "model" not in result  # identity is reported once per response
    assert body["model"]["file"] == "tiny.gguf"
    serving_info = body["model"]["serving"]
    assert "max_in_flight" not in serving_info
    assert serving_info["max_queue"] == 256
    assert serving_info["queue_timeout_seconds"] == 20.0
    assert serving_info["request_timeout_seconds"] == 50.0
    assert serving_info["max_batch_requests"] == 32
    assert serving_info["max_request_tokens"] == 16_384
    # SEMIF_KV_MEMORY=auto: the tiny model's streams are tiny, so all 32 fit its floor.
    assert serving_info["kv_memory"] == "auto"
    assert serving_info["kv_streams"] == 32
    assert 0 < serving_info["kv_cache_mib"] <= serving_info["kv_budget_mib"]
    assert set(body["timing"]) == TIMING_FIELDS
    assert body["timing"]["passes"] >= 1
    assert body["timing"]["batch_requests"] == 1  # alone on the server
    assert result["timing"]["prompts"] == 1
    assert (
        result["timing"]["evaluated_tokens"] + result["timing"]["reused_tokens"]
        == result["input_tokens"]
    )
    assert (
        body["timing"]["evaluated_tokens"] + body["timing"]["reused_tokens"]
        == result["input_tokens"]
    )
    assert body["request_id"] == "req-1"


def test_shared_decisions_keep_request_order(tiny_client: TestClient) -> None:
    decisions = [
        decision("route"),
        decision("urgent", question="Is it urgent?", options=(("yes", "Yes"), ("no", "No"))),
    ]
    body = post(tiny_client, {"decisions": decisions}).json()
    assert [r["id"] for r in body["results"]] == ["route", "urgent"]
    assert body["results"][1]["option_ids"] == ["yes", "no"]
    timing = body["timing"]
    assert set(timing) == TIMING_FIELDS
    results = body["results"]
    assert timing["input_tokens"] == sum(r["input_tokens"] for r in results)
    # The two prompts share the state's prefix: it is evaluated once for the request.
    assert 0 < timing["evaluated_tokens"] < timing["input_tokens"]
    assert timing["batch_prompts"] >= sum(r["timing"]["prompts"] for r in results) // max(
        timing["passes"], 1
    )
    assert timing["batch_requests"] == 1
    assert timing["total_seconds"] >= timing["queue_seconds"] + timing["scoring_seconds"] - 1e-3


def test_prompt_sha_is_stable_and_order_sensitive(tiny_client: TestClient) -> None:
    first = post(tiny_client, {"decision": decision()}).json()["result"]
    again = post(tiny_client, {"decision": decision()}).json()["result"]
    swapped = decision(options=(("billing", "Billing and payment support."), ("a", "Account.")))
    other = post(tiny_client, {"decision": swapped}).json()["result"]
    assert first["prompt_sha256"] == again["prompt_sha256"] != other["prompt_sha256"]
    assert first["probabilities"] == again["probabilities"]


def test_validation_error_is_400_with_path(tiny_client: TestClient) -> None:
    bad = decision(options=(("a", "A"), ("b", "B"), ("a", "C")))
    response = post(tiny_client, {"decision": bad})
    assert response.status_code == 400
    assert response.json()["error"] == 'decision.options[2].id: duplicate "a"'


def test_invalid_json_is_400(tiny_client: TestClient) -> None:
    response = tiny_client.post("/invocations", content=b"{nope", headers=HEADERS)
    assert response.status_code == 400
    assert response.json()["error"].startswith("body: invalid JSON")
    nan = tiny_client.post("/invocations", content=b'{"decision": NaN}', headers=HEADERS)
    assert nan.status_code == 400
    deep = tiny_client.post("/invocations", content=b"[" * 200_000, headers=HEADERS)
    assert deep.status_code == 400
    assert deep.json()["error"] == "body: invalid JSON (nested too deeply)"


def test_non_json_content_type_is_415(tiny_client: TestClient) -> None:
    response = tiny_client.post("/invocations", content=b"{}", headers={"content-type": "text/csv"})
    assert response.status_code == 415
    assert "application/json" in response.json()["error"]


def test_unknown_path_404_and_wrong_method_405(tiny_client: TestClient) -> None:
    assert tiny_client.get("/nope").status_code == 404
    assert tiny_client.get("/nope").json() == {"error": "Not Found"}
    response = tiny_client.get("/invocations")
    assert response.status_code == 405
    assert response.json() == {"error": "Method Not Allowed"}


def test_body_over_limit_is_413_declared_or_streamed(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_body_bytes=2048, threads=2)
    with serving(settings) as client:
        big = {"decision": decision(state="x" * 4000)}
        declared = post(client, big)
        assert declared.status_code == 413
        # The body was not read: the connection cannot carry another request.
        assert declared.headers["connection"] == "close"

        def chunks(payload: bytes) -> Iterator[bytes]:
            yield payload  # no content-length: the limit must hold while streaming

        streamed = client.post(
            "/invocations", content=chunks(json.dumps(big).encode()), headers=HEADERS
        )
        assert streamed.status_code == 413
        assert "SEMIF_MAX_BODY_BYTES" in streamed.json()["error"]


def test_prompt_over_token_limit_is_400_never_truncated(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=256, threads=2)
    with serving(settings) as client:
        response = post(client, {"decision": decision(state="word " * 100)})
        assert response.status_code == 400
        message = response.json()["error"]
        assert message.startswith("decision: prompt is ")
        assert "the limit is 256 (SEMIF_MAX_TOKENS)" in message
        shared = [decision("a"), decision("b", state="word " * 100)]
        shared[0]["state"] = shared[1]["state"]
        response = post(client, {"decisions": shared})
        assert response.json()["error"].startswith("decisions[0]: prompt is ")


def _gate_scoring(runtime: Runtime, gate: threading.Event) -> threading.Event:
    """Hold every scoring pass until `gate` is set; the returned event says one started."""
    service = runtime.service
    assert service is not None
    real_score = service.engine.score
    entered = threading.Event()

    def gated(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(10)
        return real_score(*args, **kwargs)

    service.engine.score = gated  # type: ignore[method-assign]
    return entered


def test_a_full_queue_is_429_retryable_with_retry_after(tiny_model_dir: Path) -> None:
    """With SEMIF_MAX_QUEUE=1 and one request held in its pass, the queue is full: the next
    request is refused at once with a 429 (load, not failure) whose hint is in the header and body,
    with a place in the retry line that its retry keeps by sending the token back (in the
    header SageMaker forwards CustomAttributes as, beside other attributes)."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_queue=1)
    with serving(settings) as client:
        runtime = runtime_of(client)
        assert runtime.service is not None
        gate = threading.Event()
        entered = _gate_scoring(runtime, gate)
        first: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: first.update(response=post(client, {"decision": decision()}))
        )
        worker.start()
        try:
            assert entered.wait(10)
            assert runtime.service.scheduler.waiting == 1
            busy = post(client, {"decision": decision()})
            token = busy.json()["retry_token"]
            attributes = f"trace=7; {RETRY_TOKEN_ATTRIBUTE}={token}"
            again = post(client, {"decision": decision()}, **{CUSTOM_ATTRIBUTES_HEADER: attributes})
            ping = client.get("/ping")  # the event loop stays free while the model works
        finally:
            gate.set()
            worker.join(10)
        after = post(client, {"decision": decision()})  # the queue drained: admitted again
    assert busy.status_code == 429
    body = busy.json()
    assert body["retryable"] is True
    assert "SEMIF_MAX_QUEUE=1" in body["error"]
    assert body["error"].startswith("busy: ")
    assert isinstance(body["retry_after_seconds"], int)
    assert 1 <= body["retry_after_seconds"] <= 30
    assert busy.headers["retry-after"] == str(body["retry_after_seconds"])
    assert re.fullmatch(r"[A-Za-z0-9_-]{16}", token)
    assert again.status_code == 429
    assert again.json()["retry_token"] == token  # the same place, not a new one behind it
    assert ping.status_code == 200
    assert first["response"].status_code == 200
    assert after.status_code == 200
    assert runtime.in_flight == 0


@pytest.mark.parametrize(
    "attributes",
    [f"{RETRY_TOKEN_ATTRIBUTE}=", f"{RETRY_TOKEN_ATTRIBUTE}=a b", "semif-retry-token=" + "x" * 65],
)
def test_a_malformed_retry_token_is_400_naming_the_header(
    tiny_client: TestClient, attributes: str
) -> None:
    response = post(tiny_client, {"decision": decision()}, **{CUSTOM_ATTRIBUTES_HEADER: attributes})
    assert response.status_code == 400
    assert response.json()["field"] == f"headers.{CUSTOM_ATTRIBUTES_HEADER}"
    assert RETRY_TOKEN_ATTRIBUTE in response.json()["error"]


def test_other_custom_attributes_and_an_unknown_token_are_a_newcomers_request(
    tiny_client: TestClient,
) -> None:
    """A token the line does not hold (forgotten, or from another instance) is no error:
    the request is a newcomer's, and is served when there is room."""
    for attributes in ("trace=7", f"trace=7,{RETRY_TOKEN_ATTRIBUTE}=unknown-place"):
        response = post(
            tiny_client, {"decision": decision()}, **{CUSTOM_ATTRIBUTES_HEADER: attributes}
        )
        assert response.status_code == 200


def test_invalid_request_never_enters_the_queue(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)
    with serving(settings) as client:
        service = runtime_of(client).service
        assert service is not None
        submitted: list[int] = []
        real_submit = service.scheduler.submit

        def spy(*args: Any, **kwargs: Any) -> Any:
            submitted.append(1)
            return real_submit(*args, **kwargs)

        service.scheduler.submit = spy  # type: ignore[method-assign]
        assert post(client, {"decision": {}}).status_code == 400
        too_long = post(client, {"decision": decision(state="word " * 1200)})
        assert too_long.status_code == 400
        assert "SEMIF_MAX_TOKENS" in too_long.json()["error"]
        assert submitted == []
        assert service.scheduler.waiting == 0
        valid = post(client, {"decision": decision()})
        assert valid.status_code == 200, valid.json()
        assert submitted == [1]


def test_unexpected_error_is_500_with_request_id(tiny_model_dir: Path) -> None:
    # A short request deadline: a worker that never answers shows as a 429 in 5 s, not 50.
    settings = Settings(
        model_dir=tiny_model_dir,
        max_tokens=1024,
        threads=2,
        queue_timeout_seconds=5.0,
        request_timeout_seconds=5.0,
    )
    with serving(settings) as client:
        service = runtime_of(client).service
        assert service is not None
        real_score = service.engine.score

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

        service.engine.score = broken  # type: ignore[method-assign]
        response = post(client, {"decision": decision()})
        service.engine.score = real_score  # type: ignore[method-assign]
        ping = client.get("/ping")
        after = post(client, {"decision": decision()})
    assert response.status_code == 500
    body = response.json()
    assert body["error"] == "scoring failed"
    assert body["request_id"] == response.headers["x-request-id"]
    assert ping.status_code == 200  # a Python error is not a native one
    assert after.status_code == 200  # and the scheduler's worker survives it


def test_native_failure_turns_ping_unhealthy(tiny_client: TestClient) -> None:
    service = runtime_of(tiny_client).service
    assert service is not None

    def crashed(*args: Any, **kwargs: Any) -> Any:
        raise NativeFailureError("llama_decode failed with status -3")

    service.engine.score = crashed  # type: ignore[method-assign]
    assert post(tiny_client, {"decision": decision()}).status_code == 500
    ping = tiny_client.get("/ping")
    assert ping.status_code == 503
    assert ping.json() == {"status": "unhealthy", "error": "llama_decode failed with status -3"}
    refused = post(tiny_client, {"decision": decision()})
    assert refused.status_code == 503
    assert refused.json()["retryable"] is False


def test_ping_is_503_while_loading(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_load = runtime_module.load_service

    def slow_load(settings: Settings, *args: Any) -> Any:
        release.wait(10)
        return real_load(settings, *args)

    monkeypatch.setattr(runtime_module, "load_service", slow_load)
    with TestClient(create_app(Settings(model_dir=tiny_model_dir, threads=2))) as client:
        loading = client.get("/ping")
        early = post(client, {"decision": decision()})
        release.set()
        deadline = time.monotonic() + 10
        while client.get("/ping").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        ready = client.get("/ping")
    assert (loading.status_code, loading.json()["status"]) == (503, "loading")
    assert early.status_code == 503
    assert early.json()["retryable"] is True
    assert ready.status_code == 200


def test_failed_load_is_reported_by_ping(tmp_path: Path) -> None:
    failures: list[str] = []
    app = create_app(Settings(model_dir=tmp_path), on_load_failure=failures.append)
    with TestClient(app) as client:
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        ping = client.get("/ping")
    assert ping.status_code == 503
    assert ping.json()["status"] == "failed"
    assert "found 0: none" in failures[0]


CALIBRATION = Calibration(
    prompt_version=PROMPT_VERSION,
    option_order="canonical",
    temperatures={"choice": 2.5},
    tasks_sha256="a" * 64,
)


def test_manifest_calibration_is_applied_and_reported(tiny_model_dir: Path) -> None:
    write_manifest(tiny_model_dir, CALIBRATION)
    with serving(Settings(model_dir=tiny_model_dir, threads=2)) as client:
        body = post(client, {"decision": decision()}).json()
    result = body["result"]
    logits = np.array(result["option_logits"])
    assert result["probabilities"] == pytest.approx(list(softmax(logits / 2.5)), abs=1e-9)
    assert body["model"]["calibration"] == calibration_summary(CALIBRATION)
    assert result["calibration"]["applied"] is True


def test_the_request_log_line_says_how_it_queued_and_rode(
    tiny_client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="adapter.requests"):
        assert post(tiny_client, {"decision": decision()}).status_code == 200
    requests = [record for record in caplog.records if record.name == "adapter.requests"]
    line = json.loads(requests[-1].getMessage())
    assert line["status"] == 200
    assert line["batch_requests"] >= 1
    assert line["passes"] == 1
    assert 0 <= line["queue_seconds"] <= line["seconds"]
    assert line["evaluated_tokens"] + line["reused_tokens"] == line["input_tokens"]
