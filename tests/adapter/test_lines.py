"""JSON Lines on /invocations (adapter/lines.py) on the real server and the tiny model: one
answer line per input line in input order, per-line errors that never fail neighbours,
lines about one state merged and scored bit for bit as each line alone, the whole-body
refusals, the batch transform contract, and what the metrics count."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from adapter import handlers
from adapter.app import create_app
from adapter.lines import LineSplitter, execution_parameters
from adapter.settings import Settings, SettingsError, load_settings
from tests.adapter.test_metrics import samples, value
from tests.support.live_server import live_server
from tests.support.serving import decision, serving

LINES = {"content-type": "application/jsonlines"}
STATES = [
    "Customer asks to reset a forgotten password; the reset email never arrived.",
    {"ticket": 7, "text": "I was charged twice for my March invoice."},
    "A prospect wants a demo of the enterprise plan next week.",
]
QUESTIONS = [
    "Which queue should handle this request?",
    "Which team replies first?",
    "Where does this go?",
]
SYSTEMONE = {
    "state": "The parcel arrived damaged.",
    "questions": {
        "refund": {
            "type": "noul",
            "instructions": "Does the customer ask for a refund?",
            "criteria": {"true": "Yes.", "false": "No."},
        }
    },
}


def post_lines(client: TestClient, lines: list[str], **headers: str) -> Any:
    return client.post(
        "/invocations", content="\n".join(lines) + "\n", headers={**LINES, **headers}
    )


def answers(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


@pytest.fixture
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)) as served:
        yield served


def _singles() -> list[dict[str, Any]]:
    return [
        {"decision": decision(f"d{s}-{q}", state, question)}
        for s, state in enumerate(STATES)
        for q, question in enumerate(QUESTIONS)
    ]


def test_lines_are_answered_in_order_and_as_each_alone(client: TestClient) -> None:
    """Shuffled single decisions about three states, a shared batch, a System One request
    and five kinds of bad line: every line answered on its own line, the good ones exactly
    as when sent alone (bit for bit), the bad ones with their own status and field."""
    bodies: list[Any] = [
        *_singles(),
        {"decisions": [decision("s1", STATES[0]), decision("s2", STATES[0], QUESTIONS[1])]},
        SYSTEMONE,
    ]
    random.Random(5).shuffle(bodies)
    lines = [json.dumps(body) for body in bodies]
    bad = {
        2: ("{not json", 400, "body"),
        5: ("[1, 2]", 400, "body"),
        7: (json.dumps({"decision": {**decision("x"), "options": []}}), 400, "decision.options"),
        9: ("", 400, "body"),
        11: (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), 400, "messages"),
    }
    for index in sorted(bad):
        lines.insert(index, bad[index][0])
    got = answers(post_lines(client, lines))
    assert [answer["line"] for answer in got] == list(range(len(lines)))
    for index, answer in enumerate(got):
        if index in bad:
            _, status, field = bad[index]
            assert (answer["status"], answer["field"]) == (status, field), answer
            assert answer["error"]
            continue
        alone = client.post("/invocations", json=json.loads(lines[index])).json()
        for key in ("result", "results", "answers"):
            if key in alone:
                assert _scores(answer[key]) == _scores(alone[key]), (index, key)
                break
        else:
            raise AssertionError(f"line {index}: {answer}")


def _scores(value: Any) -> Any:
    """What must be bit-identical: the probabilities and logits, not the per-call timing."""
    if isinstance(value, list):
        return [_scores(item) for item in value]
    if isinstance(value, dict) and "probabilities" in value and "id" in value:
        return (value["id"], value["probabilities"], value["option_logits"])
    if isinstance(value, dict):
        return {key: _scores(item) for key, item in value.items()}
    return value


def test_lines_about_one_state_ride_as_one_batch(client: TestClient) -> None:
    """Lines about one state, apart in the body, share one request's timing; lines about
    another state, or read with another policy, do not."""
    first = [
        {"decision": decision(f"a{q}", STATES[0], question)} for q, question in enumerate(QUESTIONS)
    ]
    other = {"decision": decision("b", STATES[1])}
    stricter = {"decision": decision("c", STATES[0]), "min_confidence": 0.9}
    bodies = [first[0], other, first[1], stricter, first[2]]
    got = answers(post_lines(client, [json.dumps(body) for body in bodies]))
    merged = [got[0], got[2], got[4]]
    assert all(answer["timing"] == merged[0]["timing"] for answer in merged)
    assert merged[0]["timing"]["passes"] >= 1
    assert [answer["result"]["id"] for answer in merged] == ["a0", "a1", "a2"]
    assert got[1]["timing"] != merged[0]["timing"]
    assert got[3]["timing"] != merged[0]["timing"]


def test_a_repeated_id_about_one_state_is_not_merged_away(client: TestClient) -> None:
    """Two lines may reuse a decision id; each is answered, neither replaces the other."""
    body = [
        json.dumps({"decision": decision("same", STATES[0], QUESTIONS[0])}),
        json.dumps({"decision": decision("same", STATES[0], QUESTIONS[1])}),
    ]
    got = answers(post_lines(client, body))
    assert [answer["result"]["id"] for answer in got] == ["same", "same"]
    assert got[0]["result"]["prompt_sha256"] != got[1]["result"]["prompt_sha256"]


def test_whole_body_refusals(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_lines_bytes=4096)
    with serving(settings) as client:
        empty = client.post("/invocations", content=b"", headers=LINES)
        assert (empty.status_code, empty.json()["field"]) == (400, "body")
        nothing = post_lines(client, ["{", "", "nope"])
        assert nothing.status_code == 400
        assert "no JSON line" in nothing.json()["error"]
        large = post_lines(client, [json.dumps({"decision": decision()})] * 40)
        assert large.status_code == 413
        assert "SEMIF_MAX_LINES_BYTES" in large.json()["error"]
        wrong = client.post("/invocations", content=b"{}", headers={"content-type": "text/csv"})
        assert wrong.status_code == 415
        assert "application/jsonlines" in wrong.json()["error"]


def test_a_line_over_the_body_limit_is_its_own_413(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_body_bytes=1024)
    with serving(settings) as client:
        huge = json.dumps({"decision": decision(state="x" * 5000)})
        got = answers(post_lines(client, [json.dumps({"decision": decision()}), huge]))
        assert "result" in got[0]
        assert (got[1]["status"], got[1]["line"]) == (413, 1)
        assert "SEMIF_MAX_BODY_BYTES" in got[1]["error"]


def test_a_body_larger_than_the_queue_is_scored_in_turns(tiny_model_dir: Path) -> None:
    """Nine groups against a queue of one: the body feeds the scheduler one group at a time
    instead of refusing its own lines."""
    settings = Settings(
        model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_queue=1, max_batch_requests=1
    )
    with serving(settings) as client:
        bodies = [{"decision": decision(f"d{i}", f"state number {i}")} for i in range(9)]
        got = answers(post_lines(client, [json.dumps(body) for body in bodies]))
        assert [answer["result"]["id"] for answer in got] == [f"d{i}" for i in range(9)]


def test_lines_are_counted(client: TestClient) -> None:
    post_lines(client, [json.dumps({"decision": decision()}), "{"])
    found = samples(client)
    assert value(found, "semif_requests_total", api="lines", status="200") == 1
    assert value(found, "semif_lines_total", status="200") == 1
    assert value(found, "semif_lines_total", status="400") == 1


def test_execution_parameters_for_batch_transform(client: TestClient) -> None:
    response = client.get("/execution-parameters")
    assert response.status_code == 200
    assert response.json() == {
        "MaxConcurrentTransforms": 2,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": 6,
    }
    assert execution_parameters(3 << 20)["MaxPayloadInMB"] == 3


def test_batch_transform_settings() -> None:
    assert load_settings({"SAGEMAKER_BATCH": "true"}).request_timeout_seconds == 3600
    # The endpoint's model sets the online deadline; inside a transform job it gives way.
    online = {"SEMIF_REQUEST_TIMEOUT_S": "50"}
    assert load_settings({**online, "SAGEMAKER_BATCH": "true"}).request_timeout_seconds == 3600
    batch = {**online, "SAGEMAKER_BATCH": "true", "SEMIF_BATCH_TIMEOUT_S": "900"}
    assert load_settings(batch).request_timeout_seconds == 900
    assert load_settings({**online, "SEMIF_BATCH_TIMEOUT_S": "900"}).request_timeout_seconds == 50
    assert load_settings({}).request_timeout_seconds == 50
    assert load_settings({"SEMIF_MAX_LINES_BYTES": str(8 << 20)}).max_lines_bytes == 8 << 20
    with pytest.raises(SettingsError, match="SEMIF_MAX_LINES_BYTES=1 is out of range"):
        load_settings({"SEMIF_MAX_LINES_BYTES": "1"})


@pytest.mark.parametrize("seed", range(20))
def test_splitter_finds_the_same_lines_however_the_body_is_cut(seed: int) -> None:
    rng = random.Random(seed)
    lines = [
        b"x" * rng.choice([0, 1, 5, 40, 70]) + (b"\r" if rng.random() < 0.2 else b"")
        for _ in range(rng.randint(1, 12))
    ]
    body = b"\n".join(lines) + (b"\n" if rng.random() < 0.5 else b"")
    limit = 50
    splitter = LineSplitter(limit)
    found: list[tuple[bytes, int]] = []
    start = 0
    while start < len(body):
        end = start + rng.randint(1, 30)
        found += splitter.feed(body[start:end])
        start = end
    found += splitter.rest()
    expected = body.split(b"\n")
    if body.endswith(b"\n"):
        expected.pop()
    assert [over for _, over in found] == [
        len(line) if len(line) > limit else 0 for line in expected
    ]
    assert [raw for raw, over in found if not over] == [
        line for line in expected if len(line) <= limit
    ]
    assert len(splitter.pending) == 0


def test_a_client_that_leaves_mid_answer_stops_the_rest(tiny_model_dir: Path) -> None:
    """Sixty states scored one request a pass; the client reads one answer line and hangs
    up: the body is logged as a 499 and its queued batches are dropped, not scored."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_batch_requests=1)
    bodies = [{"decision": decision(f"d{i}", f"state number {i}")} for i in range(60)]
    content = "".join(json.dumps(body) + "\n" for body in bodies)
    with live_server(create_app(settings)) as url:
        with httpx.stream("POST", f"{url}/invocations", content=content, headers=LINES) as reply:
            first = next(reply.iter_lines())
            assert json.loads(first)["line"] == 0
        with httpx.Client(base_url=url) as http:
            deadline = time.monotonic() + 30
            while True:
                text = http.get("/metrics").text
                if 'semif_requests_total{api="lines",status="499"} 1.0' in text:
                    break
                assert time.monotonic() < deadline, "the left body was never logged"
                time.sleep(0.05)
            time.sleep(0.5)  # whatever was still running ends
            scored = sum(
                float(line.rsplit(" ", 1)[1])
                for line in http.get("/metrics").text.splitlines()
                if line.startswith("semif_questions_total{")
            )
    assert scored < 30


def test_a_failing_group_answers_500_lines_and_the_rest_is_scored(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unexpected error while scoring one group (a bug) ends in 500 lines for its lines
    only; the stream is not cut and every other line is answered."""
    real = handlers.decide_parsed

    async def failing(runtime: Any, request: Any, *args: Any) -> Any:
        if request.decisions[0].state == STATES[1]:
            raise RuntimeError("boom")
        return await real(runtime, request, *args)

    monkeypatch.setattr(handlers, "decide_parsed", failing)
    bodies = [{"decision": decision(f"d{s}", state)} for s, state in enumerate(STATES)]
    got = answers(post_lines(client, [json.dumps(body) for body in bodies]))
    assert [answer.get("status", 200) for answer in got] == [200, 500, 200]
    assert got[1]["error"] == "scoring failed"
