"""The retry line's invariants (adapter/core/retry_line.py), on randomized inputs, and the
behaviour it exists for: closed-loop clients under overload all served in turn.

The simulation is a worker that serves one request per `SERVICE_S` in arrival order, a
queue that admits what the line lets in, and clients that send their next request as soon as
they are answered and retry when told (with jitter), sending their token back. Time is
simulated: the figures do not depend on this machine.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

import pytest

from adapter.core.retry_line import Refusal, RetryLine

SEEDS = range(30)
HORIZON_S = 30
GRACE_S = 2.0
SERVICE_S = 1.0  # one request's work
LIMIT_S = 5.0  # the most work a request may find ahead (SEMIF_QUEUE_TIMEOUT_S)


def line(capacity: int = 1000) -> RetryLine:
    return RetryLine(horizon_s=HORIZON_S, grace_s=GRACE_S, capacity=capacity)


@pytest.mark.parametrize("seed", SEEDS)
def test_places_are_handed_out_in_order_a_request_apart_and_told_within_the_horizon(
    seed: int,
) -> None:
    rng = random.Random(seed)
    retry = RetryLine(horizon_s=HORIZON_S, grace_s=1e6, capacity=1000)  # nobody forgotten
    now = 0.0
    last_due = -math.inf
    for _ in range(60):
        now += rng.uniform(0, 0.5)
        earliest = rng.uniform(-2, 40)
        request = rng.uniform(0, 3)
        refusal = retry.refuse(now, earliest_s=earliest, request_s=request)
        assert refusal.token is not None
        due = retry._places[-1].due
        assert due >= now + earliest - 1e-9
        assert due >= now
        assert due >= last_due + request - 1e-9  # a request's work after the place before
        assert 1 <= refusal.retry_after <= HORIZON_S
        # Never told to come back before its place is due, unless the horizon cuts it.
        assert refusal.retry_after >= min(due - now, HORIZON_S)
        last_due = due
    assert [p.due for p in retry._places] == sorted(p.due for p in retry._places)


@pytest.mark.parametrize("seed", SEEDS)
def test_forgetting_keeps_the_order_and_only_moves_places_up(seed: int) -> None:
    rng = random.Random(seed)
    retry = line()
    now = 0.0
    for _ in range(80):
        now += rng.uniform(0, 2)
        before = {p.token: p.due for p in retry._places}
        if rng.random() < 0.6:
            retry.refuse(now, earliest_s=rng.uniform(0, 40), request_s=rng.uniform(0, 3))
        else:
            held = rng.choice(retry._places).token if retry._places else None
            retry.enter(now, held, ahead_s=10, request_s=1, limit_s=LIMIT_S, claim=False)
        places = retry._places
        assert all(p.expires >= now for p in places)  # the forgotten are gone
        assert [p.due for p in places] == sorted(p.due for p in places)
        for place in places:
            assert place.due <= before.get(place.token, math.inf)  # never later
        if set(before) - {p.token for p in places}:  # some were forgotten: the rest moved up
            ahead = now
            for place in (p for p in places if p.token in before):
                assert place.due <= max(ahead, now) + place.spacing + 1e-9
                ahead = place.due


def test_a_full_line_refuses_without_a_place() -> None:
    retry = line(capacity=3)
    refusals = [retry.refuse(0.0, earliest_s=1, request_s=1) for _ in range(5)]
    assert [r.token is not None for r in refusals] == [True, True, True, False, False]
    assert len(retry) == 3
    assert [r.retry_after for r in refusals] == [1, 2, 3, 4, 4]  # still spread


def test_a_holder_back_early_keeps_its_place_and_is_told_the_rest() -> None:
    retry = line()
    first = retry.refuse(0.0, earliest_s=45, request_s=1)
    assert first.retry_after == HORIZON_S  # due at 45: told the horizon, then the rest
    again = retry.enter(30.0, first.token, ahead_s=0, request_s=1, limit_s=LIMIT_S, claim=True)
    assert again == Refusal(15, first.token)
    # Coming back renewed the place past its first promise (30 s + grace): still held.
    assert retry.enter(40.0, None, ahead_s=0, request_s=1, limit_s=LIMIT_S, claim=True) is None
    assert len(retry) == 1
    due = retry.enter(45.2, first.token, ahead_s=0, request_s=1, limit_s=LIMIT_S, claim=True)
    assert due is None
    assert len(retry) == 0


def test_a_due_holder_enters_ahead_of_a_newcomer_and_claiming_gives_the_place_up() -> None:
    retry = line()
    held = retry.refuse(0.0, earliest_s=2, request_s=1)
    # At its due time the queue has 4.5 s of work: the holder fits, a newcomer would push
    # the holder past the limit had it come first, so the newcomer waits behind it.
    newcomer = retry.enter(2.0, None, ahead_s=4.5, request_s=1, limit_s=LIMIT_S, claim=True)
    assert newcomer is not None
    assert newcomer.token is not None
    checked = retry.enter(2.0, held.token, ahead_s=4.5, request_s=1, limit_s=LIMIT_S, claim=False)
    assert checked is None
    assert len(retry) == 2
    entered = retry.enter(2.0, held.token, ahead_s=4.5, request_s=1, limit_s=LIMIT_S, claim=True)
    assert entered is None
    assert len(retry) == 1
    # Claimed: the same token again is a newcomer's.
    again = retry.enter(2.0, held.token, ahead_s=5.5, request_s=1, limit_s=LIMIT_S, claim=True)
    assert again is not None
    assert again.token != held.token


def test_a_due_holder_over_the_limit_keeps_its_place_first() -> None:
    retry = line()
    held = retry.refuse(0.0, earliest_s=1, request_s=1)
    later = retry.refuse(0.0, earliest_s=1, request_s=1)
    told = retry.enter(1.0, held.token, ahead_s=8.0, request_s=1, limit_s=LIMIT_S, claim=True)
    assert told == Refusal(3, held.token)
    assert [p.token for p in retry._places] == [held.token, later.token]


def test_a_place_not_claimed_by_its_due_time_plus_grace_is_forgotten() -> None:
    retry = line()
    gone = retry.refuse(0.0, earliest_s=3, request_s=1)
    assert gone.retry_after == 3
    # Before the grace runs out the place still holds a newcomer back ...
    assert retry.enter(3.0, None, ahead_s=5.0, request_s=1, limit_s=LIMIT_S, claim=True)
    # ... after it, the abandoned places block nobody.
    late = 3 + GRACE_S + 0.01 + 5  # the newcomer refused at 3.0 gave up too
    assert retry.enter(late, None, ahead_s=5.0, request_s=1, limit_s=LIMIT_S, claim=True) is None
    assert len(retry) == 0


def test_places_behind_forgotten_ones_move_up() -> None:
    """Forty refused at once, due 1..40 s, never come back; one refused at 5 s is due after
    them (41 s) and told the horizon. Once the forty are forgotten (each 2 s after the time
    it was told) its place moves up to a request's work from then: back when told, it
    enters instead of being told to wait for places nobody holds."""
    retry = line()
    for _ in range(40):
        retry.refuse(0.0, earliest_s=1, request_s=1)
    late = retry.refuse(5.0, earliest_s=1, request_s=1)
    assert late.retry_after == HORIZON_S  # due at 41
    # A newcomer at 33 s with nothing queued enters (its work is done by then) ...
    assert retry.enter(33.0, None, ahead_s=0, request_s=1, limit_s=LIMIT_S, claim=True) is None
    assert len(retry) == 1  # ... and the forty are forgotten, the late place moved up
    assert retry._places[0].due == 34.0
    back = 5.0 + late.retry_after + 0.3
    entered = retry.enter(back, late.token, ahead_s=0, request_s=1, limit_s=LIMIT_S, claim=True)
    assert entered is None


def test_a_newcomer_enters_while_every_place_keeps_its_room() -> None:
    retry = line()
    retry.refuse(0.0, earliest_s=10, request_s=1)  # due at 10
    # 3 s ahead now plus 1 s of its own is 4 s, drained by the place's due time: it fits.
    assert retry.enter(0.0, None, ahead_s=3.0, request_s=1, limit_s=LIMIT_S, claim=True) is None
    # Over the limit itself: refused with a place after the one before.
    refused = retry.enter(0.0, None, ahead_s=6.0, request_s=1, limit_s=LIMIT_S, claim=True)
    assert refused is not None
    assert refused.retry_after == 11


def test_a_line_is_built_with_usable_limits() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RetryLine(horizon_s=30, grace_s=2, capacity=0)


@dataclass
class Run:
    answers: list[int]
    idle_s: float
    late_refusals: int  # a holder that came back when told and was refused for want of room
    duration_s: float


@dataclass(order=True)
class _Event:
    at: float
    order: int
    client: int = field(compare=False)
    token: str | None = field(compare=False)
    told_at: float = field(compare=False, default=0.0)  # when it was told to come back


def simulate(seed: int, clients: int, *, duration_s: float = 400.0, give_up: float = 0.0) -> Run:
    """Closed-loop clients against a one-request-at-a-time worker; `give_up` is the chance
    a refused client walks away instead of retrying (its place is abandoned)."""
    rng = random.Random(seed)
    retry = line(capacity=4 * clients)
    answers = [0] * clients
    events: list[_Event] = []
    order = 0
    for client in range(clients):
        heapq.heappush(events, _Event(rng.uniform(0, 2), order, client, None))
        order += 1
    busy_until = 0.0
    idle = 0.0
    late = 0
    while events:
        event = heapq.heappop(events)
        now = event.at
        if now > duration_s:
            break
        ahead = max(busy_until - now, 0.0)
        refusal = retry.enter(
            now, event.token, ahead_s=ahead, request_s=SERVICE_S, limit_s=LIMIT_S, claim=True
        )
        if refusal is None:
            if now > busy_until and now > 10:
                idle += now - busy_until
            busy_until = max(busy_until, now) + SERVICE_S
            answers[event.client] += 1
            heapq.heappush(events, _Event(busy_until, order, event.client, None))
        else:
            if event.token is not None and refusal.token != event.token:
                late += 1  # its place was lost: it is back as a newcomer
            if event.token is None and rng.random() < give_up:
                # It walks away, and a new client takes its seat a while later.
                back = now + rng.uniform(5, 40)
                heapq.heappush(events, _Event(back, order, event.client, None))
            else:
                back = now + refusal.retry_after + rng.uniform(0, 0.5)
                heapq.heappush(events, _Event(back, order, event.client, refusal.token, now))
        order += 1
    return Run(answers, idle, late, duration_s)


@pytest.mark.parametrize("clients", [16, 64, 128])
def test_closed_loop_clients_are_all_served_in_turn(clients: int) -> None:
    """Under overload (more clients than LIMIT_S of work can hold), every client gets its
    share: the most and the least served differ by at most one answer, no client that came
    back when told lost its place, and the worker never idles while clients wait."""
    for seed in range(10):
        run = simulate(seed, clients)
        assert max(run.answers) - min(run.answers) <= 1, (seed, run.answers)
        assert run.late_refusals == 0
        assert run.idle_s < 0.01 * run.duration_s, (seed, run.idle_s)


def test_clients_that_give_up_block_nobody() -> None:
    """A third of refused newcomers walk away, abandoning their places: the line forgets
    them after the grace, and the worker stays busy (idle under 5 % of the time)."""
    for seed in range(3):
        run = simulate(seed, 64, duration_s=300.0, give_up=0.33)
        assert run.idle_s < 0.05 * run.duration_s, (seed, run.idle_s)
        assert min(run.answers) > 0
