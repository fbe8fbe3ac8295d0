"""Reading a streamed answer: bytes cut anywhere -> lines -> events -> typed items.

Both transports hand over a streamed body as chunks whose boundaries mean nothing: httpx
gives what each socket read returned, and SageMaker's InvokeEndpointWithResponseStream
cuts the container's body into `PayloadPart`s wherever it likes (a line may straddle two
parts, a part may hold many lines, a multi-byte character may be split between two). So
nothing here looks at a chunk on its own: `lines` reassembles complete lines first, and
only a complete line is decoded (a UTF-8 character never contains a newline byte, so a
line cut at its end holds only whole characters). Above the lines, two readers:

- `ChatStream`: Server-Sent Events (`sse_data`) in OpenAI's `chat.completion.chunk`
  format, ended by `data: [DONE]`; the endpoint's own chat and llama-server's alike.
- `DecisionStream`: JSON Lines, one `{"index", "result"}` per decision as it is scored,
  then `{"done": true, "model", "timing", "request_id"}`.

An error the endpoint sends after its first byte (its status was already 200) is an error
line or event, raised as the error the same answer would have been before the first byte
(`client.error_mapping.error_from_body`). A stream that ends without its closing line or
`[DONE]` was cut, and says so (`StreamError`): a reader that stopped at the last complete
item would pass a partial answer off as whole.

Pure: no I/O and no imports beyond the client's parsing and errors, so the reassembly is
tested on every chunking of a stream (`tests/client/test_streams.py`).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

from client.answers import DecisionResult
from client.error_mapping import error_from_body
from client.errors import EndpointError, StreamError

T = TypeVar("T")
# SSE ends a line with CRLF, LF or CR (WHATWG HTML, "Parsing an event stream"); JSON Lines
# with LF or CRLF, and a bare CR cannot occur in a JSON line (JSON escapes it).
_LINE_END = re.compile(rb"\r\n|\r|\n")
DONE = "[DONE]"  # the data of the last event of an OpenAI stream
# An error line's status when it names none (or a wrong one): the server failed.
_UNKNOWN_STATUS = 500


def lines(chunks: Iterable[bytes]) -> Iterator[str]:
    """The lines of a body that arrives in chunks cut anywhere, without their line ends,
    each decoded once it is whole; a last line without a line end too. A CR at the end of a
    chunk waits for the next one: it may be the first half of a CRLF."""
    pending = b""
    for chunk in chunks:
        # `pending` holds no line end but perhaps a last CR: scan from there only.
        scan_from = max(0, len(pending) - 1)
        pending += chunk
        start = 0
        for end in _LINE_END.finditer(pending, scan_from):
            if end.group() == b"\r" and end.end() == len(pending):
                break
            yield _decoded(pending[start : end.start()])
            start = end.end()
        pending = pending[start:]
    if pending:
        yield _decoded(pending.removesuffix(b"\r"))


def _decoded(line: bytes) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        raise EndpointError(200, "the endpoint streamed a line that is not UTF-8", line) from None


def sse_data(lines: Iterable[str]) -> Iterator[str]:
    """The data of each Server-Sent Event, as the WHATWG HTML standard reads an event
    stream: the `data:` lines of an event joined by newlines, the event dispatched at a
    blank line; comments (`:`) and other fields ignored. An event whose blank line never
    came is dropped, as the standard says: it may be incomplete."""
    data: list[str] | None = None
    for line in lines:
        if not line:
            if data is not None:
                yield "\n".join(data)
            data = None
            continue
        name, colon, value = line.partition(":")
        if name == "data":
            data = [*(data or []), value.removeprefix(" ") if colon else ""]


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise EndpointError(200, "the endpoint streamed a line that is not a JSON object", text)
    return value


def _error_status(status: Any) -> int:
    """An error line's status: the integer it names, else 500."""
    if isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599:
        return status
    return _UNKNOWN_STATUS


class _Reader(ABC, Generic[T]):
    """An iterator over a streamed answer's items that lets go of the connection as soon
    as the answer has ended, failed or been abandoned (`close`, or `with`)."""

    def __init__(self, chunks: Iterable[bytes], close: Callable[[], None]) -> None:
        self._items = self._read(lines(chunks))
        self._close = close

    @abstractmethod
    def _read(self, lines: Iterator[str]) -> Iterator[T]:
        """The items of the answer's lines, raising what an error line or a cut means."""

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> T:
        try:
            return next(self._items)
        except BaseException:  # the end, an error, or an interrupt: nothing more to read
            self.close()
            raise

    def close(self) -> None:
        """Stop reading and close the connection (the server sees the client leave)."""
        self._close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class ChatUsage:
    prompt_tokens: int
    completion_tokens: int


class ChatStream(_Reader[str]):
    """A streamed chat completion: iterating yields each piece of text as the model writes
    it. Once the iteration has ended, `finish_reason` ("stop", "length") is set, `usage`
    too when the request asked for it (`stream_options.include_usage`; llama-server sends
    it always), and `id` and `model` name the completion."""

    finish_reason: str | None = None
    usage: ChatUsage | None = None
    id: str | None = None
    model: str | None = None

    def _read(self, lines: Iterator[str]) -> Iterator[str]:
        for data in sse_data(lines):
            if data == DONE:
                if self.finish_reason is None:
                    raise EndpointError(200, "the chat stream ended without a finish reason")
                return
            chunk = _json_object(data)
            if "error" in chunk:
                raise _chat_error(chunk["error"])
            self.id = chunk.get("id", self.id)
            self.model = chunk.get("model", self.model)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                self.usage = ChatUsage(int(usage["prompt_tokens"]), int(usage["completion_tokens"]))
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    yield str(text)
                if choice.get("finish_reason") is not None:
                    self.finish_reason = str(choice["finish_reason"])
        raise StreamError("StreamCut", "the chat stream ended before its [DONE] event")


def _chat_error(error: Any) -> EndpointError:
    """OpenAI's error event (`{"error": {"message", "type", "code"}}`, the endpoint's and
    llama-server's) as the error its JSON answer would have been."""
    if not isinstance(error, dict):
        return error_from_body(_UNKNOWN_STATUS, {"error": str(error)})
    fields = {key: value for key, value in error.items() if key != "message"}
    return error_from_body(
        _error_status(error.get("code")), {**fields, "error": str(error.get("message"))}
    )


@dataclass(frozen=True)
class StreamedDecision:
    """One decision's answer as it arrived: `index` is its place in the request's
    `decisions` (0 for a single `decision`), since answers arrive as they are scored."""

    index: int
    result: DecisionResult


@dataclass(frozen=True)
class DecisionStreamSummary:
    """The closing line of a decision stream: what a whole answer carries beside its
    results."""

    model: dict[str, Any]
    timing: dict[str, Any]
    request_id: str
    raw: dict[str, Any] = field(repr=False)


class DecisionStream(_Reader[StreamedDecision]):
    """A streamed decision answer: iterating yields each decision as it is scored, in the
    order they finish. Once the iteration has ended, `summary` holds the closing line
    (None before). Every decision asked for arrives exactly once before it, or the stream
    raises: an answer never goes missing unsaid."""

    summary: DecisionStreamSummary | None = None

    def __init__(self, chunks: Iterable[bytes], close: Callable[[], None], asked: int) -> None:
        self.asked = asked
        super().__init__(chunks, close)

    def _read(self, lines: Iterator[str]) -> Iterator[StreamedDecision]:
        arrived: set[int] = set()
        for line in lines:
            if not line.strip():
                continue
            try:
                item = _json_object(line)
            except EndpointError:
                if next(lines, None) is None:
                    break  # the last line, cut part-way: the stream was cut
                raise
            if "error" in item:
                raise error_from_body(_error_status(item.get("status")), item)
            if item.get("done") is True:
                missing = sorted(set(range(self.asked)) - arrived)
                if missing:
                    raise EndpointError(
                        200, f"the stream closed without the decisions at {missing}", item
                    )
                self.summary = DecisionStreamSummary(
                    dict(item["model"]), dict(item["timing"]), str(item["request_id"]), item
                )
                return
            index = item.get("index")
            if type(index) is not int or not 0 <= index < self.asked or index in arrived:
                raise EndpointError(200, f"the stream sent an unexpected line: {line}", item)
            arrived.add(index)
            yield StreamedDecision(index, DecisionResult.from_json(item["result"]))
        raise StreamError(
            "StreamCut",
            f"the stream ended after {len(arrived)} of {self.asked} decisions, before its "
            "closing line",
        )
