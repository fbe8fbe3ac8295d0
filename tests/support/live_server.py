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

from adapter.core.scheduler import Scheduler
from adapter.runtime import Runtime
from adapter.serve import HeadDeadlineProtocol


@contextmanager
def live_server(app: ASGIApp, timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) until the block ends; yields its base URL
    once /ping answers 200."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        http=HeadDeadlineProtocol,  # as `serve` runs it
        lifespan="on",
        log_config=None,
        access_log=False,
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
    """Wraps the app so the next `busy` POSTs find the scheduler's queue full: the real
    admission check (the core's own, with the queue counted as SEMIF_MAX_QUEUE deep)
    then answers its 429 (or, on the SageMaker path, a ModelError)."""

    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime
        self.busy = 0
        self.posts = 0
        self.url = ""
        self._full = False
        self._hooked: Scheduler | None = None

    def _hook(self) -> None:
        """Route the scheduler's admission check through `_full` (once, after the load)."""
        service = self.runtime.service
        if service is None or self._hooked is service.scheduler:
            return
        scheduler = service.scheduler
        admission = scheduler.admission
        real_admit = admission.admit

        def admit(
            now: float, queue: Any, waiting: int, retry_token: str | None, *, claim: bool
        ) -> None:
            full = admission.max_queue if self._full else waiting
            real_admit(now, queue, full, retry_token, claim=claim)

        admission.admit = admit  # type: ignore[method-assign,assignment]
        self._hooked = scheduler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            self._hook()
            self.posts += 1
            self._full = self.busy > 0
            self.busy = max(0, self.busy - 1)
        await self.app(scope, receive, send)


def runtime_of(app: Any) -> Runtime:
    runtime = app.state.runtime
    assert isinstance(runtime, Runtime)
    return runtime


def post_in_background(url: str, body: dict[str, Any]) -> threading.Thread:
    """POST `body` to `url`/invocations from a started thread (join it when done)."""
    thread = threading.Thread(
        target=httpx.post, args=(f"{url}/invocations",), kwargs={"json": body, "timeout": 30}
    )
    thread.start()
    return thread
