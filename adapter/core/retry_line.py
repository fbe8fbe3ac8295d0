"""The line of refused requests: who comes back when, so that under overload every caller is
served in turn instead of the quickest few again and again.

Why it needs identity. A closed loop of clients (each sends its next request as soon as it
has an answer) always finds the room a finished request frees first: the client just
answered is already back. A refused client told "retry in n seconds" returns to find that
room taken, is refused again, and may never be served while others are served every time.
Retry times alone cannot fix it (a measured simulation: kept time slots without identity are
stolen by answered clients, and told times spread over a horizon let the answered grab what
opens). So each refusal hands out a place in a line: a due time and a token that the client
sends back with its retry (`retry_token` in the 429's body; the HTTP layer reads it from a
header). When a place falls due its holder enters ahead of newcomers; a newcomer (a request
without a token, or with one the line has forgotten) enters only when its work still leaves
every place's holder the room it was promised.

Invariants (checked on randomized inputs by tests/adapter/test_retry_line.py):
- due times are handed out in refusal order, a request's work apart, never in the past;
- a told Retry-After is between 1 and the horizon, and never earlier than the place is due;
- the line holds at most `capacity` places; a refusal past it gets no token (a newcomer's
  retry, Retry-After still spread);
- a place whose holder does not return by the time it was told plus `grace_s` (it gave up,
  or retried elsewhere) is forgotten, and the places behind it move up (each at most its
  request's work after the one before): an abandoned place never blocks anyone, nor delays
  those behind it.

Pure: the caller passes the clock. Threads: its owner, adapter.core.admission, calls it
under the scheduler's queue lock.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

TOKEN_BYTES = 12  # 16 URL-safe characters: unguessable, so nobody jumps the line


@dataclass(frozen=True)
class Refusal:
    """What a refused request is told: when to come back, and with which token (None when
    the line is full: it returns as a newcomer)."""

    retry_after: int
    token: str | None


@dataclass
class _Place:
    due: float  # monotonic seconds: when its holder may enter
    token: str
    expires: float  # forgotten after this without its holder back
    spacing: float  # its request's work: how far behind the place before it


class RetryLine:
    """Places handed to refused requests, ordered by due time."""

    def __init__(self, *, horizon_s: int, grace_s: float, capacity: int) -> None:
        if horizon_s < 1 or grace_s <= 0 or capacity < 1:
            raise ValueError("horizon_s >= 1, grace_s > 0 and capacity >= 1 are required")
        self.horizon_s = horizon_s
        self.grace_s = grace_s
        self.capacity = capacity
        self._places: list[_Place] = []

    def __len__(self) -> int:
        return len(self._places)

    def refuse(
        self, now: float, *, earliest_s: float, request_s: float, token: str | None = None
    ) -> Refusal:
        """A refused request's place: the one its `token` holds (kept, told no sooner than
        `earliest_s`), else a new one no sooner than `earliest_s` from now and `request_s`
        (a request's work at the measured speed) after the last place, so the refused
        return one by one as room frees, in the order they were refused."""
        self._forget(now)
        held = self._find(token)
        if held is not None:
            return self._keep(held, now, max(held.due - now, earliest_s))
        last = self._places[-1].due if self._places else now
        due = max(now + max(earliest_s, 0.0), last + max(request_s, 0.0), now)
        told = self.told(due - now)
        if len(self._places) >= self.capacity:
            return Refusal(told, None)
        token = secrets.token_urlsafe(TOKEN_BYTES)
        place = _Place(due, token, now + told + self.grace_s, max(request_s, 0.0))
        self._places.append(place)  # due >= every other place's: the line stays sorted
        return Refusal(told, place.token)

    def enter(
        self,
        now: float,
        token: str | None,
        *,
        ahead_s: float,
        request_s: float,
        limit_s: float,
        claim: bool,
    ) -> Refusal | None:
        """Whether a request may queue now (None) or is refused (its Refusal).

        `ahead_s` is the work queued ahead of it, `request_s` its own, `limit_s` the longest
        a request may wait. A holder whose place is due enters while the work ahead fits the
        limit (`claim` gives its place up: the request queues; a check before the real entry
        keeps it). A holder back early is told the rest and keeps its place. Everyone else
        enters only if, with its work added, each place's holder will still find no more
        than `limit_s` ahead at its due time; otherwise it gets a place of its own.
        """
        self._forget(now)
        held = self._find(token)
        if held is not None:
            if held.due > now:
                return self._keep(held, now, held.due - now)
            if ahead_s <= limit_s:
                if claim:
                    self._places.remove(held)
                return None
            return self._keep(held, now, ahead_s - limit_s)  # still first when it returns
        if ahead_s <= limit_s and self._leaves_room(now, ahead_s + request_s, request_s, limit_s):
            return None
        return self.refuse(now, earliest_s=ahead_s - limit_s, request_s=request_s)

    def _leaves_room(self, now: float, load_s: float, request_s: float, limit_s: float) -> bool:
        """Whether `load_s` of queued work, drained in real time, leaves every place's
        holder at most `limit_s` ahead of it when it returns (each adding `request_s`)."""
        for place in self._places:
            at_due = load_s - max(place.due - now, 0.0)
            if at_due > limit_s:
                return False
            load_s = max(at_due, 0.0) + request_s
            now = max(place.due, now)
        return True

    def _keep(self, held: _Place, now: float, wait_s: float) -> Refusal:
        """Its holder came back and is refused again: the place stays, renewed until the
        holder's next return (it is still waiting, not gone)."""
        told = self.told(wait_s)
        held.expires = now + told + self.grace_s
        return Refusal(told, held.token)

    def told(self, seconds: float) -> int:
        """A Retry-After for a wait of `seconds`: at least 1, at most the horizon."""
        return min(max(math.ceil(seconds), 1), self.horizon_s)

    def _find(self, token: str | None) -> _Place | None:
        if token is None:
            return None
        for place in self._places:
            if secrets.compare_digest(place.token, token):
                return place
        return None

    def _forget(self, now: float) -> None:
        """Drop the places whose holders did not come back, and move those behind them up:
        a place's due time was a request's work after the one before it, which is gone."""
        kept = [place for place in self._places if place.expires >= now]
        if len(kept) == len(self._places):
            return
        before = now
        for place in kept:
            place.due = min(place.due, max(before, now) + place.spacing)
            before = place.due
        self._places = kept
