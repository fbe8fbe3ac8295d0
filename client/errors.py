"""The exceptions the client raises, and nothing else.

They sit below every other client module: the transports raise them, the answer parsers
and the batch paths raise them, and application code catches them, so none of those has to
import another to name a failure. What an error *answer* means (which status is busy, the
Retry-After hint, SageMaker's ModelError) is `client.error_mapping`'s job, not this one's.
"""

from __future__ import annotations

from typing import Any


class EndpointError(Exception):
    """The endpoint answered with an error; `message` is its own explanation."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.body = body


class BusyError(EndpointError):
    """A retryable answer: 429, 503 unless the body says `"retryable": false`, SageMaker
    throttling. Raised by the client once the retry policy gives up (the last answer is its
    `__cause__`). `retry_after_s` is the endpoint's hint, None when it gave none;
    `retry_token` the place in its retry line to send back with the next attempt."""

    def __init__(
        self,
        status: int,
        message: str,
        body: Any = None,
        *,
        retry_after_s: float | None = None,
        retry_token: str | None = None,
    ) -> None:
        super().__init__(status, message, body)
        self.retry_after_s = retry_after_s
        self.retry_token = retry_token


class ScaledToZeroError(EndpointError):
    """The endpoint's inference component has no copy running: it scaled to zero while no
    call came. The refused call itself starts a copy, which takes minutes (an instance, the
    model's download, its health check). Raised at once unless the client was given a
    wake-up budget (`client.retry.WakeUp`), and then once the budget is spent."""


class UnreachableError(EndpointError):
    """No HTTP answer at all (connection refused, timeout); status is 0."""


class StreamError(EndpointError):
    """A streamed answer broke after its head said 2xx: SageMaker's `ModelStreamError` or
    `InternalStreamFailure`, a connection lost part-way, or a stream that ended before its
    closing line. Never retried by the client: what arrived before the break was already
    handed to the caller, and a second try would hand it over again. `status` is 0 (the
    HTTP status was a 2xx; nothing answered another); `code` names what happened, e.g.
    `ModelStreamError`, `InternalStreamFailure`, `StreamCut`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(0, f"{code}: {message}")
        self.code = code


class BatchInputError(ValueError):
    """The input or the part file cannot be used (a usage error for the CLI)."""
