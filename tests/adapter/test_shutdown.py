"""Graceful shutdown has a bound (issue 10, item 7): admission stops at once, in-flight work
finishes within the grace period or is cancelled at its next decode, then the model is freed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from adapter.core.generation import GenerationRun
from adapter.decisions import decide
from adapter.errors import UnavailableError
from adapter.schema import parse_decision_body
from adapter.settings import Settings
from tests.support.live_server import runtime_of
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400}


def slow_tokens(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make every generated token take `seconds`, so a chat runs long enough to interrupt."""
    real = GenerationRun.step

    def slow(run: GenerationRun) -> bool:
        time.sleep(seconds)
        return real(run)

    monkeypatch.setattr(GenerationRun, "step", slow)
    monkeypatch.setattr(
        "adapter.core.vocab.Vocabulary.is_end", lambda vocab, token: False
    )  # never stop early: the chat would otherwise end on its own


def test_shutdown_stops_admission_and_cancels_in_flight_work_after_the_grace(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(model_dir=tiny_model_dir, threads=1, max_tokens=1024, max_chat_tokens=400)
    with serving(settings) as client:
        runtime = runtime_of(client.app)
        assert runtime.service is not None
        slow_tokens(monkeypatch, 0.02)  # 400 tokens: 8 s uncancelled
        answers: dict[str, Any] = {}

        def chat() -> None:
            started = time.monotonic()
            answers["chat"] = client.post(
                "/v1/chat/completions", content=json.dumps(CHAT), headers=HEADERS
            )
            answers["seconds"] = time.monotonic() - started

        worker = threading.Thread(target=chat)
        worker.start()
        deadline = time.monotonic() + 10
        while runtime.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        runtime.begin_shutdown(0.3)
        refused = client.post(
            "/invocations", content=json.dumps({"decision": decision()}), headers=HEADERS
        )
        ping = client.get("/ping")
        worker.join(10)
    assert (refused.status_code, refused.json()["retryable"]) == (503, True)
    assert refused.json()["error"] == "server is shutting down"
    assert ping.status_code == 503
    assert ping.json()["status"] == "stopping"
    cancelled = answers["chat"]
    assert cancelled.status_code == 503
    assert cancelled.json()["retryable"] is True
    assert "shutting down" in cancelled.json()["error"]
    assert answers["seconds"] < 3  # the grace (0.3 s) plus one token, not 8 s
    assert runtime.service.health.healthy  # a cancellation is not a native failure


def test_in_flight_work_within_the_grace_finishes_normally(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(model_dir=tiny_model_dir, threads=1, max_tokens=1024, max_chat_tokens=400)
    with serving(settings) as client:
        runtime = runtime_of(client.app)
        assert runtime.service is not None
        slow_tokens(monkeypatch, 0.001)
        answers: dict[str, Any] = {}
        body = json.dumps({**CHAT, "max_tokens": 50})
        worker = threading.Thread(
            target=lambda: answers.update(
                chat=client.post("/v1/chat/completions", content=body, headers=HEADERS)
            )
        )
        worker.start()
        deadline = time.monotonic() + 10
        while runtime.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        runtime.begin_shutdown(10)
        worker.join(10)
    assert answers["chat"].status_code == 200
    assert answers["chat"].json()["usage"]["completion_tokens"] == 50


def test_close_stops_the_scheduler_before_freeing_the_model(tiny_model_dir: Path) -> None:
    with serving(Settings(model_dir=tiny_model_dir, threads=1)) as client:
        service = runtime_of(client.app).service
        assert service is not None
        assert service.scheduler._thread.is_alive()
        assert service.close(5.0) is True
        assert not service.scheduler._thread.is_alive()
        assert service.engine._context is None
        assert service.close(1.0) is True  # closing twice frees nothing twice


def test_a_call_queued_behind_close_is_a_retryable_503_not_a_use_after_free(
    tiny_model_dir: Path,
) -> None:
    """close() frees the engine under the lock; whoever gets the lock after it must not
    touch the freed model (it crashed the process before)."""
    with serving(Settings(model_dir=tiny_model_dir, threads=1)) as client:
        service = runtime_of(client.app).service
        assert service is not None
        assert service.close(1.0) is True
        with pytest.raises(UnavailableError, match="shutting down") as refused:
            decide(service, parse_decision_body({"decision": decision()}, 4).decisions, "single")
        assert refused.value.retryable
