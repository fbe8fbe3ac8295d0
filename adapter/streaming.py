"""Answers sent as they are made: a chat's Server-Sent Events, a decision request's JSON
Lines, fed from the scheduler's worker.

As in llama.cpp's server, a generation runs on the one thread that decodes and hands each
new piece of text to the HTTP side through a queue; the HTTP side is an async generator
that writes one `data: {json}` event per piece and `data: [DONE]` at the end. Here the
queue is the event loop's own thread-safe call queue (`Feed`): the worker's callback only
schedules a `put_nowait` there, so it never blocks and never touches the loop's state from
the wrong thread, and a waiting reader costs no thread.

Errors keep their usual answers as long as they can: the response head is sent only once
the first piece has arrived (`Feed.next`), so a refusal, a deadline or a failure before
the first token is the usual JSON error with its status; after it, the stream ends with an
error event and `[DONE]` (`EventStream` and `adapter.http.answer`), never a broken stream.
A decision stream (`LINES`) has one JSON line per result and a closing line instead; its
error is a last line `{"error", "status", ...}` (`Framing` says how each stream is framed).

Threads: `Feed.put` on any thread (the worker); everything else on the event loop. Pure: the
HTTP layer imports it without loading llama.cpp.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import anyio.to_thread
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from adapter.cancel import Cancellation
from adapter.errors import ApiError

T = TypeVar("T")
P = TypeVar("P")
MEDIA_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"
LINES_MEDIA_TYPE = "application/jsonlines"


def event(data: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event carrying `data` as strict JSON (one line: JSON escapes every
    newline inside a string, so the event cannot be split)."""
    text = json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def error_event(error: ApiError) -> bytes:
    """The event that ends a stream that failed after its first byte, in the shape OpenAI's
    streams use (`{"error": {"message": ..., "code": ...}}`), with the fields the JSON
    answer would have carried (retryable, retry_after_seconds, request_id)."""
    return event({"error": {"message": str(error), "code": error.status, **error.extra}})


def line(data: Mapping[str, Any]) -> bytes:
    """One JSON Lines line carrying `data` as strict JSON."""
    return json.dumps(data, allow_nan=False, ensure_ascii=False).encode() + b"\n"


def error_line(error: ApiError) -> bytes:
    """The line that ends a JSON Lines stream that failed after its first byte: the JSON
    error answer's fields with the status it would have had (as a JSON Lines body's error
    lines carry theirs)."""
    return line({"status": error.status, **error.body()})


@dataclass(frozen=True)
class Framing:
    """How a stream is written: its media type, the bytes an error after the first byte
    becomes, and the bytes that end it (a JSON Lines stream's own last line closes it)."""

    media_type: str
    error: Callable[[ApiError], bytes]
    end: bytes


SSE = Framing(MEDIA_TYPE, error_event, DONE)
LINES = Framing(LINES_MEDIA_TYPE, error_line, b"")


@dataclass
class Streamed:
    """A call's answer as a stream of events (an API handler returns it instead of a JSON
    body): `events` yields each event's bytes, and may raise an ApiError after its first,
    which ends the stream with the framing's error; `log` is what the call's log line adds
    once the stream has ended (the handler fills it as it learns, e.g. the tokens
    generated)."""

    events: AsyncGenerator[bytes, None]
    log: dict[str, Any] = field(default_factory=dict)
    framing: Framing = SSE


class Feed(Generic[P, T]):
    """Pieces (a chat's text, a decision's result) from a blocking call in a worker thread,
    to the event loop, in order.

    `produce(put)` runs in anyio's thread pool (the service's `generate`, which waits for
    the scheduler there); each `put(piece)`, made on the scheduler's worker (a decision's:
    on the request's thread), reaches the
    loop through `call_soon_threadsafe`. When the call ends, its task's completion queues
    the end after every piece: the worker's last `put` is scheduled before it sets the
    result the call returns, and the loop runs what is scheduled in order.
    """

    def __init__(self, produce: Callable[[Callable[[P], None]], T], cancel: Cancellation):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[P | None] = asyncio.Queue()
        self._cancel = cancel
        self._task = asyncio.create_task(anyio.to_thread.run_sync(produce, self._put))
        self._task.add_done_callback(lambda _: self._queue.put_nowait(None))

    def _put(self, piece: P) -> None:
        """Any thread; never raises (the worker calls it): once the loop has closed (the
        process is exiting) nobody is left to read the piece."""
        with suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._queue.put_nowait, piece)

    async def next(self) -> P | None:
        """The next piece; None once the call has returned and every piece was taken, and
        the call's own error once it has failed (its pieces taken first)."""
        piece = await self._queue.get()
        if piece is None:
            self._queue.put_nowait(None)  # the end stays the end for a later call
            self._task.result()  # raises the call's error
        return piece

    def result(self) -> T:
        """What the call returned (once `next` has returned None)."""
        return self._task.result()

    async def settle(self) -> None:
        """Wait for the call to end, making it end if it has not: a reader that stops before
        the end is a client that left, so the request is cancelled (the scheduler drops the
        generation at its next token). Shielded: it runs while the stream is being torn down
        for that very reason, and whatever the stream holds (its admission) is released only
        after the work is gone."""
        if not self._task.done():
            self._cancel.set("client_gone")
        with anyio.CancelScope(shield=True), suppress(Exception):
            await self._task


class EventStream(StreamingResponse):
    """A streamed response that closes its events however the response ends.

    Starlette stops iterating when the client leaves but leaves the generator suspended
    until garbage collection; its `finally` (the call's log line, the generation's
    cancellation, the admission it holds) must run now."""

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        headers: Mapping[str, str],
        media_type: str = MEDIA_TYPE,
    ):
        super().__init__(
            events, media_type=media_type, headers={"cache-control": "no-cache", **headers}
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
