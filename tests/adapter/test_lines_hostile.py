"""JSON Lines bodies that must not take the instance down or lose work (adapter/lines.py), at
the sizes a black-box run found harmful: a real uvicorn server on the tiny model, /ping
watched from another connection the whole time (SageMaker's health check would fail an
instance whose /ping stalls), every line answered.

- 20,000 identical decision lines: planning was quadratic and ran on the event loop (31.9 s
  without /ping);
- 10^6 blank lines in 1 MB: each line cost an answer line and a send (21.5 s, a 109 MB
  answer, /ping stalled 16 s);
- nine lines about one state, each answerable alone, merged over the request budget: all
  nine got a 400;
- more lines than the deadline allows: the unstarted ones were answered long after it, so
  behind SageMaker's 60 s limit the whole answer was lost.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from adapter.app import create_app
from adapter.settings import Settings
from tests.support.live_server import live_server
from tests.support.serving import decision

LINES = {"content-type": "application/jsonlines"}
PING_LIMIT_S = 1.0  # the bound; SageMaker's health check allows 2 s


@contextmanager
def watched_ping(url: str) -> Iterator[list[float]]:
    """/ping's latency, asked every 50 ms from its own connection while the block runs."""
    latencies: list[float] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=30) as http:
            while not done.is_set():
                started = time.monotonic()
                assert http.get(f"{url}/ping").status_code == 200
                latencies.append(time.monotonic() - started)
                done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield latencies
    finally:
        done.set()
        watcher.join(30)


def post_lines(url: str, body: bytes) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = httpx.post(f"{url}/invocations", content=body, headers=LINES, timeout=120)
    return response, time.monotonic() - started


def answer_lines(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text[:300]
    return [json.loads(line) for line in response.text.splitlines()]


def test_identical_lines_are_planned_off_the_loop_and_all_answered_by_the_deadline(
    tiny_model_dir: Path,
) -> None:
    """20,000 copies of one decision (3.9 MB): 20,000 groups, planned in a worker thread;
    /ping stays under a second, and by the deadline every line has its answer: scored, or
    the deadline's 429 to send again."""
    settings = Settings(
        model_dir=tiny_model_dir, max_tokens=1024, threads=2, request_timeout_seconds=4.0
    )
    line = json.dumps({"decision": decision("same", "One state, asked again and again.")})
    body = ("\n".join([line] * 20_000) + "\n").encode()
    assert len(body) > 3_500_000
    with live_server(create_app(settings)) as url, watched_ping(url) as pings:
        response, seconds = post_lines(url, body)
    got = answer_lines(response)
    assert [answer["line"] for answer in got] == list(range(20_000))
    statuses = {answer.get("status", 200) for answer in got}
    assert statuses <= {200, 429}
    assert 200 in statuses  # the lines reached before the deadline are kept
    late = [answer for answer in got if answer.get("status") == 429]
    assert all(answer["retryable"] and "deadline" in answer["error"] for answer in late)
    assert seconds < settings.request_timeout_seconds + 3.0
    assert max(pings) < PING_LIMIT_S, max(pings)


def test_a_megabyte_of_newlines_is_refused_at_the_line_limit(tiny_model_dir: Path) -> None:
    """10^6 blank lines: a 413 naming SEMIF_MAX_LINES as soon as the line after the limit
    arrives, not a million error lines; /ping answers throughout."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)
    with live_server(create_app(settings)) as url, watched_ping(url) as pings:
        response, _ = post_lines(url, b"\n" * 1_000_000)
        under = httpx.post(
            f"{url}/invocations",
            content=b"\n" * 50_000 + json.dumps({"decision": decision()}).encode(),
            headers=LINES,
            timeout=60,
        )
    assert response.status_code == 413
    assert f"more than {settings.max_lines} lines (SEMIF_MAX_LINES)" in response.json()["error"]
    assert len(response.content) < 1000
    got = answer_lines(under)  # below the limit: one answer line per line, the last scored
    assert len(got) == 50_001
    assert {answer["status"] for answer in got[:-1]} == {400}
    assert "result" in got[-1]
    assert max(pings) < PING_LIMIT_S, max(pings)


def _costs(tiny_model_dir: Path, *bodies: dict[str, Any]) -> list[int]:
    """What the request budget charges each body: the number its 400 names under a budget
    of one token."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_request_tokens=1)
    costs = []
    with live_server(create_app(settings)) as url:
        for body in bodies:
            refused = httpx.post(f"{url}/invocations", json=body, timeout=60).json()["error"]
            costs.append(int(re.search(r"costs (\d+) tokens", refused)[1]))  # type: ignore[index]
    return costs


def test_lines_merged_over_the_request_budget_are_each_answered(tiny_model_dir: Path) -> None:
    """Nine decisions about one state, each within SEMIF_MAX_REQUEST_TOKENS alone and over
    it together: the merged batch is tried again in halves, and every line gets its 200,
    with the probabilities it gets alone."""
    state = "A long account history. " * 20
    bodies = [
        {"decision": decision(f"d{index}", state, f"Question {index}: which queue?")}
        for index in range(9)
    ]
    shared = {"decisions": [body["decision"] for body in bodies]}
    alone_cost, together_cost = _costs(tiny_model_dir, bodies[0], shared)
    assert alone_cost < together_cost
    settings = Settings(
        model_dir=tiny_model_dir,
        max_tokens=1024,
        threads=2,
        max_request_tokens=(alone_cost + together_cost) // 2,
    )
    with live_server(create_app(settings)) as url:
        alone = httpx.post(f"{url}/invocations", json=bodies[0], timeout=60)
        together = httpx.post(f"{url}/invocations", json=shared, timeout=60)
        response, _ = post_lines(url, "\n".join(json.dumps(body) for body in bodies).encode())
    assert together.status_code == 400  # what the merged batch alone gets
    assert "SEMIF_MAX_REQUEST_TOKENS" in together.json()["error"]
    got = answer_lines(response)
    assert [answer["result"]["id"] for answer in got] == [f"d{index}" for index in range(9)]
    assert got[0]["result"]["probabilities"] == alone.json()["result"]["probabilities"]


def test_distinct_lines_past_the_deadline_are_answered_in_time(tiny_model_dir: Path) -> None:
    """1,500 lines about 1,500 states and a 3 s deadline: the lines scored by then are kept,
    the rest get the deadline's 429 at the deadline, not each after waiting for room."""
    settings = Settings(
        model_dir=tiny_model_dir, max_tokens=1024, threads=2, request_timeout_seconds=3.0
    )
    lines = [
        json.dumps({"decision": decision(f"d{index}", f"Ticket {index}: the parcel is late.")})
        for index in range(1500)
    ]
    with live_server(create_app(settings)) as url, watched_ping(url) as pings:
        response, seconds = post_lines(url, "\n".join(lines).encode())
    got = answer_lines(response)
    assert [answer["line"] for answer in got] == list(range(1500))
    scored = [answer for answer in got if "result" in answer]
    late = [answer for answer in got if answer.get("status") == 429]
    assert len(scored) + len(late) == 1500
    assert scored
    assert late
    assert [answer["result"]["id"] for answer in scored] == [
        f"d{answer['line']}" for answer in scored
    ]
    assert seconds < settings.request_timeout_seconds + 2.0
    assert max(pings) < PING_LIMIT_S, max(pings)
