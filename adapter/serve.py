"""`serve`: the container entry point (SageMaker runs `IMAGE serve`) and the local dev server.

Order of start-up, each failure one line naming its cause:
1. settings, validated before anything imports llama.cpp (the binding loads libllama at
   import, so a bad LLAMA_CPP_LIB_PATH is a settings error, not a traceback);
2. the listening socket, bound before the model loads (a port in use is found at once);
3. the app, which loads the model; a model that fails to load stops the process with exit
   code 1 after /ping has reported the failure.

Shutdown (SIGTERM from SageMaker, or Ctrl-C): admission stops at once (new requests and
/ping get 503), idle keep-alive connections close, in-flight work may finish within
SEMIF_SHUTDOWN_GRACE_S and is cancelled after that, and uvicorn's own graceful
timeout backs it up, all inside SageMaker's 30 s before SIGKILL.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import socket
import sys
from types import FrameType
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from adapter.settings import Settings, SettingsError, load_settings

KEEP_ALIVE_SECONDS = 75  # longer than SageMaker's 60 s idle connection reuse
# A request's head (request line and headers) must arrive within this many seconds of its
# first byte; SageMaker's front end sends it at once.
HEAD_TIMEOUT_SECONDS = 10.0
# After the grace period: time for cancelled work to reach a decode boundary and answer.
SHUTDOWN_BACKSTOP_SECONDS = 4


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )


def bind(settings: Settings) -> socket.socket:
    """Listen on the configured address now, before the model loads.

    The protocol is named: asyncio turns Nagle's algorithm off only on connections whose
    socket says IPPROTO_TCP, and with it on every answer's body waits for the client's
    delayed ACK of its headers (40 ms a request on Linux keep-alive connections)."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        source = "SEMIF_HOST/SAGEMAKER_BIND_TO_PORT/SEMIF_PORT"
        raise SettingsError(
            f"cannot listen on {settings.host}:{settings.port} ({source}): {error.strerror}"
        ) from None
    sock.set_inheritable(True)
    return sock


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on every request head.

    uvicorn times a connection out only while it idles after a response (keep-alive); one
    that opens and sends nothing, or trickles a header line every few seconds, would hold
    its socket forever. Here a new connection gets the same idle limit as one between
    requests (KEEP_ALIVE_SECONDS: SageMaker may open one before it has a request), and a
    head must be complete within HEAD_TIMEOUT_SECONDS of its first byte; either way the
    connection is closed (there is no request yet to answer). The body has its own limit
    (SEMIF_BODY_TIMEOUT_S, adapter.http)."""

    head_timeout_seconds = HEAD_TIMEOUT_SECONDS
    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # uvicorn's own idle timer, which it cancels when data arrives.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # the head is still incomplete
            if self._head_deadline is None:
                self._arm_head_deadline()
        elif self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _arm_head_deadline(self) -> None:
        self._head_deadline = self.loop.call_later(self.head_timeout_seconds, self._head_late)

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn, telling the app the moment a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, on_exit: Any) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    """Run the server; `serve` with no arguments, as SageMaker calls it."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["serve"]):
        sys.exit(f"usage: serve  (settings come from SEMIF_* environment variables; got {args})")
    configure_logging()
    # A native crash (SIGSEGV, SIGABRT from a llama.cpp assert) still kills the process, but
    # first prints every thread's Python stack to stderr: the log says where it died.
    faulthandler.enable()
    try:
        settings = load_settings()
        sock = bind(settings)
    except SettingsError as error:
        sys.exit(f"serve: {error}")
    try:
        from adapter.app import create_app  # imports llama_cpp, which loads libllama
    # A libllama that exists but cannot be loaded: ctypes raises OSError, and the binding
    # turns that into a RuntimeError ("Failed to load shared library ...").
    except (OSError, RuntimeError) as error:
        sys.exit(
            f"serve: cannot load llama.cpp (LLAMA_CPP_LIB_PATH={settings.llama_lib_path}): {error}"
        )

    failures: list[str] = []
    server: uvicorn.Server | None = None

    def stop_on_load_failure(message: str) -> None:
        failures.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_load_failure=stop_on_load_failure)
    runtime = app.state.runtime
    config = uvicorn.Config(
        app,
        http=HeadDeadlineProtocol,
        lifespan="on",
        access_log=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=int(settings.shutdown_grace_seconds) + SHUTDOWN_BACKSTOP_SECONDS,
        log_config=None,
    )
    server = _Server(config, lambda: runtime.begin_shutdown(settings.shutdown_grace_seconds))
    server.run(sockets=[sock])
    if failures:
        sys.exit(f"serve: model load failed: {failures[0]}")


if __name__ == "__main__":
    main()
