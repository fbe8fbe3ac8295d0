"""Streamed answers as the client meets them, played by a loopback server: a URL's chunked
body, and InvokeEndpointWithResponseStream's binary event stream, framed as SageMaker
frames it, since moto has no response stream.

The event stream's frames are adapter.event_frames' (which the local serve streams with
too); `ModelStreamError` and `InternalStreamFailure`, which only SageMaker sends, are
exception messages whose payload is their JSON members. The real boto3 client pointed at
the server (`endpoint_url`) parses them with botocore's own `EventStream`."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from adapter.event_frames import MEDIA_TYPE as EVENT_STREAM
from adapter.event_frames import frame, payload_part
from tests.support.live_server import live_server
from tests.support.scripted_endpoint import Answer


def stream_exception(kind: str, **members: str) -> bytes:
    """`ModelStreamError` (Message, ErrorCode) or `InternalStreamFailure` (Message)."""
    headers = {
        ":exception-type": kind,
        ":message-type": "exception",
        ":content-type": "application/json",
    }
    return frame(headers, json.dumps(members).encode())


def payload_parts(body: bytes, cuts: Iterable[int]) -> bytes:
    """`body` as PayloadPart frames cut at the offsets `cuts`, wherever they fall."""
    edges = [0, *sorted({cut for cut in cuts if 0 < cut < len(body)}), len(body)]
    return b"".join(payload_part(body[a:b]) for a, b in itertools.pairwise(edges))


def pieces(data: bytes, size: int) -> list[bytes]:
    """`data` in writes of `size` bytes: frames and lines straddle the writes."""
    return [data[start : start + size] for start in range(0, len(data), size)]


@dataclass(frozen=True)
class Streamed:
    """A 200 whose body is written as `writes`, one after another; through the SageMaker
    route they are event-stream bytes and `content_type` is the container's, sent back as
    `X-Amzn-SageMaker-Content-Type`. `abort` drops the connection after the last write,
    mid-body."""

    writes: Sequence[bytes]
    content_type: str
    abort: bool = False


@dataclass
class StreamServer:
    """Plays `script` in order (the last entry again once it runs out); `requests` records
    each POST's path, headers and body."""

    script: list[Answer | Streamed]
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""

    def retry_tokens(self) -> list[str | None]:
        """Each request's CustomAttributes (where a retry token travels)."""
        return [
            headers.get("x-amzn-sagemaker-custom-attributes") for _, headers, _ in self.requests
        ]

    def next_reply(self) -> Answer | Streamed:
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


class _AbortedError(Exception):
    """Raised inside a body to make the server drop the connection part-way."""


async def _written(reply: Streamed) -> AsyncIterator[bytes]:
    for write in reply.writes:
        yield write
        await anyio.sleep(0.001)  # each write its own chunk on the wire
    if reply.abort:
        raise _AbortedError


@contextmanager
def stream_server(*script: Answer | Streamed) -> Iterator[StreamServer]:
    server = StreamServer(list(script))

    async def reply(request: Request) -> Response:
        server.requests.append((request.url.path, dict(request.headers), await request.body()))
        answer = server.next_reply()
        if isinstance(answer, Answer):
            return JSONResponse(answer.body, answer.status, answer.headers)
        if request.url.path.endswith("/invocations-response-stream"):
            headers = {"x-amzn-sagemaker-content-type": answer.content_type}
            return StreamingResponse(_written(answer), media_type=EVENT_STREAM, headers=headers)
        return StreamingResponse(_written(answer), media_type=answer.content_type)

    async def ping(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    app = Starlette(
        routes=[
            Route("/ping", ping),
            Route("/invocations", reply, methods=["POST"]),
            Route("/endpoints/{name}/invocations-response-stream", reply, methods=["POST"]),
        ]
    )
    with live_server(app) as url:
        server.url = url
        yield server


def sse(*data: Any) -> bytes:
    """Server-Sent Events, one per item (a JSON object, or a string sent as it is)."""
    return b"".join(
        f"data: {item if isinstance(item, str) else json.dumps(item)}\n\n".encode() for item in data
    )


def json_lines(*items: Mapping[str, Any]) -> bytes:
    return b"".join(json.dumps(item, ensure_ascii=False).encode() + b"\n" for item in items)


def decision_result(decision_id: str) -> dict[str, Any]:
    """A decision's result as a stream line carries it (the fields `DecisionResult` reads)."""
    return {
        "id": decision_id,
        "option_ids": ["a", "b"],
        "probabilities": [0.25, 0.75],
        "allowed_token_mass": 0.9,
        "input_tokens": 40,
        "prompt_sha256": "0" * 64,
    }
