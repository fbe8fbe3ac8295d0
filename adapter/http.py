"""HTTP plumbing shared by every route: bodies, request ids, auth, one error map, one log line.

`answer` runs one API call and turns whatever it raises into a JSON answer: an `ApiError`
carries its own status, body and headers; anything else is a 500 that is logged with its
traceback but never shown to the caller. Each call writes exactly one JSON log line.

Bodies are read within a size limit and a time limit (a client that announces more bytes
than it sends gets a 408, one that disconnects is logged as 499), parsed strictly (no NaN,
no duplicate keys) and walked once: every string and key must be valid Unicode (no lone
surrogates, which the JSON decoder lets through from `\ud800` escapes or CESU-8 bytes),
numbers finite and nesting bounded, else a 400 naming the JSON path.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from adapter.cancel import Cancellation
from adapter.errors import (
    ApiError,
    ClientDisconnectedError,
    PayloadTooLargeError,
    RequestError,
    RequestTimeoutError,
    RetryLaterError,
    UnauthorizedError,
    UnsupportedMediaTypeError,
)
from adapter.event_frames import CONTENT_TYPE_HEADER, payload_part
from adapter.event_frames import MEDIA_TYPE as EVENT_FRAMES
from adapter.fields import member_path
from adapter.metrics import Metrics
from adapter.streaming import LINES_MEDIA_TYPE, EventStream, Streamed

LOG = logging.getLogger("adapter.requests")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_JSON_DEPTH = 64  # far beyond any valid body; keeps every later walk shallow
# An API call: (body, request id, the request's cancellation, the retry token it brought)
# -> (response body, or the events of a streamed answer; extra log fields).
Call = Callable[
    [Any, str, Cancellation, str | None],
    Awaitable[tuple[dict[str, Any] | Streamed, dict[str, Any]]],
]
# A 429's retry_token comes back in the header SageMaker forwards InvokeEndpoint's
# CustomAttributes as (the only request header a caller controls through SageMaker), as
# `semif-retry-token=<token>`, beside any other attributes (separated by `;` or `,`).
CUSTOM_ATTRIBUTES_HEADER = "x-amzn-sagemaker-custom-attributes"
RETRY_TOKEN_ATTRIBUTE = "semif-retry-token"  # noqa: S105 - a name, not a secret
_RETRY_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def json_response(status: int, body: dict[str, Any], **headers: str) -> Response:
    """Serialise strictly: NaN or Infinity must never reach a client as invalid JSON."""
    content = json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return Response(content, status_code=status, media_type="application/json", headers=headers)


def error_response(error: ApiError, **headers: str) -> Response:
    return json_response(error.status, error.body(), **error.headers(), **headers)


def accepts_lines(request: Request) -> bool:
    """Whether the caller asked for a streamed decision answer: `Accept:
    application/jsonlines`, as sent directly or as SageMaker forwards
    InvokeEndpointWithResponseStream's `Accept` (X-Amzn-SageMaker-Accept)."""
    asked = (request.headers.get(name, "") for name in ("accept", "x-amzn-sagemaker-accept"))
    return any(
        part.split(";", 1)[0].strip().lower() in (LINES_MEDIA_TYPE, "application/x-jsonlines")
        for value in asked
        for part in value.split(",")
    )


def content_type_of(request: Request) -> str:
    """The request's media type, lower case, without parameters ("" when absent)."""
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def read_json_body(request: Request, max_bytes: int, timeout_seconds: float = 30.0) -> Any:
    """Read and parse a JSON body, enforcing content type, size and time before parsing,
    then check every string, key and number (`check_json`)."""
    content_type = content_type_of(request)
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise UnsupportedMediaTypeError(
            f"content type {content_type or 'missing'!r}: send application/json (or "
            "application/jsonlines to /invocations, one request per line)"
        )
    chunks: list[bytes] = []

    async def keep(chunk: bytes) -> None:
        chunks.append(chunk)

    await read_body(request, keep, max_bytes, timeout_seconds, limit_name="SEMIF_MAX_BODY_BYTES")
    return parse_json(b"".join(chunks))


async def read_body(
    request: Request,
    take: Callable[[bytes], Awaitable[None]],
    max_bytes: int,
    timeout_seconds: float,
    *,
    limit_name: str,
) -> None:
    """Hand each chunk of the body to `take` as it arrives, within `max_bytes` (the setting
    `limit_name`: a 413 as soon as the body announces or sends more) and `timeout_seconds`
    for all of it, `take`'s time included (a 408); a client gone before the end is a 499.
    `take` is awaited, so what it does with a chunk may leave the event loop (a JSON Lines
    chunk of many lines is parsed in a worker thread)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLargeError(
            f"body is {declared} bytes; the limit is {max_bytes} ({limit_name})"
        )
    size = 0
    try:
        with anyio.fail_after(timeout_seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLargeError(f"body exceeds {max_bytes} bytes ({limit_name})")
                await take(chunk)
    except TimeoutError:
        raise RequestTimeoutError(
            f"body did not arrive within {timeout_seconds:g} s (SEMIF_BODY_TIMEOUT_S; "
            f"{size} bytes received)"
        ) from None
    except ClientDisconnect:
        raise ClientDisconnectedError(field="body") from None


def parse_json(raw: bytes) -> Any:
    """Parse one JSON document strictly (no NaN, no duplicate keys) and `check_json` it;
    a body's or one JSON Lines line's (adapter.lines)."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, object_pairs_hook=_unique_keys)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError("body", f"invalid JSON ({_ascii(str(error))})") from None
    except RecursionError:
        raise RequestError("body", "invalid JSON (nested too deeply)") from None
    check_json(body)
    return body


def _ascii(text: str) -> str:
    """Text safe to echo: anything not printable ASCII escaped (a lone surrogate cannot be
    encoded in a response)."""
    return text.encode("ascii", "backslashreplace").decode("ascii")


def _path(parts: tuple[Any, ...] | None) -> str:
    """Materialise a (parent, component) chain into a JSON path."""
    components: list[str | int] = []
    while parts is not None:
        parts, component = parts
        components.append(component)
    path = ""
    for component in reversed(components):
        path = (
            f"{path or 'body'}[{component}]"
            if isinstance(component, int)
            else (member_path(path, component))
        )
    return path or "body"


def _unicode_problem(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        bad = text[error.start]
        return f"lone surrogate \\u{ord(bad):04x} at character {error.start}"
    return None


def check_json(body: Any) -> None:
    """Walk the parsed body once (iteratively): every key and string valid Unicode, every
    number finite, nesting at most MAX_JSON_DEPTH; else a 400 naming the JSON path."""
    stack: list[tuple[Any, tuple[Any, ...] | None, int]] = [(body, None, 0)]
    while stack:
        value, parts, depth = stack.pop()
        if isinstance(value, str):
            problem = _unicode_problem(value)
            if problem is not None:
                raise RequestError(_path(parts), f"is not valid Unicode ({problem}); send UTF-8")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise RequestError(_path(parts), "number is out of range")
        elif isinstance(value, dict | list):
            if depth >= MAX_JSON_DEPTH:
                raise RequestError(_path(parts), f"nested deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(value, list):
                stack.extend((item, (parts, index), depth + 1) for index, item in enumerate(value))
                continue
            for key, item in value.items():
                problem = _unicode_problem(key)
                if problem is not None:
                    raise RequestError(
                        _path((parts, key)), f"key is not valid Unicode ({problem}); send UTF-8"
                    )
                stack.append((item, (parts, key), depth + 1))


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Refuse duplicate object keys: JSON parsers disagree on which one wins, and a
    duplicated option or question would otherwise vanish silently."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {json.dumps(key)}")
        result[key] = value
    return result


def request_id_of(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


def authenticate(request: Request, api_key: str | None) -> None:
    """With SEMIF_API_KEY set, the /v1 routes need `Authorization: Bearer <key>`."""
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    ):
        raise UnauthorizedError(
            "missing or wrong API key: send Authorization: Bearer <SEMIF_API_KEY>"
        )


def retry_token_of(request: Request) -> str | None:
    """The retry token the request brought back (adapter.core.retry_line), or None; a
    malformed one is a 400 naming the header, never a silent newcomer."""
    attributes = request.headers.get(CUSTOM_ATTRIBUTES_HEADER, "")
    for attribute in re.split(r"[;,]", attributes):
        key, _, value = attribute.partition("=")
        if key.strip() == RETRY_TOKEN_ATTRIBUTE:
            if not _RETRY_TOKEN.match(value.strip()):
                raise RequestError(
                    f"headers.{CUSTOM_ATTRIBUTES_HEADER}",
                    f"{RETRY_TOKEN_ATTRIBUTE} must be the retry_token of a 429 answer "
                    "(1 to 64 characters from A-Z a-z 0-9 _ -)",
                )
            return value.strip()
    return None


async def answer(
    request: Request,
    call: Callable[[Any], tuple[str, Call]],
    *,
    max_body_bytes: int,
    api_key: str | None = None,
    body_timeout_seconds: float = 30.0,
    metrics: Metrics | None = None,
) -> Response:
    """Run one API call (`call(body)` picks it from the parsed body, and names its API):
    check the key when one is given, read the body, map every error to its JSON answer, and
    log the call once and count it in `metrics` from the same fields. A call answered as a
    stream (`Streamed`) is logged when the stream ends, and its client is watched until
    then."""
    request_id = request_id_of(request)
    started = time.perf_counter()
    log: dict[str, Any] = {"request_id": request_id, "path": request.url.path}
    headers = {"x-request-id": request_id}
    cancel = Cancellation()
    api = "unknown"  # until the body names one
    watcher: asyncio.Task[None] | None = None

    def finish(status: int) -> None:
        if cancel.reason == "client_gone":
            # It left before the answer was ready (the watcher stops once the call returns):
            # whatever was computed goes to nobody, which is a 499 however the work ended.
            log["client_gone"] = True
            status = ClientDisconnectedError.status
        finish_call(log, api, status, started, metrics)

    try:
        authenticate(request, api_key)
        retry_token = retry_token_of(request)
        body = await read_json_body(request, max_body_bytes, body_timeout_seconds)
        watcher = asyncio.create_task(watch_disconnect(request, cancel))
        api, run = call(body)
        log["api"] = api
        payload, details = await run(body, request_id, cancel, retry_token)
        log.update(details)
        if isinstance(payload, Streamed):
            events = _events(payload, log, request_id, watcher, finish)
            stream = EventStream(events, headers, payload.framing.media_type)
            watcher = None  # watched until the stream ends
            return stream
        response = json_response(200, payload, **headers)
    except ApiError as error:
        response = error_response(_logged(error, log, request_id), **headers)
    except Exception:
        LOG.exception("scoring failed (request_id=%s)", request_id)
        response = json_response(
            500, {"error": "scoring failed", "request_id": request_id}, **headers
        )
    finally:
        if watcher is not None:
            watcher.cancel()
    finish(response.status_code)
    return response


def _logged(error: ApiError, log: dict[str, Any], request_id: str) -> ApiError:
    """An error as answered: with the request id, its cause (a 429's, a 503's) in the log
    line and so in the metrics."""
    error.extra["request_id"] = request_id
    if isinstance(error, RetryLaterError) and error.cause is not None:
        log[error.log_field] = error.cause
    return error


async def _events(
    streamed: Streamed,
    log: dict[str, Any],
    request_id: str,
    watcher: asyncio.Task[None],
    finish: Callable[[int], None],
) -> AsyncGenerator[bytes, None]:
    """A streamed answer's bytes, then its framing's end (a chat's `[DONE]`): an error after
    the first byte ends it with the framing's error (an event, a line) instead of a broken
    stream, and is logged with its own status (the
    HTTP status already sent was 200). The call is finished once, however it ends (a client
    that left closes this generator: adapter.streaming.EventStream)."""
    status = 200
    try:
        async with aclosing(streamed.events) as events:
            try:
                async for chunk in events:
                    yield chunk
            except ApiError as error:
                status = error.status
                yield streamed.framing.error(_logged(error, log, request_id))
            except Exception:
                LOG.exception("streaming failed (request_id=%s)", request_id)
                status = 500
                failed = ApiError("streaming failed")
                yield streamed.framing.error(_logged(failed, log, request_id))
        if streamed.framing.end:
            yield streamed.framing.end
    finally:
        watcher.cancel()
        log.update(streamed.log, streamed=True)
        finish(status)


def finish_call(
    log: dict[str, Any], api: str, status: int, started: float, metrics: Metrics | None
) -> None:
    """The one tail of every call (`answer`'s, and a JSON Lines body's, adapter.lines): its
    status and seconds into its log line, the line written once, the call counted from the
    same fields."""
    seconds = time.perf_counter() - started
    log.update(status=status, seconds=round(seconds, 6))
    LOG.info(json.dumps(log, default=str, allow_nan=True))
    if metrics is not None:
        metrics.observe_call(api, status, seconds, log)


async def watch_disconnect(request: Request, cancel: Cancellation) -> None:
    """Once the body is read, the next ASGI message can only be the client leaving: cancel
    the request so queued work for nobody is dropped (adapter.cancel)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set("client_gone")
            return


def as_response_stream(response: Response) -> Response:
    """Answer as SageMaker's InvokeEndpointWithResponseStream does: the container's 2xx
    body as `PayloadPart` events, each piece framed as it is written, its content type in
    `X-Amzn-SageMaker-Content-Type` (adapter.event_frames); any other answer as
    InvokeEndpoint's ModelError (`as_sagemaker_runtime`), as SageMaker answers an error
    before the stream began."""
    if response.status_code >= 300:
        return as_sagemaker_runtime(response)
    headers = {
        CONTENT_TYPE_HEADER: response.headers["content-type"],
        "x-amzn-invoked-production-variant": "AllTraffic",
        **{name: response.headers[name] for name in ("x-request-id",) if name in response.headers},
    }
    if isinstance(response, StreamingResponse):
        return EventStream(_framed(response.body_iterator), headers, EVENT_FRAMES)
    return Response(payload_part(bytes(response.body)), media_type=EVENT_FRAMES, headers=headers)


async def _framed(chunks: AsyncIterable[str | bytes | memoryview]) -> AsyncGenerator[bytes, None]:
    """A streamed answer's pieces as PayloadPart events; closing this closes the answer's own
    events, so the call's end (its log line, its admission) runs as it does unframed."""
    try:
        async for chunk in chunks:
            yield payload_part(chunk.encode() if isinstance(chunk, str) else bytes(chunk))
    finally:
        if isinstance(chunks, AsyncGenerator):
            await chunks.aclose()


def as_sagemaker_runtime(response: Response) -> Response:
    """Answer as SageMaker's InvokeEndpoint does: the container's 2xx body as is, any other
    answer wrapped in a 424 ModelError carrying the original status and body."""
    if response.status_code < 300:
        response.headers["x-amzn-invoked-production-variant"] = "AllTraffic"
        return response
    original = bytes(response.body).decode("utf-8", errors="replace")
    side = "client" if response.status_code < 500 else "server"
    body = {
        "ErrorCode": f"{side.upper()}_ERROR_FROM_MODEL",
        "Message": (
            f"Received {side} error ({response.status_code}) from primary with message "
            f'"{original}".'
        ),
        "OriginalMessage": original,
        "OriginalStatusCode": response.status_code,
        "LogStreamArn": "local",
    }
    # Keep what the container's answer told the connection and the caller (close after a
    # body timeout, the request id, when to retry).
    kept = {
        name: response.headers[name]
        for name in ("connection", "x-request-id", "retry-after")
        if name in response.headers
    }
    return json_response(
        424,
        body,
        **kept,
        **{"x-amzn-errortype": "ModelError:http://internal.amazon.com/coral/com.amazon.sagemaker/"},
    )
