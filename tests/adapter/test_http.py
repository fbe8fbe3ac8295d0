"""The HTTP contract on a real tiny model: every status code, admission and health."""

from __future__ import annotations

import json
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
from adapter.engine import NativeFailureError
from adapter.readout import softmax
from adapter.runtime import Runtime
from adapter.settings import Settings
from model_build.embedded import sha256_of
from model_build.gguf_info import inspect_gguf
from model_build.manifest import BuildInfo, Calibration, Manifest, SourceInfo
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}


def post(client: TestClient, body: Any, **headers: str) -> Any:
    return client.post("/invocations", content=json.dumps(body), headers={**HEADERS, **headers})


def runtime_of(client: TestClient) -> Runtime:
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    assert isinstance(runtime, Runtime)
    return runtime


def test_ping_reports_model_and_backends(tiny_client: TestClient) -> None:
    response = tiny_client.get("/ping")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "model": "tiny.gguf", "backends": ["CPU"]}


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
    assert "no generated tokens" in result["readout"]
    assert "model" not in result  # identity is reported once per response
    assert body["model"]["file"] == "tiny.gguf"
    assert body["model"]["serving"]["max_in_flight"] == 1
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
    assert timing["prefix_tokens"] > 0
    assert timing["suffix_tokens"] > 0
    assert {"prefill_seconds", "suffix_seconds"} <= timing.keys()


def test_prompt_sha_is_stable_and_order_sensitive(tiny_client: TestClient) -> None:
    first = post(tiny_client, {"decision": decision()}).json()["result"]
    again = post(tiny_client, {"decision": decision()}).json()["result"]
    swapped = decision(options=(("billing", "Billing and payment support."), ("a", "Account.")))
    other = post(tiny_client, {"decision": swapped}).json()["result"]
    assert first["prompt_sha256"] == again["prompt_sha256"] != other["prompt_sha256"]
    assert first["probabilities"] == pytest.approx(again["probabilities"], abs=1e-6)


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
        assert post(client, big).status_code == 413

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


def _gate_scoring(runtime: Runtime, gate: threading.Event) -> None:
    service = runtime.service
    assert service is not None
    real_score = service.engine.score

    def gated(*args: Any, **kwargs: Any) -> Any:
        gate.wait(10)
        return real_score(*args, **kwargs)

    service.engine.score = gated  # type: ignore[method-assign]


def test_second_request_while_one_runs_is_503_retryable(tiny_client: TestClient) -> None:
    runtime = runtime_of(tiny_client)
    gate = threading.Event()
    _gate_scoring(runtime, gate)
    first: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: first.update(response=post(tiny_client, {"decision": decision()}))
    )
    worker.start()
    deadline = time.monotonic() + 10
    while runtime.in_flight == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    busy = post(tiny_client, {"decision": decision()})
    ping = tiny_client.get("/ping")  # the event loop stays free while the model works
    gate.set()
    worker.join(10)
    assert busy.status_code == 503
    assert busy.json()["retryable"] is True
    assert busy.headers["retry-after"] == "1"
    assert ping.status_code == 200
    assert first["response"].status_code == 200
    assert runtime.in_flight == 0


def test_invalid_request_does_not_take_a_slot(tiny_client: TestClient) -> None:
    runtime = runtime_of(tiny_client)
    runtime.in_flight = runtime.settings.max_in_flight  # every slot busy
    try:
        assert post(tiny_client, {"decision": {}}).status_code == 400
    finally:
        runtime.in_flight = 0


def test_unexpected_error_is_500_with_request_id(tiny_client: TestClient) -> None:
    service = runtime_of(tiny_client).service
    assert service is not None

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    service.engine.score = broken  # type: ignore[method-assign]
    response = post(tiny_client, {"decision": decision()})
    assert response.status_code == 500
    body = response.json()
    assert body["error"] == "scoring failed"
    assert body["request_id"] == response.headers["x-request-id"]
    assert tiny_client.get("/ping").status_code == 200  # a Python error is not a native one


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


def test_manifest_calibration_is_applied_and_reported(tiny_model_dir: Path) -> None:
    gguf = next(tiny_model_dir.glob("*.gguf"))
    info = inspect_gguf(gguf, file=gguf.name, size=gguf.stat().st_size, sha256=sha256_of(gguf))
    manifest = Manifest(
        source=SourceInfo(uri="s3://bucket/tiny.gguf", revision=None, file=gguf.name),
        gguf=info,
        build=BuildInfo(built_at="2026-11-29T00:00:00Z", builder_version="test"),
        calibration=Calibration(temperature=2.5),
    )
    (tiny_model_dir / "model-manifest.json").write_text(manifest.to_json())
    with serving(Settings(model_dir=tiny_model_dir, threads=2)) as client:
        body = post(client, {"decision": decision()}).json()
    result = body["result"]
    logits = np.array(result["option_logits"])
    assert result["probabilities"] == pytest.approx(list(softmax(logits / 2.5)), abs=1e-9)
    assert body["model"]["calibration"] == {"temperature": 2.5}
