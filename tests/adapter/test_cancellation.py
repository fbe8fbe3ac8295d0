"""A request's cancellation is an argument (adapter.cancel), and how a request stopped is
answered and logged as what it was: a client that left is a 499 without a traceback, a
passed deadline and a queue timeout are 429s (load: come back later), each named in the log
line."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import pytest

from adapter.app import create_app
from adapter.cancel import Cancellation
from adapter.core.failures import RefusedError
from adapter.core.generation import GenerationRun
from adapter.core.scheduler import Scheduler
from adapter.errors import BusyError, ClientDisconnectedError
from adapter.settings import QueueLimits, Settings
from tests.support.fake_engine import FakeEngine
from tests.support.live_server import live_server, post_in_background, runtime_of
from tests.support.serving import decision

REPO = Path(__file__).resolve().parents[2]


# -- the scheduler, with an engine that holds its first pass (real time) --------------------


@contextmanager
def _scheduler(queue_timeout_seconds: float = 10.0) -> Iterator[tuple[Scheduler, FakeEngine]]:
    engine = FakeEngine()
    scheduler = Scheduler(
        engine,  # type: ignore[arg-type]
        limits=QueueLimits(
            max_queue=8,
            queue_timeout_seconds=queue_timeout_seconds,
            max_batch_requests=8,
        ),
        on_native_failure=lambda _: None,
    )
    try:
        yield scheduler, engine
    finally:
        engine.release.set()
        scheduler.close(5)


def test_each_way_of_stopping_ends_queued_work_as_itself() -> None:
    """Behind a pass that holds the worker: a request whose client left, one whose deadline
    passed and one that waited past the queue timeout are dropped unscored, each with its
    own error; a request with none of these is scored."""
    with _scheduler(queue_timeout_seconds=0.6) as (scheduler, engine):
        now = time.monotonic()
        first = scheduler.submit([[1]], [()], now + 30, Cancellation())
        assert engine.entered.wait(10)
        gone, late, waited = Cancellation(), Cancellation(), Cancellation()
        left = scheduler.submit([[2]], [()], now + 30, gone)
        queued = scheduler.submit([[4]], [()], now + 30, waited)
        gone.set("client_gone")
        time.sleep(0.4)
        # Queued 0.4 s later, with a deadline 0.1 s away: at the release its deadline has
        # passed, its queue timeout not; the request before it has waited past 0.6 s.
        expired = scheduler.submit([[3]], [()], time.monotonic() + 0.1, late)
        time.sleep(0.3)
        engine.release.set()
        first.future.result(10)
        with pytest.raises(ClientDisconnectedError):
            left.future.result(10)
        with pytest.raises(BusyError) as deadline:
            expired.future.result(10)
        assert deadline.value.cause == "deadline"
        assert deadline.value.retryable
        with pytest.raises(RefusedError) as timeout:  # the core's; the service answers a 429
            queued.future.result(10)
        assert timeout.value.cause == "queue_timeout"
        # The scheduler cancels nothing itself: a queue timeout is not a client that left.
        assert (late.reason, waited.reason) == (None, None)
        after = scheduler.submit([[5]], [()], time.monotonic() + 30, Cancellation())
        after.future.result(10)
    assert engine.scored() == [(1,), (5,)]


def test_the_first_reason_wins() -> None:
    cancel = Cancellation()
    cancel.set("deadline")
    cancel.set("client_gone")
    assert cancel.reason == "deadline"
    assert isinstance(cancel.error(), BusyError)


# -- through the HTTP layer: what the log line says --------------------------------------------


def _request_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        json.loads(record.getMessage())
        for record in caplog.records
        if record.name == "adapter.requests"
    ]


def _hold_scoring(app: Any, seconds: float) -> threading.Event:
    """Make the engine's next pass take `seconds` longer; the event is set when it starts."""
    service = runtime_of(app).service
    assert service is not None
    engine = service.engine
    real_score = engine.score
    started = threading.Event()

    def slow_score(*args: Any, **kwargs: Any) -> Any:
        started.set()
        time.sleep(seconds)
        return real_score(*args, **kwargs)

    engine.score = slow_score  # type: ignore[method-assign]
    return started


def test_a_client_that_leaves_during_scoring_is_a_499_without_a_traceback(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(Settings(model_dir=tiny_model_dir, threads=1))
    with caplog.at_level(logging.INFO), live_server(app) as url:
        _hold_scoring(app, 1.0)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/invocations", json={"decision": decision("gone")}, timeout=0.3)
        time.sleep(1.5)  # the pass ends; the answer goes to nobody
    [line] = _request_lines(caplog)
    assert (line["status"], line["client_gone"]) == (499, True)
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


def test_a_client_that_leaves_during_generation_is_a_499_without_a_traceback(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_step = GenerationRun.step
    steps: list[int] = []

    def slow_step(run: GenerationRun) -> bool:
        steps.append(1)
        time.sleep(0.02)
        return real_step(run)

    monkeypatch.setattr(GenerationRun, "step", slow_step)
    # No end-of-generation token either: the chat runs to max_tokens unless stopped.
    monkeypatch.setattr(llama_cpp, "llama_vocab_is_eog", lambda vocab, token: False)
    app = create_app(Settings(model_dir=tiny_model_dir, threads=1, max_chat_tokens=512))
    chat = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 512}
    with caplog.at_level(logging.INFO), live_server(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=0.5)
        deadline = time.monotonic() + 10
        while not _request_lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.05)
    [line] = _request_lines(caplog)
    assert (line["status"], line["client_gone"]) == (499, True)
    assert len(steps) < 512  # the generation stopped at a token boundary
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


@pytest.mark.parametrize(
    ("request_timeout", "cause"),
    [
        (1.0, "deadline"),  # the caller's deadline passes while the pass still runs
        (10.0, "queue_timeout"),  # a request queued behind that pass waits past 0.5 s
    ],
)
def test_a_passed_deadline_and_a_queue_timeout_are_logged_as_such(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, request_timeout: float, cause: str
) -> None:
    settings = Settings(
        model_dir=tiny_model_dir,
        threads=1,
        queue_timeout_seconds=0.5,
        request_timeout_seconds=request_timeout,
    )
    app = create_app(settings)
    with caplog.at_level(logging.INFO), live_server(app) as url:
        started = _hold_scoring(app, 2.0)
        first = post_in_background(url, {"decision": decision("first")})
        assert started.wait(10)
        second = httpx.post(f"{url}/invocations", json={"decision": decision("second")}, timeout=30)
        first.join(30)
    assert second.status_code == 429
    assert second.json()["retryable"] is True
    by_status = {line["status"]: line for line in _request_lines(caplog)}
    assert by_status[429]["refused"] == cause
    assert "unavailable" not in by_status[429]
    assert "client_gone" not in by_status[429]
