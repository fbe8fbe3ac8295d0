"""A real uvicorn server on a loopback port, in a thread, for clients that need a socket
(httpx, boto3) rather than Starlette's in-process TestClient."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from adapter.runtime import Runtime


@contextmanager
def live_server(app: ASGIApp, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) until the block ends; yields its base URL
    once /ping answers 200."""
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, lifespan="on", log_config=None, access_log=False
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + timeout_s
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise AssertionError("uvicorn did not start")
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        while httpx.get(f"{url}/ping").status_code != 200:
            if time.monotonic() > deadline:
                raise AssertionError("the model did not become ready")
            time.sleep(0.02)
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


class BusyFirst:
    """Wraps the app so the next `busy` POSTs find every admission slot taken: the real
    server then answers its own retryable 503 (or, on the SageMaker path, a ModelError)."""

    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime
        self.busy = 0
        self.posts = 0
        self.url = ""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self.posts += 1
            full = self.busy > 0
            self.busy = max(0, self.busy - 1)
            self.runtime.in_flight = self.runtime.settings.max_in_flight if full else 0
        await self.app(scope, receive, send)


def runtime_of(app: Any) -> Runtime:
    runtime = app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime
