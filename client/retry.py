"""The retry policy: when a busy answer may be tried again, and after how long.

Pure arithmetic over attempts, elapsed time and the endpoint's hint (and, for an endpoint
that scaled to zero, how long to wait for it to wake: `WakeUp`), kept apart from the
transports so it can be read and tested on its own: `DecisionClient` runs the loop that
applies it, and `client.error_mapping` reads the hint out of an answer with
`parse_retry_after`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC
from email.utils import parsedate_to_datetime

_DELTA_SECONDS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class WakeUp:
    """How long a call may wait for an endpoint that scaled to zero to start a copy again
    (`ScaledToZeroError`), and how often it asks meanwhile: after `first_delay_s`, doubling
    up to `max_delay_s`. A copy takes minutes (the endpoint's NotWaking alarm pages after
    16), so a budget shorter than that only shortens the wait before the same error. The
    retry policy's budget for busy answers starts again once the copy has answered."""

    budget_s: float
    first_delay_s: float = 5.0
    max_delay_s: float = 30.0

    def __post_init__(self) -> None:
        if min(self.budget_s, self.first_delay_s, self.max_delay_s) < 0:
            raise ValueError("a wake-up's budget and delays must be >= 0")

    def delay_s(self, waits: int, waited_s: float) -> float | None:
        """The sleep before asking again after `waits` earlier waits, `waited_s` into the
        wait; None once the budget is spent."""
        left = self.budget_s - waited_s
        if left <= 0:
            return None
        return min(self.max_delay_s, self.first_delay_s * 2.0**waits, left)


@dataclass(frozen=True)
class RetryPolicy:
    """When to retry a busy answer, bounded in attempts and in total time.

    The endpoint knows how long its queue is, so its Retry-After wins: the client waits that
    long plus uniform(0, retry_after_jitter_s), the jitter keeping clients told the same
    number from returning together. Without a hint it backs off exponentially with full
    jitter: before retry n (0-based) uniform(0, min(max_delay_s, base_delay_s * 2**n)).
    No sleep ends past `max_total_s` after the first attempt started, and a hint that does
    not fit in what is left ends the call at once (coming back early only adds load).

    The default budget is 30 s: retries start within 30 s, so a last try answered within
    another 30 s ends the call inside 60 s, SageMaker's limit for one invocation. The
    attempt limit is a backstop against tiny delays hammering a busy endpoint.
    """

    max_attempts: int = 30
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    max_total_s: float = 30.0
    retry_after_jitter_s: float = 0.5

    def __post_init__(self) -> None:
        delays = (self.base_delay_s, self.max_delay_s, self.max_total_s, self.retry_after_jitter_s)
        if self.max_attempts < 1 or min(delays) < 0:
            raise ValueError("max_attempts must be >= 1 and delays >= 0")

    def give_up_reason(
        self, attempts: int, elapsed_s: float, retry_after_s: float | None
    ) -> str | None:
        """Why no retry may follow `attempts` busy answers `elapsed_s` into the call; None
        while one may."""
        remaining = self.max_total_s - elapsed_s
        if attempts >= self.max_attempts:
            return f"the attempt limit is {self.max_attempts}"
        if remaining <= 0:
            return f"the {self.max_total_s:g} s retry budget is spent"
        if retry_after_s is not None and retry_after_s > remaining:
            return (
                f"the endpoint asked to retry after {retry_after_s:.1f} s, more than the "
                f"{remaining:.1f} s left of the {self.max_total_s:g} s retry budget"
            )
        return None

    def delay_s(
        self, retry: int, elapsed_s: float, retry_after_s: float | None, unit: float
    ) -> float:
        """The sleep before retry `retry` (0-based), for a uniform draw `unit` in [0, 1)."""
        if retry_after_s is None:
            wanted = unit * min(self.max_delay_s, self.base_delay_s * 2.0**retry)
        else:
            wanted = retry_after_s + unit * self.retry_after_jitter_s
        return max(0.0, min(wanted, self.max_total_s - elapsed_s))


def parse_retry_after(value: str, now: float) -> float | None:
    """A Retry-After value as seconds from `now` (epoch seconds): delta-seconds or an
    HTTP-date (RFC 9110 10.2.3; a date in the past is 0). None when it is neither, so a
    malformed hint falls back to backoff instead of failing the call."""
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except ValueError:
        return None
    if when.tzinfo is None:  # asctime and "-0000" dates carry no zone; HTTP-dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)
