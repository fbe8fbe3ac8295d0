"""How the serving core fails, as types the service maps to answers (adapter.errors).

They are the core's vocabulary for "what went wrong": the service and the scheduler decide
what each means to a caller (a retryable 503, a start error, an unhealthy instance).
"""

from __future__ import annotations


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
