"""The scheduler's invariants, checked on randomized arrivals, cancellations, deadlines and
chat interleavings against an engine that only records what it is asked to do.

Time is a fake clock that moves only while the engine works (a pass, a chat token), so
which request expires where is decided by the schedule, not by this machine's speed. Each
scenario queues its requests while the first pass is held, lets some clients leave, then
runs to the end. The invariants, one test each:

1. Nothing is lost: every request ends, with its answer or with its own error.
2. An answer is complete and in order: one score per prompt, each that prompt's.
3. Each prompt is decoded once, in order; a pass holds no more requests, sequences or rows
   than its limits (a prompt alone may exceed the rows: it must run somewhere).
4. Arrival order: requests start in the order they arrived.
5. A request is never decoded after its client left, its queue timeout or its deadline,
   and ends in the error that names which (499; 429 queue_timeout; 429 deadline). One whose
   own passes cannot end in time is stopped after a pass, not decoded to the end: a 429
   deadline when only the time left is too short, TooSlowError (a 400) when the time a
   request may take is.
6. Without prefix reuse, a pass that continues a request holds no other request.
7. A generation never holds the worker: between two passes, at most one chat token.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest

import adapter.core.admission as admission_module
import adapter.core.scheduler as scheduler_module
from adapter.cancel import Cancellation
from adapter.core.admission import MAX_RETRY_AFTER_S
from adapter.core.failures import DeadlineMissedError, RefusedError, TooSlowError
from adapter.core.generation import Sampling
from adapter.core.layout import MIN_ROWS, common_prefix_length
from adapter.core.scheduler import Scheduler
from adapter.errors import BusyError, ClientDisconnectedError
from adapter.settings import QueueLimits
from tests.support.fake_engine import FakeClock, FakeEngine, Pass, identity

SEEDS = range(40)
PASS_ROWS = 256
MAX_BRANCHES = 8
MARK = 10_000  # a request's prompts start with MARK + its index: passes name their requests


def requests_of(one: Pass) -> list[int]:
    """The requests that rode in a pass, in pass order."""
    return list(dict.fromkeys(prompt[0] - MARK for prompt in one.prompts))


@dataclass
class Request:
    index: int
    prompts: list[list[int]]
    continuations: list[tuple[int, ...]]
    deadline: float
    submitted: float
    future: Future[Any]
    left_at: float | None = None  # fake time its client left


@dataclass
class Scenario:
    seed: int
    engine: FakeEngine
    requests: list[Request]
    chats: list[Future[Any]]
    queue_timeout: float
    max_batch_requests: int

    def outcome(self, request: Request) -> BaseException | None:
        return request.future.exception(timeout=0)


def random_request(rng: random.Random, index: int) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    """1-6 prompts, often about one shared state, some with label continuations; now and
    then one prompt longer than a pass."""
    if rng.random() < 0.15:
        return [[MARK + index, *(rng.randrange(3, 500) for _ in range(PASS_ROWS + 40))]], [()]
    state = [MARK + index, *(rng.randrange(3, 500) for _ in range(rng.choice([0, 20, 80, 200])))]
    prompts = [
        [*state, *(rng.randrange(3, 500) for _ in range(rng.randint(1, 60)))]
        for _ in range(rng.randint(1, 6))
    ]
    continuations = [
        tuple(sorted(rng.sample(range(3, 30), rng.choice([0, 0, 1, 3])))) for _ in prompts
    ]
    return prompts, continuations


def run_scenario(seed: int, prefix_reuse: bool, monkeypatch: pytest.MonkeyPatch) -> Scenario:
    rng = random.Random(seed)
    clock = FakeClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    engine = FakeEngine(PASS_ROWS, MAX_BRANCHES, prefix_reuse, clock)
    queue_timeout = rng.choice([2.5, 6.0, 1000.0])
    batch = rng.choice([1, 3, 8])
    scheduler = Scheduler(
        engine,  # type: ignore[arg-type]
        limits=QueueLimits(
            max_queue=1000,
            queue_timeout_seconds=queue_timeout,
            max_batch_requests=batch,
        ),
        on_native_failure=lambda error: pytest.fail(f"native failure: {error}"),
    )
    requests: list[Request] = []
    chats: list[Future[Any]] = []
    try:
        for index in range(rng.randint(4, 24)):
            if index and rng.random() < 0.15:
                chat = scheduler.submit_generation(
                    [1, 2, 3],
                    max_new_tokens=rng.randint(1, 12),
                    sampling=Sampling(),
                    stop=[],
                    deadline=clock.monotonic() + 1000,
                    cancel=Cancellation(),
                )
                chats.append(chat.future)
            prompts, continuations = random_request(rng, index)
            deadline = clock.monotonic() + rng.choice([1.5, 4.0, 1000.0])
            cancel = Cancellation()
            job = scheduler.submit(prompts, continuations, deadline, cancel)
            request = Request(index, prompts, continuations, deadline, clock.now, job.future)
            if index and rng.random() < 0.2:
                cancel.set("client_gone")
                request.left_at = clock.monotonic()
            requests.append(request)
        engine.release.set()
        for future in [*(r.future for r in requests), *chats]:
            with contextlib.suppress(Exception):  # the tests read each outcome
                future.result(timeout=30)
    finally:
        engine.release.set()
        assert scheduler.close(10)
    return Scenario(seed, engine, requests, chats, queue_timeout, batch)


@pytest.fixture(scope="module", params=[True, False], ids=["reuse", "no-reuse"])
def scenarios(request: pytest.FixtureRequest) -> Iterator[list[Scenario]]:
    monkeypatch = pytest.MonkeyPatch()
    try:
        yield [run_scenario(seed, request.param, monkeypatch) for seed in SEEDS]
    finally:
        monkeypatch.undo()


def test_1_nothing_is_lost(scenarios: list[Scenario]) -> None:
    for scenario in scenarios:
        for future in [*(r.future for r in scenario.requests), *scenario.chats]:
            assert future.done(), scenario.seed
        for chat in scenario.chats:
            assert chat.exception(timeout=0) is None, scenario.seed


def test_2_an_answer_is_complete_and_in_order(scenarios: list[Scenario]) -> None:
    answered = 0
    for scenario in scenarios:
        for request in scenario.requests:
            if scenario.outcome(request) is not None:
                continue
            answered += 1
            scores, timing = request.future.result(timeout=0)
            assert [float(score.logits[0]) for score in scores] == [
                identity(prompt) for prompt in request.prompts
            ], scenario.seed
            assert timing.passes >= 1
    assert answered > 100  # the scenarios answer most requests


def test_3_each_prompt_once_in_order_and_passes_within_their_limits(
    scenarios: list[Scenario],
) -> None:
    """Rows as the scheduler prices them (docs/adapter.md): what a prompt shares with the
    request's prompt before it is decoded once (resident from an earlier pass, or the stem
    of this one); a prompt repeating the one before it rides free (scored once)."""
    for scenario in scenarios:
        decoded: dict[int, list[tuple[int, ...]]] = {}
        for one in scenario.engine.passes:
            assert len(requests_of(one)) <= scenario.max_batch_requests, scenario.seed
            assert sum(1 + len(c) for c in one.continuations) <= MAX_BRANCHES, scenario.seed
            rows = 0
            for prompt, continuations in zip(one.prompts, one.continuations, strict=True):
                mine = decoded.setdefault(prompt[0] - MARK, [])
                if not (mine and mine[-1] == tuple(prompt)):
                    shared = common_prefix_length(prompt, mine[-1]) if mine else 0
                    rows += len(prompt) - shared + MIN_ROWS + (MIN_ROWS + 1) * len(continuations)
                mine.append(tuple(prompt))
            assert rows <= PASS_ROWS or len(set(one.prompts)) == 1, scenario.seed
        for request in scenario.requests:
            prompts = [tuple(prompt) for prompt in request.prompts]
            got = decoded.get(request.index, [])
            if scenario.outcome(request) is None:
                assert got == prompts, scenario.seed  # every prompt, once, in order
            else:
                assert got == prompts[: len(got)], scenario.seed  # a prefix of them


def test_4_requests_start_in_arrival_order(scenarios: list[Scenario]) -> None:
    for scenario in scenarios:
        order = list(dict.fromkeys(i for p in scenario.engine.passes for i in requests_of(p)))
        assert order == sorted(order), scenario.seed


def test_5_stopped_requests_are_never_decoded_after_and_end_as_themselves(
    scenarios: list[Scenario],
) -> None:
    seen: set[str] = set()
    for scenario in scenarios:
        for request in scenario.requests:
            passes = [p for p in scenario.engine.passes if request.index in requests_of(p)]
            error = scenario.outcome(request)
            if request.left_at is not None:
                assert all(p.started <= request.left_at for p in passes), scenario.seed
                if error is None:  # answered before it left: it rode in the held pass
                    continue
            for one in passes:
                assert one.started <= request.deadline, scenario.seed
            start = passes[0].started if passes else None
            if start is not None:
                assert start - request.submitted <= scenario.queue_timeout, scenario.seed
            if error is None:
                continue
            if isinstance(error, ClientDisconnectedError):
                assert request.left_at is not None, scenario.seed
                seen.add("client_gone")
                continue
            if isinstance(error, TooSlowError):
                assert passes, scenario.seed  # judged on its own passes
                assert error.needed_seconds > error.allowed_seconds, scenario.seed
                assert error.allowed_seconds == request.deadline - request.submitted
                seen.add("too_slow")
                continue
            cause = _cause(error)
            seen.add(cause)
            if cause == "queue_timeout":
                assert not passes, scenario.seed
            else:
                assert cause == "deadline", (scenario.seed, error)
    # the scenarios reach each
    assert seen == {"client_gone", "queue_timeout", "deadline", "too_slow"}


def test_6_without_reuse_a_continuing_pass_is_one_request_alone(
    scenarios: list[Scenario],
) -> None:
    """A newcomer would empty the cache the continuing request's rest reads from."""
    if scenarios[0].engine.prefix_reuse:
        pytest.skip("with prefix reuse a newcomer may join a continuing request")
    continued = 0
    for scenario in scenarios:
        started: set[int] = set()
        for one in scenario.engine.passes:
            if started.intersection(requests_of(one)):
                continued += 1
                assert len(requests_of(one)) == 1, scenario.seed
                assert one.continuing, scenario.seed  # the engine keeps the cache for it
            started.update(requests_of(one))
    assert continued > 10  # the scenarios have requests larger than a pass


def test_7_chat_tokens_interleave_with_passes(scenarios: list[Scenario]) -> None:
    interleaved = False
    for scenario in scenarios:
        passes = scenario.engine.passes
        for before, after in itertools.pairwise(passes):
            tokens = after.chat_tokens_before - before.chat_tokens_before
            assert tokens <= 1, scenario.seed
            interleaved |= tokens == 1
    assert interleaved  # some scenario ran a chat while passes were queued


# -- overload and head-of-line, on fixed schedules ---------------------------------------------


def _fixed(
    monkeypatch: pytest.MonkeyPatch,
    *,
    prefix_reuse: bool,
    queue_timeout: float = 1000.0,
    bounded_passes: bool = False,
) -> tuple[Scheduler, FakeEngine]:
    """A scheduler on the fake engine and clock. Passes take the engine's PASS_ROWS unless
    `bounded_passes` (the admission's bound in time, which these tests of other rules
    would otherwise meet at their slow 100 rows a second)."""
    clock = FakeClock()
    monkeypatch.setattr(scheduler_module, "time", clock)
    if not bounded_passes:
        monkeypatch.setattr(admission_module, "MIN_PASS_ROWS", PASS_ROWS)
    engine = FakeEngine(PASS_ROWS, MAX_BRANCHES, prefix_reuse, clock)
    scheduler = Scheduler(
        engine,  # type: ignore[arg-type]
        limits=QueueLimits(max_queue=100, queue_timeout_seconds=queue_timeout),
        on_native_failure=lambda error: pytest.fail(f"native failure: {error}"),
    )
    return scheduler, engine


def _measure_then_hold(scheduler: Scheduler, engine: FakeEngine) -> None:
    """One 100-row pass measures the speed (100 rows a second); the next pass is held, so
    what is submitted now waits behind it."""
    first = scheduler.submit(
        [_prompt(0, 100)], [()], engine.clock.monotonic() + 1000, Cancellation()
    )
    engine.release.set()
    first.future.result(10)
    engine.release.clear()
    engine.entered.clear()


def _prompt(index: int, rows: int) -> list[int]:
    """A prompt the scheduler charges `rows` rows: its tokens, MIN_ROWS, and its one
    whole-stream copy (one row for the fake engine's 256-cell streams)."""
    return [MARK + index, *range(1, rows - MIN_ROWS - 1)]


@pytest.mark.parametrize("prefix_reuse", [True, False], ids=["reuse", "no-reuse"])
def test_8_a_long_request_never_holds_a_queued_one_past_its_deadline(
    monkeypatch: pytest.MonkeyPatch, prefix_reuse: bool
) -> None:
    """Six full passes ahead, a small request behind: with reuse it rides in the very
    next pass (the long one goes behind it); without, the long one keeps its passes, but the
    small one's deadline is still checked on every pass, not after the long one ends."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=prefix_reuse)
    clock = engine.clock
    ended: list[str] = []
    try:
        long = scheduler.submit(
            [[MARK, index, *range(1, 250)] for index in range(6)],
            [() for _ in range(6)],
            clock.monotonic() + 1000,
            Cancellation(),
        )
        assert engine.entered.wait(10)
        small = scheduler.submit([_prompt(1, 12)], [()], clock.monotonic() + 2.5, Cancellation())
        long.future.add_done_callback(lambda _: ended.append("long"))
        small.future.add_done_callback(lambda _: ended.append("small"))
        engine.release.set()
        long.future.result(10)
        outcome = small.future.exception(10)
    finally:
        engine.release.set()
        assert scheduler.close(10)
    assert ended == ["small", "long"]
    if prefix_reuse:
        assert outcome is None
        assert 1 in requests_of(engine.passes[1])  # the pass right after the long one's first
    else:
        assert outcome is not None
        assert _cause(outcome) == "deadline"


def test_9_overload_is_refused_at_arrival_not_after_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a pass has measured the speed (100 rows a second here), a request is refused
    at once when the work queued ahead would outlast the queue timeout; the first refused
    is told to retry after the excess, each later one a request's work after the one before.
    Below that, requests queue as before."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=True, queue_timeout=5.0)
    clock = engine.clock
    try:
        _measure_then_hold(scheduler, engine)
        admitted = []
        for index in range(1, 7):  # 0 to 5 s of work ahead: admitted
            admitted.append(
                scheduler.submit(
                    [_prompt(index, 100)], [()], clock.monotonic() + 1000, Cancellation()
                )
            )
        with pytest.raises(RefusedError) as refused:  # 6 s ahead > 5 s
            scheduler.submit([_prompt(7, 100)], [()], clock.monotonic() + 1000, Cancellation())
        assert refused.value.cause == "overloaded"
        assert refused.value.retry_after == 1
        assert "about 6 s of work is queued ahead" in str(refused.value)
        # The refused are told times a request's work (1 s) apart, first refused first
        # back, up to the longest Retry-After: not all the same second.
        told = [refused.value.retry_after]
        for index in range(8, 48):
            with pytest.raises(RefusedError) as again:
                scheduler.submit(
                    [_prompt(index, 100)], [()], clock.monotonic() + 1000, Cancellation()
                )
            told.append(again.value.retry_after)
        assert told == [*range(1, MAX_RETRY_AFTER_S + 1), *[MAX_RETRY_AFTER_S] * 11]
        engine.release.set()
        for job in admitted:
            job.future.result(10)
    finally:
        engine.release.set()
        assert scheduler.close(10)


def test_9b_a_refused_client_back_with_its_token_enters_ahead_of_a_newcomer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Room for one more request opens: the client refused earlier, back when told with its
    retry token, takes it; a newcomer arriving at the same moment is refused (it would have
    pushed the refused client past the queue timeout) and gets a place behind."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=True, queue_timeout=5.0)
    clock = engine.clock
    try:
        _measure_then_hold(scheduler, engine)
        admitted = [
            scheduler.submit([_prompt(i, 100)], [()], clock.monotonic() + 1000, Cancellation())
            for i in range(1, 7)
        ]
        with pytest.raises(RefusedError) as refused:
            scheduler.submit([_prompt(7, 100)], [()], clock.monotonic() + 1000, Cancellation())
        token = refused.value.token
        assert refused.value.retry_after == 1
        clock.advance(1.0)  # its place is due; the passes ran faster meanwhile:
        # 600 rows ahead = 4.8 s
        monkeypatch.setattr(scheduler.admission.speed, "coefficients", (0.0, 0.008, 0.0))
        with pytest.raises(RefusedError) as newcomer:
            scheduler.check_room()
        assert "clients refused earlier are due first" in str(newcomer.value)
        assert newcomer.value.token != token
        scheduler.check_room(token)  # a check before rendering keeps the place ...
        admitted.append(
            scheduler.submit(
                [_prompt(7, 100)],
                [()],
                clock.monotonic() + 1000,
                Cancellation(),
                retry_token=token,
            )
        )
        with pytest.raises(RefusedError) as claimed:  # ... the entry gives it up
            scheduler.check_room(token)
        assert claimed.value.token != token
        engine.release.set()
        for job in admitted:
            job.future.result(10)
    finally:
        engine.release.set()
        assert scheduler.close(10)


def test_9c_work_that_will_time_out_before_its_turn_is_not_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Five 1 s requests queued at once behind a held pass, 5 s queue timeout: 4.5 s later
    only the first of them can still start in time; the rest will be dropped at their queue
    timeout, so a newcomer is not refused for their work."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=True, queue_timeout=5.0)
    clock = engine.clock
    try:
        _measure_then_hold(scheduler, engine)
        queued = [
            scheduler.submit([_prompt(i, 100)], [()], clock.monotonic() + 1000, Cancellation())
            for i in range(1, 6)
        ]
        wait = scheduler.admission.wait_seconds
        assert wait(clock.monotonic(), scheduler._queue) == pytest.approx(5.0)
        clock.advance(4.5)
        assert wait(clock.monotonic(), scheduler._queue) == pytest.approx(1.0)
        scheduler.check_room()  # 1 s ahead, not 5: admitted
        engine.release.set()
        for job in queued:
            job.future.exception(10)  # answered or dropped at its queue timeout
    finally:
        engine.release.set()
        assert scheduler.close(10)


@pytest.mark.parametrize("prefix_reuse", [True, False], ids=["reuse", "no-reuse"])
def test_10_a_newcomer_behind_a_long_request_waits_for_its_next_pass_only(
    monkeypatch: pytest.MonkeyPatch, prefix_reuse: bool
) -> None:
    """Twelve passes of work in one request, at 1 s a pass, and a 5 s queue timeout: with
    prefix reuse requests take turns, so a small request arriving behind it waits about one
    pass and is admitted; without, the long request keeps its passes and the newcomer is
    refused at once (its wait would be all of them)."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=prefix_reuse, queue_timeout=5.0)
    clock = engine.clock
    try:
        warm = scheduler.submit([_prompt(0, 1000)], [()], clock.monotonic() + 1000, Cancellation())
        engine.release.set()
        warm.future.result(10)  # one 1,000-row pass took 1 s
        engine.release.clear()
        long = scheduler.submit(
            [[MARK + 1, index, *range(2, 1000 - MIN_ROWS - 1)] for index in range(12)],
            [() for _ in range(12)],
            clock.monotonic() + 1000,
            Cancellation(),
        )

        def small() -> Any:
            return scheduler.submit(
                [_prompt(2, 12)], [()], clock.monotonic() + 1000, Cancellation()
            )

        if prefix_reuse:
            job = small()
            engine.release.set()
            job.future.result(10)
            assert 2 in requests_of(engine.passes[2])  # right after the long one's first pass
        else:
            with pytest.raises(RefusedError) as refused:
                small()
            assert refused.value.cause == "overloaded"
        engine.release.set()
        long.future.result(10)
    finally:
        engine.release.set()
        assert scheduler.close(10)


def test_11_a_request_that_cannot_end_in_time_is_stopped_after_its_first_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twelve 1 s passes of work and a 5 s deadline: after its first pass the request's own
    speed says it needs 12 s, so it ends there with TooSlowError (the service's 400),
    instead of four more passes and a 429. Four passes behind a 2 s wait (without
    prefix reuse the request ahead keeps its two passes) end as the deadline's 429 after
    one pass: alone they fit a request's time, not what is left of it."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=False)
    clock = engine.clock

    def long(index: int, passes: int, deadline: float) -> Any:
        return scheduler.submit(
            [[MARK + index, i, *range(2, 240)] for i in range(passes)],
            [() for _ in range(passes)],
            clock.monotonic() + deadline,
            Cancellation(),
        )

    try:
        first = long(0, 12, 5.0)
        engine.release.set()
        too_slow = first.future.exception(10)
        assert isinstance(too_slow, TooSlowError)
        assert too_slow.needed_seconds == pytest.approx(12, rel=0.1)
        assert too_slow.allowed_seconds == 5.0
        assert [requests_of(one) for one in engine.passes] == [[0]]

        engine.release.clear()
        engine.entered.clear()
        ahead = long(1, 2, 1000.0)
        assert engine.entered.wait(10)
        late = long(2, 4, 5.0)  # its clock starts now; the 2 s ahead eat into it
        engine.release.set()
        ahead.future.result(10)
        missed = late.future.exception(10)
        assert isinstance(missed, DeadlineMissedError)
        assert "cannot end by its deadline" in str(missed)
        assert sum(2 in requests_of(one) for one in engine.passes) == 1
    finally:
        engine.release.set()
        assert scheduler.close(10)


def test_12_the_backlog_counts_the_rows_still_to_score(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a JSON Lines body reads before it adds work (adapter/lines.py): the rows of every
    queued request not yet scored, as the layout charges them, nothing once all are done;
    and it wants more only while those not in the pass being scored take less than half
    the queue timeout (0.5 s here, at the measured 100 rows a second)."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=True, queue_timeout=1.0)
    clock = engine.clock
    try:

        def wants_work() -> bool:
            return scheduler.admission.wants_work(scheduler.pressure)

        assert wants_work()  # no speed measured: the rows alone decide
        _measure_then_hold(scheduler, engine)
        assert scheduler.pressure.ready_rows == 0
        jobs = [scheduler.submit([_prompt(1, 40)], [()], clock.monotonic() + 1000, Cancellation())]
        assert engine.entered.wait(10)  # its pass is being scored (and held)
        assert scheduler.pressure.ready_rows == 0  # the 40 rows are in the pass
        assert wants_work()
        jobs.append(
            scheduler.submit([_prompt(2, 60)], [()], clock.monotonic() + 1000, Cancellation())
        )
        assert scheduler.pressure.ready_rows == 60
        assert scheduler.pressure.ready_seconds == pytest.approx(0.6)
        assert not wants_work()  # 0.6 s ready behind the pass
        engine.release.set()
        for job in jobs:
            job.future.result(10)
        assert scheduler.pressure.ready_rows == 0
    finally:
        engine.release.set()
        assert scheduler.close(10)


def _cause(error: BaseException) -> str:
    """Why a request ended without its answer, whichever layer said it: the core's refusal
    or missed deadline, or the request's own cancellation (adapter.cancel)."""
    if isinstance(error, RefusedError):
        return error.cause
    if isinstance(error, DeadlineMissedError):
        return "deadline"
    assert isinstance(error, BusyError), error
    return str(error.cause)


def test_13_a_pass_is_bounded_in_time_as_well_as_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """At the measured 100 rows a second, a pass may take an eighth of the 8 s queue
    timeout: 1 s, so 100 rows, raised to the floor of MIN_PASS_ROWS (128): four 100-row
    requests queued together are scored one a pass, where the engine's 256 rows would take
    two at a time; and the admission says so."""
    scheduler, engine = _fixed(
        monkeypatch, prefix_reuse=True, queue_timeout=8.0, bounded_passes=True
    )
    clock = engine.clock
    try:
        assert scheduler.pass_rows == PASS_ROWS  # no speed measured yet
        _measure_then_hold(scheduler, engine)
        assert scheduler.pass_rows == admission_module.MIN_PASS_ROWS
        jobs = [
            scheduler.submit([_prompt(i, 100)], [()], clock.monotonic() + 1000, Cancellation())
            for i in range(1, 5)
        ]
        engine.release.set()
        for job in jobs:
            job.future.result(10)
    finally:
        engine.release.set()
        assert scheduler.close(10)
    assert [len(requests_of(one)) for one in engine.passes[1:]] == [1, 1, 1, 1]


@pytest.mark.parametrize("prefix_reuse", [True, False], ids=["reuse", "no-reuse"])
def test_14_chunks_the_cache_holds_cost_no_pass(
    monkeypatch: pytest.MonkeyPatch, prefix_reuse: bool
) -> None:
    """A follow-up question about a 600-token state, sent as the service sends it (chunks
    of 200 first, then the prompt): with prefix reuse the chunks inside the resident state
    are skipped, counted as reused, and the prompt, lacking less than a pass, follows at
    once; without it, every chunk is decoded, over several passes."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=prefix_reuse)
    state = [MARK + 1, *range(1, 600)]
    follow_up = [*state, *range(5000, 5050)]
    chunks = [follow_up[:end] for end in (200, 400, 600)]
    deadline = engine.clock.monotonic() + 1000
    try:
        engine.release.set()
        scheduler.submit([state], [()], deadline, Cancellation()).future.result(10)
        job = scheduler.submit(
            [*chunks, follow_up],
            [()] * 4,
            deadline,
            Cancellation(),
            held_only=[True, True, True, False],
        )
        scores, timing = job.future.result(10)
    finally:
        assert scheduler.close(10)
    assert scores[-1].logits[0] == identity(follow_up)
    later = [prompt for one in engine.passes[1:] for prompt in one.prompts]
    if prefix_reuse:
        assert later == [tuple(follow_up)]
        assert [score.reused_tokens for score in scores[:3]] == [200, 400, 600]
        assert timing.passes == 1
    else:
        assert later == [tuple(prompt) for prompt in [*chunks, follow_up]]
        assert timing.passes > 1


@pytest.mark.parametrize("prefix_reuse", [True, False], ids=["reuse", "no-reuse"])
def test_15_a_streamed_request_leads_alone_and_reports_each_pass(
    monkeypatch: pytest.MonkeyPatch, prefix_reuse: bool
) -> None:
    """Six small prompts that fit one pass, two of them the lead: the first pass takes those
    two only and the rest follow in the next; the observer hears every score so far after
    each pass, before the answer is ready, and the answer is the same scores."""
    scheduler, engine = _fixed(monkeypatch, prefix_reuse=prefix_reuse)
    state = [MARK, *range(1, 40)]
    prompts = [[*state, 100 + index] for index in range(6)]
    heard: list[tuple[int, bool]] = []
    job: Any = None

    def on_scored(scores: Any) -> None:
        heard.append((len(scores), job.future.done()))

    try:
        job = scheduler.submit(
            prompts,
            [()] * 6,
            engine.clock.monotonic() + 1000,
            Cancellation(),
            on_scored=on_scored,
            lead=2,
        )
        engine.release.set()  # its passes start once `job` is known to the observer
        scores, timing = job.future.result(10)
    finally:
        assert scheduler.close(10)
    assert [len(one.prompts) for one in engine.passes] == [2, 4]
    assert heard == [(2, False), (6, False)]
    assert timing.passes == 2
    assert [score.logits[0] for score in scores] == [identity(prompt) for prompt in prompts]
