"""How the serving core fails, as types the service maps to answers (adapter.errors).

They are the core's vocabulary for "what went wrong"; the core never speaks HTTP. The
service decides what each means to a caller (a 429 to come back later, a retryable 503, a
400, a start error, an unhealthy instance), in one place (adapter.service,
`DecisionService._answering`).
"""

from __future__ import annotations

from typing import Literal


class ModelLoadError(RuntimeError):
    """The model cannot be served: load failure, missing chat template or unusable letters."""


class NativeFailureError(RuntimeError):
    """llama.cpp reported an internal error; the context can no longer be trusted."""


class CapacityError(RuntimeError):
    """A batch did not fit the KV cache; the request can be retried smaller."""


class RefusedCutError(CapacityError):
    """llama.cpp refused to cut a stream back (memory that keeps only whole streams): the
    streams were emptied, and the work can start again from scratch, on this instance."""


class CancelledWorkError(RuntimeError):
    """The work was cancelled (the server is shutting down); the KV cache was reset."""


class TooSlowError(RuntimeError):
    """A request's own passes, at the speed its first ones ran, take longer than a request
    may: no retry can help (the service answers a 400 naming the request's field)."""

    def __init__(self, needed_seconds: float, allowed_seconds: float) -> None:
        super().__init__(f"needs about {needed_seconds:.0f} s; may take {allowed_seconds:g} s")
        self.needed_seconds = needed_seconds
        self.allowed_seconds = allowed_seconds


class RefusedError(RuntimeError):
    """Load: the queue cannot take the request now (adapter.core.admission). `retry_after`
    says when to come back, `token` is the caller's place in the retry line (None when the
    line is full, or for chat, which holds no place)."""

    def __init__(
        self,
        message: str,
        cause: Literal["queue_full", "overloaded", "queue_timeout"],
        retry_after: int,
        token: str | None,
    ) -> None:
        super().__init__(message)
        self.cause = cause
        self.retry_after = retry_after
        self.token = token


class DeadlineMissedError(RuntimeError):
    """A request part-way through cannot end by its deadline at its own passes' speed, though
    it could have with the whole of its time (later, on a quieter instance, it can)."""


# The failures the core raises on purpose (the rest of an error is a bug, logged with its
# traceback where it happened).
CORE_FAILURES = (
    NativeFailureError,
    CapacityError,
    CancelledWorkError,
    TooSlowError,
    RefusedError,
    DeadlineMissedError,
)
