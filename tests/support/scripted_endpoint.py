"""A loopback HTTP server that plays scripted answers, for what the real server never says:
other Retry-After values, 429s, SageMaker's own throttling and header-less ModelErrors.

The client under test talks to it over a real socket, through httpx (URL mode) or the real
boto3 runtime client (`endpoint_url`), so headers and botocore's parsing are exercised."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Answer:
    status: int
    body: Any
    headers: dict[str, str] = field(default_factory=dict)


OK = Answer(200, {"result": {"id": "scripted"}})


def busy(status: int = 503, retry_after: str | None = None, **body: Any) -> Answer:
    """The server's busy answer: JSON error, retryable, with an optional Retry-After."""
    headers = {} if retry_after is None else {"retry-after": retry_after}
    return Answer(status, {"error": "queue full", "retryable": True, **body}, headers)


def model_error(container: Answer) -> Answer:
    """What SageMaker makes of a container's error answer: a 424 ModelError carrying the
    container's status and body, and none of its headers."""
    original = json.dumps(container.body)
    return Answer(
        424,
        {
            "ErrorCode": "SERVER_ERROR_FROM_MODEL",
            "Message": f"Received server error ({container.status}) from primary",
            "OriginalStatusCode": container.status,
            "OriginalMessage": original,
        },
        {"x-amzn-errortype": "ModelError"},
    )


def aws_error(status: int, code: str, message: str) -> Answer:
    """An error SageMaker itself answers (throttling, service unavailable)."""
    return Answer(status, {"message": message}, {"x-amzn-errortype": code})


class ScriptedServer:
    """Answers POSTs with `script` in order, repeating the last answer once it runs out;
    `paths` records every POST (`attributes` its CustomAttributes header), `on_request`
    runs before each answer (a test advances its fake clock there to stand for the time an
    attempt takes)."""

    def __init__(self, script: list[Answer]) -> None:
        self.script = list(script)
        self.paths: list[str] = []
        self.attributes: list[str | None] = []
        self.prefix_ids: list[str | None] = []  # X-Amzn-SageMaker-Prefix-Aware-Id
        self.on_request: Callable[[], None] | None = None
        self.url = ""

    def next_answer(self, path: str, attributes: str | None, prefix_id: str | None) -> Answer:
        self.paths.append(path)
        self.attributes.append(attributes)
        self.prefix_ids.append(prefix_id)
        if self.on_request is not None:
            self.on_request()
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


@contextmanager
def scripted_server(*script: Answer) -> Iterator[ScriptedServer]:
    scripted = ScriptedServer(list(script))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            answer = scripted.next_answer(
                self.path,
                self.headers.get("x-amzn-sagemaker-custom-attributes"),
                self.headers.get("x-amzn-sagemaker-prefix-aware-id"),
            )
            payload = json.dumps(answer.body).encode()
            self.send_response(answer.status)
            for name, value in {"content-type": "application/json", **answer.headers}.items():
                self.send_header(name, value)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the tests assert on `paths`, not on stderr."""

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    scripted.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield scripted
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
