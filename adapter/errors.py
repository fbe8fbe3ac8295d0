"""Every error a request can end in, each carrying its own HTTP status and JSON body.

The HTTP layer has one handler for all of them (`adapter.http`), so a new error type needs
no new mapping: give it a status, and a field path where the caller can fix something.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal


class ApiError(Exception):
    """An answer other than 200: `status`, a message, optional extra body fields and headers."""

    status: ClassVar[int] = 500

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.extra = extra

    def body(self) -> dict[str, Any]:
        return {"error": str(self), **self.extra}

    def headers(self) -> dict[str, str]:
        return {}


class RequestError(ApiError):
    """A request broke a schema rule; the message starts with the JSON path of the field."""

    status = 400

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"{path}: {rule}", field=path)
        self.path = path


class SchemaError(RequestError):
    """The body does not have the shape its format requires (System One answers 422)."""

    status = 422


class UnsupportedMediaTypeError(ApiError):
    status = 415

    def __init__(self, message: str) -> None:
        super().__init__(message, field="headers.content-type")


class PayloadTooLargeError(ApiError):
    status = 413

    def __init__(self, message: str) -> None:
        super().__init__(message, field="body")

    def headers(self) -> dict[str, str]:
        # The unread rest of the body would be taken for the next request: close.
        return {"connection": "close"}


class RequestTimeoutError(ApiError):
    """The body did not arrive in full within SEMIF_BODY_TIMEOUT_S."""

    status = 408

    def __init__(self, message: str) -> None:
        super().__init__(message, field="body")

    def headers(self) -> dict[str, str]:
        # The rest of the body may still arrive: the connection cannot be reused.
        return {"connection": "close"}


class ClientDisconnectedError(ApiError):
    """The client went away (before its body arrived, or while its request waited or ran);
    nobody reads the answer, and it is logged as 499 (nginx's "client closed request"), not
    as a server error."""

    status = 499

    def __init__(
        self, message: str = "client disconnected before the body arrived", **extra: Any
    ) -> None:
        super().__init__(message, **extra)


class UnauthorizedError(ApiError):
    status = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, field="headers.authorization")

    def headers(self) -> dict[str, str]:
        return {"www-authenticate": "Bearer"}


# Why a call was told to come back later: load (429, "slow down": the queue is full, the work
# ahead outlasts the queue timeout, the request waited or ran past its time) or the server
# itself (503: loading, unhealthy, stopping, or a batch the KV cache could not hold). The
# two are kept apart end to end because SageMaker counts every 5XX a container answers in
# Invocation5XXErrors, which the rollback and paging alarms read: overload must not look
# like failure. A small fixed set of words, logged and counted, never answered.
BusyCause = Literal["queue_full", "overloaded", "queue_timeout", "deadline"]
UnavailableCause = Literal["loading", "unhealthy", "stopping", "capacity"]


class RetryLaterError(ApiError):
    """An answer that says when to come back: `retryable` whether a retry after
    `Retry-After` seconds can succeed, `cause` (logged, not answered) why, and
    `retry_token` (answered) the caller's place in the retry line, to send back with the
    retry (RETRY_TOKEN_ATTRIBUTE). `log_field` names the cause in the request's log line
    and so in the metrics (adapter.metrics)."""

    log_field: ClassVar[str]

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        retry_after: int = 1,
        retry_token: str | None = None,
        cause: str | None = None,
    ) -> None:
        # The hint is in the body too: SageMaker's InvokeEndpoint drops container headers.
        extra: dict[str, Any] = {"retry_after_seconds": retry_after} if retryable else {}
        if retryable and retry_token is not None:
            extra["retry_token"] = retry_token
        super().__init__(message, retryable=retryable, **extra)
        self.retryable = retryable
        self.retry_after = retry_after
        self.cause = cause

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after)} if self.retryable else {}


class BusyError(RetryLaterError):
    """429: refused for load, always retryable (HTTP's "too many requests": clients, SDKs
    and SageMaker's metrics read it as "slow down", not as a server failure)."""

    status = 429
    log_field = "refused"

    def __init__(
        self,
        message: str,
        *,
        cause: BusyCause,
        retry_after: int = 1,
        retry_token: str | None = None,
    ) -> None:
        super().__init__(
            message, retryable=True, retry_after=retry_after, retry_token=retry_token, cause=cause
        )


class UnavailableError(RetryLaterError):
    """503: the server cannot answer (loading, unhealthy, stopping, out of KV capacity);
    retryable unless the model is unhealthy."""

    status = 503
    log_field = "unavailable"

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        retry_after: int = 1,
        cause: UnavailableCause | None = None,
    ) -> None:
        super().__init__(message, retryable=retryable, retry_after=retry_after, cause=cause)


def shutting_down() -> UnavailableError:
    """The answer to work that meets a server stopping (retryable: another instance may
    take it)."""
    return UnavailableError("the server is shutting down", retryable=True, cause="stopping")
