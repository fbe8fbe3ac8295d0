"""`semif batch local`: a JSON Lines file scored by a running decision endpoint, resumably.

Each input line is one request body (a decision, a shared `decisions` batch or a System One
request). Lines are sent as JSON Lines requests, the lines about one state together
(wherever they sit in the file), so the endpoint merges them into one shared-state batch
and decodes the state once; two requests are in flight at once so the endpoint always has
the next one while it answers the last. Each request carries as many lines as the endpoint
answers in about 20 s at the pace measured so far (`Pace`): it must end well inside the
endpoint's deadline, or its last lines come back as 429s to send again.

The output holds one answer per input line, in input order, each with its `line`
(0-based): the line's answer, or its error (`status`, `error`, `field`). Lines answered
with a 429 (or a retryable 503) are sent again (a few rounds) before their error is kept.

Nothing is half-written: answers go to `OUT.part` as mini-batches finish (a header naming
the input's sha256, then one `{"index", "answer"}` per line), and only when every line is
answered is `OUT` written in input order (through a temporary file and a rename) and the
part file removed. An interrupted run started again with the same input and output picks
up where it stopped; a part file from another input is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from client.decision_client import DecisionClient
from client.errors import BatchInputError
from client.summary import Summary

PART_SUFFIX = ".part"
PART_FORMAT = 1
# A request's lines: sized to take about TARGET_REQUEST_S (Pace), the first one small.
TARGET_REQUEST_S = 20.0
FIRST_REQUEST_LINES = 16


def state_key(line: str) -> str | None:
    """The state a request line is about, as the endpoint compares states (a string as is,
    JSON as sent), or None for a line that is not a request about one state."""
    try:
        body = json.loads(line)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    holder = body.get("decision")
    if holder is None and isinstance(body.get("decisions"), list) and body["decisions"]:
        holder = body["decisions"][0]
    state = holder.get("state") if isinstance(holder, dict) else body.get("state")
    if state is None:
        return None
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


class MiniBatches:
    """The pending lines, grouped by state (states in order of first appearance), cut into
    requests of the size asked at each cut: whole states packed together up to that many
    lines and `max_bytes` bytes; a state larger than that fills requests of its own."""

    def __init__(self, lines: Sequence[str], pending: Sequence[int], *, max_bytes: int) -> None:
        by_state: dict[str | None, list[int]] = {}
        for index in pending:
            by_state.setdefault(state_key(lines[index]), []).append(index)
        self._groups = list(by_state.values())
        self._sizes = {index: len(lines[index]) + 1 for index in pending}
        self.max_bytes = max_bytes

    def next(self, most_lines: int) -> list[int]:
        """The next request's lines (empty once every line was handed out)."""
        batch: list[int] = []
        size = 0
        while self._groups:
            group = self._groups[0]
            group_size = sum(self._sizes[index] for index in group)
            if batch and (
                len(batch) + len(group) > most_lines or size + group_size > self.max_bytes
            ):
                return batch
            while group:  # a state alone larger than the bounds is cut
                line_size = self._sizes[group[0]]
                if batch and (len(batch) >= most_lines or size + line_size > self.max_bytes):
                    return batch
                batch.append(group.pop(0))
                size += line_size
            self._groups.pop(0)
        return batch


class Pace:
    """How many lines the next request carries: as many as the endpoint answered in
    TARGET_REQUEST_S at the pace of the requests so far (with the same number in flight),
    FIRST_REQUEST_LINES before any was timed. A request must end well inside the endpoint's
    deadline (SEMIF_REQUEST_TIMEOUT_S, 50 s by default; SageMaker's 60 s), or its last
    lines come back as 429s to send again; a small first request measures the pace."""

    def __init__(self, max_lines: int) -> None:
        self.max_lines = max_lines
        self.seconds_per_line: float | None = None

    def lines(self) -> int:
        if self.seconds_per_line is None:
            return min(FIRST_REQUEST_LINES, self.max_lines)
        wanted = int(TARGET_REQUEST_S / max(self.seconds_per_line, 1e-6))
        return max(1, min(self.max_lines, wanted))

    def record(self, lines: int, seconds: float) -> None:
        per_line = seconds / max(lines, 1)
        last = self.seconds_per_line
        self.seconds_per_line = per_line if last is None else 0.5 * last + 0.5 * per_line


@dataclass
class _Part:
    """The part file: what an earlier run (or this one) already answered."""

    path: Path
    source_sha256: str
    answered: dict[int, dict[str, Any]] = field(default_factory=dict)

    def load(self) -> None:
        """Read the answers so far; a torn last line (a run killed mid-write) is dropped."""
        if not self.path.exists():
            self._write_header()
            return
        with self.path.open(encoding="utf-8") as part:
            header = _json_or_none(part.readline())
            expected = {"semif_batch": PART_FORMAT, "source_sha256": self.source_sha256}
            if not isinstance(header, dict) or any(
                header.get(key) != value for key, value in expected.items()
            ):
                raise BatchInputError(
                    f"{self.path} was written for another input; delete it to start over"
                )
            good = part.tell()
            for raw in iter(part.readline, ""):
                entry = _json_or_none(raw)
                if not raw.endswith("\n") or not isinstance(entry, dict):
                    break
                self.answered[int(entry["index"])] = entry["answer"]
                good = part.tell()
        with self.path.open("r+b") as part:
            part.truncate(good)

    def _write_header(self) -> None:
        header = {"semif_batch": PART_FORMAT, "source_sha256": self.source_sha256}
        with self.path.open("w", encoding="utf-8") as part:
            part.write(json.dumps(header) + "\n")

    def append(self, handle: TextIO, answers: dict[int, dict[str, Any]]) -> None:
        for index, answer in sorted(answers.items()):
            handle.write(json.dumps({"index": index, "answer": answer}, ensure_ascii=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
        self.answered.update(answers)


def _json_or_none(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _retryable(answer: dict[str, Any]) -> bool:
    return answer.get("status") in (429, 503) and answer.get("retryable") is True


def _read_lines(source: Path) -> tuple[list[str], str]:
    try:
        data = source.read_bytes()
    except OSError as error:
        raise BatchInputError(f"cannot read {source}: {error.strerror or error}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BatchInputError(f"{source} is not UTF-8 ({error})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise BatchInputError(f"{source} holds no lines")
    return [line.removesuffix("\r") for line in lines], hashlib.sha256(data).hexdigest()


def run_local(
    client: DecisionClient,
    source: Path,
    out: Path,
    *,
    max_lines: int = 256,
    max_bytes: int = 4 << 20,
    in_flight: int = 2,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> Summary:
    """Score every line of `source` into `out` (see the module docstring)."""
    lines, digest = _read_lines(source)
    part = _Part(out.with_name(out.name + PART_SUFFIX), digest)
    part.load()
    resumed = len(part.answered)
    started = time.monotonic()
    pace = Pace(max_lines)
    with (
        ThreadPoolExecutor(max_workers=in_flight) as pool,
        part.path.open("a", encoding="utf-8") as handle,
    ):
        for round_number in range(rounds):
            pending = [i for i in range(len(lines)) if _open(part.answered.get(i))]
            if not pending:
                break
            last = round_number == rounds - 1
            batches = MiniBatches(lines, pending, max_bytes=max_bytes)
            for answers in _scored(pool, client, lines, batches, pace, in_flight):
                kept = {i: a for i, a in answers.items() if last or not _retryable(a)}
                part.append(handle, kept)
                if progress is not None:
                    progress(_progress_line(part, len(lines), resumed, started))
    missing = [i for i in range(len(lines)) if i not in part.answered]
    if missing:
        raise BatchInputError(f"{len(missing)} lines still unanswered (first: {missing[0]})")
    temporary = out.with_name(out.name + ".tmp")
    with temporary.open("w", encoding="utf-8") as output:
        for index in range(len(lines)):
            output.write(json.dumps(part.answered[index], ensure_ascii=False) + "\n")
    os.replace(temporary, out)
    part.path.unlink()
    statuses = Counter(int(answer.get("status", 200)) for answer in part.answered.values())
    return Summary(len(lines), dict(statuses), time.monotonic() - started, resumed)


def _open(answer: dict[str, Any] | None) -> bool:
    """Whether a line still needs sending: never answered, or answered with a 429 or a retryable 503
    (kept only by a last round, and tried again by the next run)."""
    return answer is None or _retryable(answer)


def _scored(
    pool: ThreadPoolExecutor,
    client: DecisionClient,
    lines: Sequence[str],
    batches: MiniBatches,
    pace: Pace,
    in_flight: int,
) -> Iterator[dict[int, dict[str, Any]]]:
    """Each request's answers keyed by input line, as they finish, `in_flight` at once,
    each request sized by `pace` when it is sent."""

    def send(batch: list[int]) -> dict[int, dict[str, Any]]:
        started = time.monotonic()
        answers = client.invoke_lines([lines[index] for index in batch])
        pace.record(len(batch), time.monotonic() - started)
        return {
            index: {**answer, "line": index} for index, answer in zip(batch, answers, strict=True)
        }

    running: set[Future[dict[int, dict[str, Any]]]] = set()
    while batch := batches.next(pace.lines()):
        running.add(pool.submit(send, batch))
        if len(running) >= in_flight:
            done, running = wait(running, return_when=FIRST_COMPLETED)
            yield from (future.result() for future in done)
    for future in running:
        yield future.result()


def _progress_line(part: _Part, total: int, resumed: int, started: float) -> str:
    done = len(part.answered)
    elapsed = time.monotonic() - started
    rate = (done - resumed) / elapsed if elapsed > 0 else 0.0
    remaining = (total - done) / rate if rate > 0 else float("inf")
    eta = f", about {remaining:.0f} s left" if remaining != float("inf") else ""
    return f"{done}/{total} lines ({100 * done / total:.0f} %), {rate:.1f} lines/s{eta}"
