"""A request's cancellation, passed as an argument from the HTTP layer down to the worker.

As llama.cpp's server hands each task a `should_stop`, every request carries one `Cancellation`:
the HTTP layer sets it when the client disconnects, the service when the request's deadline
passes while it waits for the worker; the scheduler's worker reads it between passes and
tokens and drops the work. Its reason decides the answer: a client that left gets 499
(nobody reads it; logged as such, never with a traceback), a passed deadline a 429 (come
back later). A request that waits too long in the queue is the scheduler's own 429 and
cancels nothing.

Threads: set from the event loop or a request thread, read by the worker; the first reason
set wins. Pure: the HTTP layer imports it without loading llama.cpp.
"""

from __future__ import annotations

import threading
from typing import Literal

from adapter.errors import ApiError, BusyError, ClientDisconnectedError

CancelReason = Literal["client_gone", "deadline"]


def deadline_error(where: str) -> BusyError:
    """The answer to a request whose SEMIF_REQUEST_TIMEOUT_S passed (`where` says when): a
    429, since the work that went before it took its time (a model that got slow is what
    the scoring-speed alarm reads, not this)."""
    return BusyError(
        f"the request's deadline passed {where} (SEMIF_REQUEST_TIMEOUT_S)", cause="deadline"
    )


class Cancellation:
    """Why one request should stop, once it should (its `should_stop`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: CancelReason | None = None

    def set(self, reason: CancelReason) -> None:
        with self._lock:
            if self._reason is None:
                self._reason = reason

    @property
    def reason(self) -> CancelReason | None:
        return self._reason

    def is_set(self) -> bool:
        return self._reason is not None

    def error(self) -> ApiError:
        """The answer to a request stopped for this reason."""
        if self._reason == "client_gone":
            return ClientDisconnectedError("client disconnected before the answer was ready")
        return deadline_error("before the work finished")
