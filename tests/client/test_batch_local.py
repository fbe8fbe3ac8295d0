"""`semif batch local` (client/batch_local.py): against a real server on the tiny model, the
answers in input order and equal to each line sent alone; an interrupted run resumed
without redoing finished lines; the part file's guards; retry rounds; the mini-batch plan."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from adapter.app import create_app
from adapter.settings import Settings
from client.batch_local import (
    FIRST_REQUEST_LINES,
    PART_SUFFIX,
    TARGET_REQUEST_S,
    MiniBatches,
    Pace,
    run_local,
    state_key,
)
from client.cli import main
from client.decision_client import DecisionClient
from client.errors import BatchInputError
from tests.support.live_server import live_server
from tests.support.serving import REPO

TICKETS = REPO / "client" / "examples" / "tickets.jsonl"


@pytest.fixture(scope="module")
def url(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tmp_path_factory.mktemp("batch-model")
    shutil.copy(tiny_gguf, model_dir / tiny_gguf.name)
    app = create_app(Settings(model_dir=model_dir, max_tokens=1024, threads=2))
    with live_server(app) as base:
        yield base


def _body_with_errors(tmp_path: Path) -> Path:
    lines = TICKETS.read_text().splitlines()
    lines.insert(3, "{not json")
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_answers_in_input_order_and_as_each_line_alone(url: str, tmp_path: Path) -> None:
    source = _body_with_errors(tmp_path)
    out = tmp_path / "out.jsonl"
    client = DecisionClient.for_url(url)
    summary = run_local(client, source, out, max_lines=4)
    answers = [json.loads(line) for line in out.read_text().splitlines()]
    lines = source.read_text().splitlines()
    assert [answer["line"] for answer in answers] == list(range(len(lines)))
    assert summary.lines == len(lines)
    assert summary.statuses == {200: len(lines) - 1, 400: 1}
    assert answers[3]["status"] == 400
    for index, (line, answer) in enumerate(zip(lines, answers, strict=True)):
        if index == 3:
            continue
        alone = client.invoke(json.loads(line))
        key = "result" if "result" in alone else "answers"
        if key == "result":
            assert answer[key]["probabilities"] == alone[key]["probabilities"]
        else:
            assert answer[key] == alone[key]
    assert not out.with_name(out.name + PART_SUFFIX).exists()


def _scores(answer: dict[str, Any]) -> Any:
    """What must not depend on how the lines were split into runs and requests."""
    if "result" in answer:
        return answer["result"]["id"], answer["result"]["probabilities"]
    return answer["answers"]


class _InterruptedError(Exception):
    pass


class _Counting:
    """A DecisionClient stand-in that counts the lines sent, and can fail after a number of
    requests (an interrupted run)."""

    def __init__(self, client: DecisionClient, fail_after: int | None = None) -> None:
        self.client = client
        self.fail_after = fail_after
        self.requests = 0
        self.lines = 0

    def invoke_lines(self, bodies: Sequence[Mapping[str, Any] | str]) -> list[dict[str, Any]]:
        if self.fail_after is not None and self.requests >= self.fail_after:
            raise _InterruptedError
        self.requests += 1
        self.lines += len(bodies)
        return self.client.invoke_lines(bodies)


def test_an_interrupted_run_resumes_without_redoing_lines(url: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    first = _Counting(DecisionClient.for_url(url), fail_after=2)
    with pytest.raises(_InterruptedError):
        run_local(first, TICKETS, out, max_lines=3, in_flight=1)  # type: ignore[arg-type]
    assert not out.exists()
    part = out.with_name(out.name + PART_SUFFIX)
    assert part.exists()
    second = _Counting(DecisionClient.for_url(url))
    summary = run_local(second, TICKETS, out, max_lines=3, in_flight=1)  # type: ignore[arg-type]
    total = len(TICKETS.read_text().splitlines())
    assert first.lines + second.lines == total
    assert summary.resumed == first.lines
    fresh = tmp_path / "fresh.jsonl"
    run_local(DecisionClient.for_url(url), TICKETS, fresh, max_lines=3)
    resumed = [json.loads(line) for line in out.read_text().splitlines()]
    uninterrupted = [json.loads(line) for line in fresh.read_text().splitlines()]
    assert [_scores(a) for a in resumed] == [_scores(a) for a in uninterrupted]
    assert [a["line"] for a in resumed] == list(range(total))


def test_a_torn_last_line_is_dropped_and_another_inputs_part_refused(
    url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    first = _Counting(DecisionClient.for_url(url), fail_after=1)
    with pytest.raises(_InterruptedError):
        run_local(first, TICKETS, out, max_lines=3, in_flight=1)  # type: ignore[arg-type]
    part = out.with_name(out.name + PART_SUFFIX)
    with part.open("a") as handle:
        handle.write('{"index": 12, "answ')  # killed mid-write
    second = _Counting(DecisionClient.for_url(url))
    run_local(second, TICKETS, out, max_lines=3, in_flight=1)  # type: ignore[arg-type]
    assert first.lines + second.lines == len(TICKETS.read_text().splitlines())
    other = tmp_path / "other.jsonl"
    other.write_text(TICKETS.read_text().splitlines()[0] + "\n")
    part.write_text(json.dumps({"semif_batch": 1, "source_sha256": "0" * 64}) + "\n")
    with pytest.raises(BatchInputError, match="another input"):
        run_local(DecisionClient.for_url(url), other, out)


class _BusyOnce:
    """Answers every line of its first request with a retryable 503, then as asked."""

    def __init__(self) -> None:
        self.calls = 0

    def invoke_lines(self, bodies: Sequence[Mapping[str, Any] | str]) -> list[dict[str, Any]]:
        self.calls += 1
        if self.calls == 1:
            busy = {"status": 503, "retryable": True, "error": "busy", "retry_after_seconds": 0}
            return [dict(busy) for _ in bodies]
        return [{"result": {"id": str(body)[:8]}} for body in bodies]


def test_lines_answered_busy_are_sent_again(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"a": 1}\n{"b": 2}\n')
    out = tmp_path / "out.jsonl"
    busy = _BusyOnce()
    summary = run_local(busy, source, out, max_lines=10)  # type: ignore[arg-type]
    assert busy.calls == 2
    assert summary.statuses == {200: 2}


def test_an_empty_or_unreadable_input_is_a_usage_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    client = DecisionClient.for_url("http://127.0.0.1:9")
    with pytest.raises(BatchInputError, match="no lines"):
        run_local(client, empty, tmp_path / "out.jsonl")
    with pytest.raises(BatchInputError, match="cannot read"):
        run_local(client, tmp_path / "missing.jsonl", tmp_path / "out.jsonl")


@pytest.mark.parametrize("seed", range(30))
def test_mini_batches_keep_states_together_within_bounds(seed: int) -> None:
    rng = random.Random(seed)
    states = [f"state {i}" for i in range(rng.randint(1, 8))]
    lines = [
        json.dumps({"decision": {"id": str(i), "state": rng.choice(states)}})
        if rng.random() < 0.9
        else "not json"
        for i in range(rng.randint(1, 80))
    ]
    pending = sorted(rng.sample(range(len(lines)), rng.randint(1, len(lines))))
    max_bytes = rng.randint(60, 2000)
    cutter = MiniBatches(lines, pending, max_bytes=max_bytes)
    batches: list[tuple[int, list[int]]] = []
    while True:
        most = rng.randint(1, 20)  # the pace changes from one request to the next
        batch = cutter.next(most)
        if not batch:
            break
        batches.append((most, batch))
    assert sorted(i for _, batch in batches for i in batch) == pending
    for most, batch in batches:
        assert len(batch) <= most
        assert sum(len(lines[i]) + 1 for i in batch) <= max_bytes or len(batch) == 1
    # A state is split over several requests only when it alone passes a bound.
    for key in {state_key(lines[i]) for i in pending}:
        holding = [(most, b) for most, b in batches if any(state_key(lines[i]) == key for i in b)]
        members = [i for i in pending if state_key(lines[i]) == key]
        size = sum(len(lines[i]) + 1 for i in members)
        if len(holding) > 1:
            assert len(members) > holding[0][0] or size > max_bytes


def test_the_pace_sizes_requests_to_the_target_time() -> None:
    pace = Pace(max_lines=256)
    assert pace.lines() == FIRST_REQUEST_LINES
    pace.record(16, 8.0)  # half a second a line: 20 s is 40 lines
    assert pace.lines() == int(TARGET_REQUEST_S / 0.5)
    pace.record(40, 40 * 1.5)  # slower now: the estimate moves halfway
    assert pace.lines() == int(TARGET_REQUEST_S / 1.0)
    pace.record(10, 0.001)
    assert Pace(max_lines=8).lines() == 8
    assert 1 <= pace.lines() <= 256


def test_the_cli_prints_progress_and_a_summary(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "answers.jsonl"
    code = main(["batch", "local", str(TICKETS), "--url", url, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "lines/s" in captured.err
    assert f"{out}: 13 lines answered: no errors" in captured.out
    code = main(["batch", "local", str(tmp_path / "nope.jsonl"), "--url", url, "--out", str(out)])
    assert code == 2
