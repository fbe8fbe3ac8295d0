"""JSON Lines on /invocations: many requests in one body, one answer line per input line.

For offline work: SageMaker batch transform sends mini-batches of lines (SplitType `Line`),
an asynchronous endpoint or `semif batch` whole files. With `Content-Type:
application/jsonlines` (or `application/x-jsonlines`) each line of the body is a request of
its own (adapter.line_plan says which ride together), and the answer is a 200 whose body
has one JSON line per input line, in input order: what the line's API answers, or the
line's error (`status`, `error`, `field`), each with its `line` (0-based). A bad line never
fails its neighbours, and merging never fails a line that succeeds alone (a merged group
that fails as asked is tried again in halves); the body is refused whole only when it is
over SEMIF_MAX_LINES_BYTES or holds more than SEMIF_MAX_LINES lines (413), arrives too
slowly (408), or holds no JSON line at all (400: then it is not JSON Lines).

Memory: the body is read chunk by chunk and each line parsed as soon as it is complete, so
a line's bytes are gone once parsed (a line over SEMIF_MAX_BODY_BYTES is skipped unread and
answered with a 413 line); answers are written as soon as every line before them is
answered, and dropped once written. The line limit bounds what no byte limit does: each
line costs a parse and an answer line whatever its size.

The event loop only moves bytes: each chunk's lines are parsed, and the body planned, in a
worker thread (so /ping answers while a large body is read), and answer lines are written
in pieces of about WRITE_BYTES, not one send each.

Time: groups go to the scheduler while it wants more work (DecisionService.wants_work: less than a
pass of rows ready behind the one being scored, all callers' work counted, taking less than
half the queue timeout), so the passes stay full while a large body never fills the queue
that online callers share with it, nor makes its own groups wait there past their
deadlines. A group refused for load (a 429: queue full, overloaded, queue timeout) waits
its Retry-After and tries again with its retry token while the body's deadline lasts:
SEMIF_REQUEST_TIMEOUT_S from the call's arrival (in a batch transform job, SAGEMAKER_BATCH,
SEMIF_BATCH_TIMEOUT_S: 3600 s). At the deadline every line not answered yet gets a 429
line (`deadline`) at once and the work under way is dropped, so the scored lines reach the
caller before SageMaker's own limit.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from adapter import handlers
from adapter.cancel import Cancellation, deadline_error
from adapter.errors import (
    ApiError,
    BusyError,
    ClientDisconnectedError,
    PayloadTooLargeError,
    RequestError,
)
from adapter.http import (
    LOG,
    authenticate,
    content_type_of,
    error_response,
    finish_call,
    parse_json,
    read_body,
    request_id_of,
)
from adapter.line_plan import Group, Plan, plan
from adapter.runtime import Runtime
from adapter.schema import DecisionRequest

MEDIA_TYPES = ("application/jsonlines", "application/x-jsonlines")
# SageMaker batch transform's GET /execution-parameters: one mini-batch scoring while the
# next arrives and the last one's output is written (each mini-batch fills the passes by
# itself); SageMaker's default payload, ~6,000 one-KB decision lines.
MAX_CONCURRENT_TRANSFORMS = 2
# While a body has groups to start, it asks the scheduler this often whether it wants more,
# and waits at most QUEUED_WAIT_S for the group it just started to be queued.
FEED_POLL_S = 0.02
QUEUED_WAIT_S = 1.0
MAX_PAYLOAD_MB = 6
# Answer lines are written in pieces of about this many bytes: one send per line would cost
# more than the line (10^6 short error lines took 21.5 s that way).
WRITE_BYTES = 64 << 10


def execution_parameters(max_lines_bytes: int) -> dict[str, Any]:
    """What a batch transform job should send this container, unless the job says."""
    return {
        "MaxConcurrentTransforms": MAX_CONCURRENT_TRANSFORMS,
        "BatchStrategy": "MULTI_RECORD",
        "MaxPayloadInMB": max(1, min(MAX_PAYLOAD_MB, max_lines_bytes >> 20)),
    }


class LineSplitter:
    """Cuts a body's chunks into lines without holding more than one unfinished line, and
    not even that one once it passes `limit` bytes (it is then only counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pending = bytearray()
        self.overflow = 0  # the unfinished line's size, once past the limit

    def feed(self, chunk: bytes) -> list[tuple[bytes, int]]:
        """The lines `chunk` completes, each with its size if it passed the limit (else 0)."""
        done: list[tuple[bytes, int]] = []
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            self._take(chunk[start:] if end < 0 else chunk[start:end])
            if end < 0:
                return done
            done.append(self._line())
            start = end + 1

    def rest(self) -> list[tuple[bytes, int]]:
        """The last line, when the body does not end with a newline."""
        return [self._line()] if self.pending or self.overflow else []

    def _take(self, piece: bytes) -> None:
        if self.overflow:
            self.overflow += len(piece)
            return
        self.pending += piece
        if len(self.pending) > self.limit:
            self.overflow = len(self.pending)
            self.pending.clear()

    def _line(self) -> tuple[bytes, int]:
        line = (bytes(self.pending), self.overflow)
        self.pending.clear()
        self.overflow = 0
        return line


def _parse_line(raw: bytes, overflow: int, limit: int) -> Any:
    """One line's request, or the ApiError that is its answer."""
    if overflow:
        return PayloadTooLargeError(
            f"line is {overflow} bytes; the limit for one line is {limit} (SEMIF_MAX_BODY_BYTES)"
        )
    raw = raw.removesuffix(b"\r")
    if not raw.strip():
        return RequestError("body", "is an empty line; send one JSON request per line")
    try:
        return parse_json(raw)
    except ApiError as error:
        return error


async def read_lines(
    request: Request,
    *,
    max_bytes: int,
    max_line_bytes: int,
    max_lines: int,
    timeout_seconds: float,
) -> list[Any]:
    """Every line of the body, parsed as it completes (a JSON value or its ApiError): each
    chunk's lines in a worker thread, so a chunk of many lines never holds the event loop;
    a 413 as soon as the body holds more than `max_lines` lines (SEMIF_MAX_LINES)."""
    lines: list[Any] = []
    splitter = LineSplitter(max_line_bytes)

    def parse(done: list[tuple[bytes, int]]) -> None:
        if len(lines) + len(done) > max_lines:
            raise PayloadTooLargeError(
                f"body holds more than {max_lines} lines (SEMIF_MAX_LINES); send fewer lines "
                "per request"
            )
        lines.extend(_parse_line(raw, over, max_line_bytes) for raw, over in done)

    async def take(chunk: bytes) -> None:
        await anyio.to_thread.run_sync(lambda: parse(splitter.feed(chunk)))

    await read_body(request, take, max_bytes, timeout_seconds, limit_name="SEMIF_MAX_LINES_BYTES")
    parse(splitter.rest())
    if not any(not isinstance(line, ApiError) for line in lines):
        raise RequestError(
            "body",
            f"holds no JSON line ({len(lines)} lines); send one JSON request per line",
        )
    return lines


def _error_line(line: int, error: ApiError) -> dict[str, Any]:
    return {"line": line, "status": error.status, **error.body()}


class _Body:
    """One JSON Lines body being answered: its groups, their cancellations, its log.

    Its deadline runs from the call's arrival (`arrived`, time.monotonic), like an online
    request's: SEMIF_REQUEST_TIMEOUT_S, within SageMaker's 60 s for a real-time call. When
    it comes, every line not answered yet is answered with the deadline's 429 at once and
    the work under way is cancelled: the lines scored by then are kept and the answer ends
    in time, instead of waiting for each unstarted group to find room only to be refused."""

    def __init__(self, runtime: Runtime, request_id: str, planned: Plan, count: int) -> None:
        self.runtime = runtime
        self.request_id = request_id
        settings = runtime.settings
        self.plan = planned
        self.count = count
        self.deadline = 0.0  # set by `answers`, from the call's arrival
        self.most_in_flight = max(1, min(settings.max_batch_requests, settings.max_queue))
        self.cancels: list[Cancellation] = []
        self.statuses: dict[int, int] = {}

    async def run(self, group: Group) -> list[tuple[int, dict[str, Any]]]:
        """The answers to the group's lines. A merged group that fails for what it asked (a
        4xx other than load) is tried again as two halves, down to single lines: merging
        must never turn lines that are answerable alone into errors (nine lines over the
        request budget together), and a line that fails alone names its own field."""
        try:
            response = await self._score(group)
        except ApiError as error:
            if group.merged and _fails_as_asked(error):
                first, second = group.halves()
                return await self.run(first) + await self.run(second)
            return [(line, _error_line(line, error)) for line in group.lines]
        except Exception:  # a bug: its lines say so, the others are still answered
            LOG.exception(
                "scoring failed (request_id=%s, line %d)", self.request_id, group.lines[0]
            )
            failed = ApiError("scoring failed")
            return [(line, _error_line(line, failed)) for line in group.lines]
        if not group.merged:
            (line,) = group.lines
            return [(line, {**response, "line": line})]
        shared = {key: value for key, value in response.items() if key != "results"}
        return [
            (line, {"result": result, **shared, "line": line})
            for line, result in zip(group.lines, response["results"], strict=True)
        ]

    async def _score(self, group: Group) -> dict[str, Any]:
        """Score the group; refused for load, wait the Retry-After and try again with the
        retry token while the body's deadline lasts."""
        token: str | None = None
        while True:
            if time.monotonic() >= self.deadline:
                raise deadline_error("before the line's turn")
            cancel = Cancellation()
            self.cancels.append(cancel)
            request_id = f"{self.request_id}:{group.lines[0]}"
            try:
                if isinstance(group.request, DecisionRequest):
                    response, _ = await handlers.decide_parsed(
                        self.runtime, group.request, request_id, cancel, token
                    )
                else:
                    response, _ = await handlers.answer_systemone_parsed(
                        self.runtime, group.request, request_id, cancel, token
                    )
                return response
            except BusyError as error:
                wait = min(error.retry_after, self.deadline - time.monotonic())
                if wait <= 0:
                    raise
                token = error.extra.get("retry_token")
                await asyncio.sleep(wait)
            finally:
                self.cancels.remove(cancel)

    def _room(self, in_flight: int) -> bool:
        """Whether to start another group now: always when none of this body's is under way
        (the scheduler's own admission then decides), else while fewer than a pass takes
        are and the scheduler wants more work (DecisionService.wants_work)."""
        if in_flight == 0:
            return True
        service = self.runtime.service
        if in_flight >= self.most_in_flight or service is None:
            return False
        return service.wants_work()

    async def _until_queued(self, task: asyncio.Task[Any]) -> None:
        """Wait (briefly) until the group just started has reached the scheduler's queue,
        or ended: it renders in a worker thread first, and until it is queued the backlog
        does not count it, so `_room` would start too many."""
        service = self.runtime.service
        if service is None:
            return
        before = service.pressure
        deadline = min(time.monotonic() + QUEUED_WAIT_S, self.deadline)
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(FEED_POLL_S)
            if service.pressure != before:
                return

    def cancel_all(self) -> None:
        for cancel in list(self.cancels):
            cancel.set("client_gone")

    async def answers(self, arrived: float) -> AsyncIterator[bytes]:
        """Answer lines in input order, each as soon as the lines before it are answered,
        written in pieces of about WRITE_BYTES; at the deadline, the rest at once."""
        self.deadline = arrived + self.runtime.settings.request_timeout_seconds
        ready: dict[int, dict[str, Any]] = {
            line: _error_line(line, error) for line, error in self.plan.errors.items()
        }
        tasks: set[asyncio.Task[list[tuple[int, dict[str, Any]]]]] = set()
        waiting = iter(self.plan.groups)
        unstarted = len(self.plan.groups)
        written = 0
        try:
            while written < self.count:
                while written not in ready:
                    left = self.deadline - time.monotonic()
                    if left <= 0:
                        self._expire(ready, written)
                        break
                    while unstarted and self._room(len(tasks)):
                        started = asyncio.create_task(self.run(next(waiting)))
                        tasks.add(started)
                        unstarted -= 1
                        await self._until_queued(started)
                    # With groups still to start, look again soon: the room is shared with
                    # online requests, which end without telling this body.
                    done, tasks = await asyncio.wait(
                        tasks,
                        timeout=min(FEED_POLL_S, left) if unstarted else left,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    for task in done:
                        ready.update(task.result())
                piece = bytearray()
                while written in ready and len(piece) < WRITE_BYTES:
                    answer = ready.pop(written)
                    self.statuses[written] = answer.get("status", 200)
                    piece += _dumps(answer)
                    written += 1
                yield bytes(piece)
        finally:
            self.cancel_all()  # the client left (or the stream failed): drop queued work
            for task in tasks:
                task.cancel()

    def _expire(self, ready: dict[int, dict[str, Any]], written: int) -> None:
        """The deadline came: every line not answered yet gets the deadline's 429 now (the
        caller sends those lines again), and the work under way is dropped."""
        for cancel in list(self.cancels):
            cancel.set("deadline")
        late = deadline_error("before the line was answered")
        for line in range(written, self.count):
            ready.setdefault(line, _error_line(line, late))


def _fails_as_asked(error: ApiError) -> bool:
    """Whether an error says the request itself cannot be answered (a 4xx other than a
    refusal for load or a client gone), so that a smaller one may be."""
    return 400 <= error.status < 500 and not isinstance(error, BusyError | ClientDisconnectedError)


def _dumps(answer: dict[str, Any]) -> bytes:
    return (
        json.dumps(answer, allow_nan=False, ensure_ascii=False, separators=(",", ":")) + "\n"
    ).encode()


async def answer_lines(request: Request, runtime: Runtime, *, api_key: str | None) -> Response:
    """The JSON Lines call: whole-body errors as one JSON answer, else the streamed lines;
    one log line and one metrics observation per body, when its last line is written."""
    settings = runtime.settings
    arrived = time.monotonic()
    request_id = request_id_of(request)
    started = time.perf_counter()
    headers = {"x-request-id": request_id}
    log: dict[str, Any] = {"request_id": request_id, "path": request.url.path, "api": "lines"}
    try:
        authenticate(request, api_key)
        lines = await read_lines(
            request,
            max_bytes=settings.max_lines_bytes,
            max_line_bytes=settings.max_body_bytes,
            max_lines=settings.max_lines,
            timeout_seconds=settings.body_timeout_seconds,
        )
    except ApiError as error:
        error.extra["request_id"] = request_id
        response = error_response(error, **headers)
        _finish(runtime, log, response.status_code, started)
        return response
    planned = await anyio.to_thread.run_sync(
        lambda: plan(lines, settings.max_shared_decisions, settings.readout)
    )
    body = _Body(runtime, request_id, planned, len(lines))
    media_type = content_type_of(request)

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for piece in body.answers(arrived):
                yield piece
        finally:
            statuses = list(body.statuses.values())
            log.update(
                lines=body.count,
                groups=len(body.plan.groups),
                answered=len(statuses),
                line_errors=sum(1 for status in statuses if status != 200),
            )
            if len(statuses) < body.count:
                log["client_gone"] = True
            status = 200 if len(statuses) == body.count else ClientDisconnectedError.status
            _finish(runtime, log, status, started, statuses)

    return StreamingResponse(stream(), media_type=media_type, headers=headers)


def _finish(
    runtime: Runtime,
    log: dict[str, Any],
    status: int,
    started: float,
    statuses: list[int] | None = None,
) -> None:
    """The body's log line and call count (http's one tail), and each line's status."""
    finish_call(log, "lines", status, started, runtime.metrics)
    for line_status, lines in collections.Counter(statuses or ()).items():
        runtime.metrics.lines.labels(str(line_status)).inc(lines)
