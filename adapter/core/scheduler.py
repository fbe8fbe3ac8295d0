"""Continuous batching: one worker owns the engine and scores every waiting request that fits.

Requests wait in a bounded queue. Whenever the worker is free it drops every request that
was cancelled (adapter.cancel: its client has gone, or its caller stopped waiting) or whose
queue timeout or deadline passed, then takes prompts from the queue's head onward while they
fit one pass (sequence ids, a token budget, SEMIF_MAX_BATCH_REQUESTS requests) and scores
them in one engine call, so prompts from different callers share their common prefix (the
template; the whole state when two ask about the same one). Requests start in arrival
order. A request larger than one pass is scored over several; with prefix reuse it goes
behind the requests that waited meanwhile after each of its passes (round robin: its state
stays resident, and it never holds every later pass); without reuse its later passes are
its own, since a newcomer would empty the cache it reads from.

Overload is refused at arrival: once a pass has measured the speed, a request that finds
more work queued ahead than it may wait (SEMIF_QUEUE_TIMEOUT_S) gets a 429 (come back
later) at once instead of after the wait. A full queue (SEMIF_MAX_QUEUE) and a request still
waiting after SEMIF_QUEUE_TIMEOUT_S get theirs too. Every refusal is a place in a line
(adapter.core.retry_line): a Retry-After of its own, a request's worth of work after the
last place, and a token the client sends back with its retry. The refused come back about
as fast as room frees, first refused first, and a returning holder enters ahead of
newcomers, so under overload every client is served in turn, not only the quickest. A
request whose own passes, at the speed its first ones ran, cannot end by its deadline is
stopped there (adapter.core.failures.TooSlowError when it could not even alone), not
decoded to the end for an answer nobody receives.

Chat runs one generation at a time in the same worker, one token per step, between scoring
passes: scoring never waits for a whole generation.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from adapter.cancel import Cancellation, deadline_error
from adapter.core.engine import BatchTiming, LlamaEngine, PromptScore
from adapter.core.failures import (
    CancelledWorkError,
    CapacityError,
    NativeFailureError,
    TooSlowError,
)
from adapter.core.generation import Generation, GenerationRun, Sampling
from adapter.core.layout import Price, price
from adapter.core.retry_line import Refusal, RetryLine
from adapter.errors import (
    MAX_RETRY_AFTER_S,
    ApiError,
    BusyCause,
    BusyError,
    UnavailableError,
    shutting_down,
)
from adapter.settings import QueueLimits

LOG = logging.getLogger("adapter")

# Seconds a refused client may be late for its place before the line forgets it (it gave
# up, or went elsewhere): long enough for a retry's jitter and a round trip.
RETURN_GRACE_S = 2.0
PLACES_PER_QUEUE_SLOT = 4  # the retry line holds this many places per SEMIF_MAX_QUEUE slot


@dataclass(frozen=True)
class JobTiming:
    """What a request cost: time queued and scoring, and the passes it rode in."""

    queue_seconds: float
    scoring_seconds: float
    passes: int
    batch_requests: int  # the most requests that shared a pass with it (itself included)
    batch_prompts: int  # the most prompts in such a pass
    reused_tokens: int
    evaluated_tokens: int  # rows decoded on its prompts' paths (shared rows counted once)
    pad_tokens: int  # rows of its passes decoded again only for the exact path (shared)


@dataclass
class _Job:
    prompts: Sequence[Sequence[int]]
    continuations: Sequence[Sequence[int]]
    price: Price  # adapter.core.layout: what each prompt adds to a pass
    boundaries: Sequence[Sequence[int]]  # per prompt: where checkpoints may be kept
    scored: Sequence[int]  # per prompt: its last tokens whose log-probabilities are read
    deadline: float
    enqueued: float
    cancel: Cancellation
    future: Future[tuple[list[PromptScore], JobTiming]] = field(default_factory=Future)
    done: int = 0  # prompts scored so far
    scores: list[PromptScore] = field(default_factory=list)
    started: float | None = None
    scoring_seconds: float = 0.0  # its passes' seconds, whole
    own_seconds: float = 0.0  # its share of them, by the rows each pass charged it
    passes: int = 0
    batch_requests: int = 0
    batch_prompts: int = 0
    reused: int = 0
    evaluated: int = 0
    pads: int = 0


@dataclass
class _ChatJob:
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    stop: Sequence[str]
    deadline: float
    cancel: Cancellation
    future: Future[Generation] = field(default_factory=Future)


# Hears each scoring pass on the worker: (requests in it, prompts in it, what it cost). It
# must be quick and must not raise (the service counts the pass in its metrics).
PassObserver = Callable[[int, int, BatchTiming], None]


class Scheduler:
    """The worker thread and its queue. Threads: `submit`, `submit_generation` and `close`
    run on request threads (under the queue's lock); everything else on the worker, the one
    thread that decodes or touches the KV cache."""

    def __init__(
        self,
        engine: LlamaEngine,
        *,
        limits: QueueLimits,
        on_native_failure: Callable[[Exception], None],
        on_pass: PassObserver | None = None,
    ) -> None:
        self.engine = engine
        self._on_pass = on_pass
        self.max_queue = limits.max_queue
        self.queue_timeout_seconds = limits.queue_timeout_seconds
        self.max_batch_requests = limits.max_batch_requests
        self.pass_rows = engine.pass_rows  # a larger request is scored over several passes
        self._on_native_failure = on_native_failure
        self._queue: collections.deque[_Job] = collections.deque()
        self._chats: collections.deque[_ChatJob] = collections.deque()
        self._condition = threading.Condition()
        self._closed = False  # set by close: the worker ends and nothing is served after
        self._pass_seconds = 0.5  # running estimate, for Retry-After
        # Seconds a priced row takes, measured over recent passes; None until one ran.
        self._row_seconds: float | None = None
        self._request_rows: float | None = None  # what an admitted request is charged
        self._pass_charge = 0  # rows the pass being scored takes off the backlog (worker)
        self._line = RetryLine(
            horizon_s=MAX_RETRY_AFTER_S,
            grace_s=RETURN_GRACE_S,
            capacity=PLACES_PER_QUEUE_SLOT * self.max_queue,
        )
        self._thread = threading.Thread(target=self._run, name="semif-scheduler", daemon=True)
        self._thread.start()

    # -- callers ---------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._queue) + len(self._chats)

    def backlog_rows(self) -> int:
        """Rows of scoring work queued or under way, as the layout charges them."""
        with self._condition:
            return sum(job.price.charge(job.done) for job in self._queue)

    def ready_rows(self) -> int:
        """The backlog less the pass being scored: the work ready for the passes after it."""
        return max(0, self.backlog_rows() - self._pass_charge)

    def wants_work(self) -> bool:
        """Whether a caller with much work to give (a JSON Lines body, adapter/lines.py)
        should add a request now: while less than a pass of rows is ready behind the pass
        being scored and (once a pass has measured the speed) it takes less than half the
        queue timeout. The next pass is then full when it starts, and what is added starts
        within its queue timeout, one pass or two after it arrived. More would only wait:
        requests take turns pass by pass, so a queue of many would all finish late, past
        their deadlines."""
        rows = self.ready_rows()
        if rows >= self.pass_rows:
            return False
        per_row = self._row_seconds
        return per_row is None or rows * per_row < self.queue_timeout_seconds / 2

    def check_room(self, retry_token: str | None = None) -> None:
        """Refuse now what `submit` would refuse now (a full queue, more work ahead than a
        request may wait, a place in the retry line not yet due): the service asks before
        rendering and tokenizing, so a refused attempt (a client retrying under overload)
        costs the CPU next to nothing. `submit` checks again (the queue may have filled
        meanwhile) and only then gives the request's place up."""
        with self._condition:
            self._refuse_unless_room(retry_token, claim=False)

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        deadline: float,
        cancel: Cancellation,
        *,
        cost: Price | None = None,
        boundaries: Sequence[Sequence[int]] = (),
        scored: Sequence[int] = (),
        retry_token: str | None = None,
    ) -> _Job:
        """Queue a scoring request (already validated); a full queue or more work ahead than
        it may wait is a 429. `cost` is the request's price if the caller already
        asked the layout for it (the service does, for the request budget); `boundaries`
        per prompt, where the engine may keep checkpoints, and `scored` per prompt, how
        many of its last tokens are scored (LlamaEngine.score); `retry_token` the place in
        the retry line an earlier refusal gave its client."""
        if cost is None:
            cost = price(
                prompts, continuations, stream_cells=self.engine.stream_cells, scored=scored
            )
        cuts = boundaries or [()] * len(prompts)
        counts = scored or [0] * len(prompts)
        job = _Job(prompts, continuations, cost, cuts, counts, deadline, time.monotonic(), cancel)
        with self._condition:
            self._refuse_unless_room(retry_token, claim=True)
            self._queue.append(job)
            rows = cost.charge()
            self._request_rows = (
                rows if self._request_rows is None else (0.8 * self._request_rows + 0.2 * rows)
            )
            self._condition.notify()
        return job

    def submit_generation(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        deadline: float,
        cancel: Cancellation,
    ) -> _ChatJob:
        job = _ChatJob(prompt, max_new_tokens, sampling, stop, deadline, cancel)
        with self._condition:
            self._make_room(self.waiting, None, place=False)
            self._chats.append(job)
            self._condition.notify()
        return job

    def _refuse_unless_room(self, retry_token: str | None, *, claim: bool) -> None:
        """A scoring request's room: the queue's, then the time it would wait and the retry
        line's (under the lock)."""
        self._make_room(self.waiting, retry_token, place=True)
        self._refuse_if_overloaded(retry_token, claim=claim)

    def _make_room(self, waiting: int, retry_token: str | None, *, place: bool) -> None:
        """Whether the queue has room. Who may enter at all (loading, unhealthy, stopping)
        is decided once, by adapter.runtime's admission; the queue only refuses what it
        cannot hold, and after `close` (a request admitted just before shutdown) nothing.
        A refused scoring request gets (or keeps) a place in the retry line; a chat request
        (`place` False) only a Retry-After: chat clients bring no token back."""
        if self._closed:
            raise shutting_down()
        if waiting >= self.max_queue:
            drain = self._drain_seconds(waiting)
            raise _busy(
                f"busy: {waiting} requests are queued (SEMIF_MAX_QUEUE={self.max_queue})",
                self._refuse(drain, retry_token)
                if place
                else Refusal(self._line.told(drain), None),
                "queue_full",
            )

    def seconds_for(self, price: Price) -> float | None:
        """How long the request's own passes take at the speed of recent passes (None until
        a pass has measured it). Read on request threads: one float, written by the worker."""
        per_row = self._row_seconds
        return None if per_row is None else price.charge() * per_row

    def _refuse_if_overloaded(self, retry_token: str | None, *, claim: bool) -> None:
        """Refuse at once, not after the wait: when the work queued ahead, at the speed of
        recent passes, already takes longer than SEMIF_QUEUE_TIMEOUT_S, a request admitted
        now would only wait to be refused, and a newcomer whose work would push a refused
        client past that limit when its place falls due would take that client's turn. The
        caller retries when told (its client's retries do the waiting, without holding a
        place in the queue). With prefix reuse requests take turns pass by pass, so a
        newcomer waits for the next pass of each request ahead, not for all of a long one;
        without, a request keeps its passes."""
        if self._row_seconds is None:
            return
        now = time.monotonic()
        wait = self._wait_seconds(now, self._row_seconds)
        limit = self.queue_timeout_seconds
        refusal = self._line.enter(
            now,
            retry_token,
            ahead_s=wait,
            request_s=self._request_seconds(),
            limit_s=limit,
            claim=claim,
        )
        if refusal is None:
            return
        reason = (
            f"about {wait:.0f} s of work is queued ahead, more than a request may wait "
            f"(SEMIF_QUEUE_TIMEOUT_S={limit:g})"
            if wait > limit
            else "clients refused earlier are due first"
        )
        raise _busy(f"busy: {reason}", refusal, "overloaded")

    def _wait_seconds(self, now: float, row_seconds: float) -> float:
        """Seconds of queued work a request arriving now waits for, at the measured speed:
        each request ahead's share (`_ahead`), except a request that will reach its queue
        timeout before its turn comes. That one is dropped, not run (a server flooded before
        its first pass measured the speed holds minutes of such work), and counting it would
        send the refused away for minutes while the queue empties in seconds."""
        seconds = 0.0
        for job in self._queue:
            if job.started is None and now + seconds > job.enqueued + self.queue_timeout_seconds:
                continue
            seconds += self._ahead(job) * row_seconds
        return seconds

    def _ahead(self, job: _Job) -> int:
        """The rows of `job` a request arriving now waits for (see _refuse_if_overloaded)."""
        if not self.engine.prefix_reuse:
            return job.price.charge(job.done)
        return job.price.next_pass(job.done, self.pass_rows, self.engine.max_branches)

    def _drain_seconds(self, waiting: int) -> float:
        """Seconds until the queue has likely drained by a batch's worth."""
        return waiting / max(self.max_batch_requests, 1) * self._pass_seconds

    def _request_seconds(self) -> float:
        """A typical request's work at the measured speed (0 until a pass measured it)."""
        return (self._request_rows or 0.0) * (self._row_seconds or 0.0)

    def _refuse(self, earliest: float, retry_token: str | None = None) -> Refusal:
        """A place in the retry line (under the lock): the one `retry_token` holds, else a
        new one no sooner than `earliest` seconds from now, a request's work after the last.
        Told the same second, the refused would return together and all but one be refused
        again: each refusal costs the cores a little, and under overload they add up to
        decisions not made (figure 6a)."""
        return self._line.refuse(
            time.monotonic(),
            earliest_s=earliest,
            request_s=self._request_seconds(),
            token=retry_token,
        )

    def close(self, wait_seconds: float) -> bool:
        """Stop the worker (failing whatever waits with a retryable 503); False if a pass
        still runs after `wait_seconds`."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join(wait_seconds)
        return not self._thread.is_alive()

    # -- the worker ------------------------------------------------------------------------

    def _run(self) -> None:
        generation: tuple[_ChatJob, GenerationRun] | None = None
        while True:
            with self._condition:
                while not self._closed and not self._queue and not self._chats and not generation:
                    self._condition.wait()
                if self._closed:
                    self._fail_all(generation)
                    return
                batch = self._take_pass()
                if generation is None and self._chats:
                    generation = self._start_chat(self._chats.popleft())
            if batch:
                self._score(batch)
            if generation is not None:
                generation = self._step_chat(*generation)

    def _take_pass(self) -> list[tuple[_Job, int, int]]:
        """(job, first prompt, end) slices that fit one pass, in queue order, after dropping
        every cancelled and expired request."""
        now = time.monotonic()
        for job in [job for job in self._queue if self._expired(job, now)]:
            self._queue.remove(job)  # every pass: not only those the pass would reach
        taken: list[tuple[_Job, int, int]] = []
        rows = sequences = 0
        for job in self._queue:
            if len(taken) >= self.max_batch_requests:
                break
            end = job.done
            while end < len(job.prompts):
                cost = job.price.prompts[end]
                fits = cost.sequences == 0 or (  # a repeat rides with the prompt it repeats
                    rows + cost.rows <= self.pass_rows
                    and sequences + cost.sequences <= self.engine.max_branches
                )
                if not fits and (taken or end > job.done):
                    break
                rows += cost.rows
                sequences += cost.sequences
                end += 1
            if end == job.done:
                break  # arrival order: nobody overtakes a request that does not fit
            taken.append((job, job.done, end))
            if end < len(job.prompts):
                break  # the pass is full
            if job.done > 0 and not self.engine.prefix_reuse:
                break  # a newcomer would empty the cache this request's rest reads from
        return taken

    def _expired(self, job: _Job, now: float) -> bool:
        if job.cancel.is_set():
            job.future.set_exception(job.cancel.error())
            return True
        if job.started is None and now - job.enqueued > self.queue_timeout_seconds:
            job.future.set_exception(
                _busy(
                    f"busy: waited {now - job.enqueued:.1f} s in the queue "
                    f"(SEMIF_QUEUE_TIMEOUT_S={self.queue_timeout_seconds:g})",
                    self._refuse(self._drain_seconds(len(self._queue))),
                    "queue_timeout",
                )
            )
            return True
        if now > job.deadline:
            job.future.set_exception(deadline_error("before it was scored"))
            return True
        return False

    def _score(self, batch: list[tuple[_Job, int, int]]) -> None:
        prompts = [job.prompts[i] for job, start, end in batch for i in range(start, end)]
        continuations = [
            job.continuations[i] for job, start, end in batch for i in range(start, end)
        ]
        boundaries = [job.boundaries[i] for job, start, end in batch for i in range(start, end)]
        scored = [job.scored[i] for job, start, end in batch for i in range(start, end)]
        started = time.monotonic()
        for job, _, _ in batch:
            if job.started is None:
                job.started = started
        # What this pass takes off the backlog (`ready_rows`), until it ends.
        charge = sum(job.price.charge(start) - job.price.charge(end) for job, start, end in batch)
        self._pass_charge = charge
        try:
            scores, timing = self.engine.score(
                prompts,
                continuations,
                # Only the queue's head can continue, so its earlier passes came just before.
                continuing=all(start > 0 for _, start, _ in batch),
                boundaries=boundaries,
                scored=scored,
            )
        except Exception as error:  # the worker outlives any one pass
            self._pass_charge = 0
            failure = self._failure(error)
            with self._condition:
                for job, _, _ in batch:
                    self._queue.remove(job)
                    job.future.set_exception(failure)
            return
        seconds = time.monotonic() - started
        if self._on_pass is not None:
            self._on_pass(len(batch), len(prompts), timing)
        self._pass_seconds = 0.8 * self._pass_seconds + 0.2 * seconds
        priced = max(charge, 1)
        per_row = seconds / priced
        self._row_seconds = (
            per_row if self._row_seconds is None else 0.8 * self._row_seconds + 0.2 * per_row
        )
        offset = 0
        finished = []
        hopeless: list[tuple[_Job, Exception]] = []
        for job, start, end in batch:
            mine = scores[offset : offset + end - start]
            offset += end - start
            job.scores.extend(mine)
            job.done = end
            job.scoring_seconds += seconds
            job.own_seconds += seconds * (job.price.charge(start) - job.price.charge(end)) / priced
            job.passes += 1
            job.batch_requests = max(job.batch_requests, len(batch))
            job.batch_prompts = max(job.batch_prompts, len(prompts))
            job.reused += sum(score.reused_tokens for score in mine)
            job.evaluated += len(frozenset().union(*(score.rows for score in mine)))
            job.pads += timing.pad_tokens
            if job.done == len(job.prompts):
                finished.append(job)
            elif (reason := self._cannot_finish(job, time.monotonic())) is not None:
                hopeless.append((job, reason))
        self._pass_charge = 0  # the jobs' `done` now counts it
        ended = finished + [job for job, _ in hopeless]
        with self._condition:
            for job in ended:
                self._queue.remove(job)
            if self.engine.prefix_reuse:
                # Round robin: a request larger than one pass goes behind those that waited
                # meanwhile, so it never holds every later pass (its state stays resident).
                # Without reuse its later passes are its own (the cache is kept for them).
                for job, _, _ in batch:
                    if job not in ended:
                        self._queue.remove(job)
                        self._queue.append(job)
        for job in finished:
            job.future.set_result((job.scores, self._timing(job)))
        for job, reason in hopeless:
            job.future.set_exception(reason)

    @staticmethod
    def _cannot_finish(job: _Job, now: float) -> Exception | None:
        """Why a request part-way through cannot end by its deadline, judged by the speed
        of its own passes so far (its share of each): a TooSlowError when its passes
        alone outlast the time a request may take (a retry cannot help), the deadline's 429
        when they only outlast what is left of it; None while it can still make it. The
        estimate at admission (Scheduler.seconds_for) reads other requests' passes; this
        reads its own, after one pass, before the worker spends more on it."""
        charged = job.price.charge() - job.price.charge(job.done)
        left = job.price.charge(job.done) * job.own_seconds / max(charged, 1)
        allowed = job.deadline - job.enqueued
        if job.own_seconds + left > allowed:
            return TooSlowError(job.own_seconds + left, allowed)
        if now + left > job.deadline:
            return BusyError(
                f"the request cannot end by its deadline (SEMIF_REQUEST_TIMEOUT_S): after "
                f"{job.passes} passes the rest needs about {left:.0f} s at their speed, and "
                f"{max(job.deadline - now, 0):.0f} s are left",
                cause="deadline",
            )
        return None

    def _failure(self, error: Exception) -> Exception:
        """What the callers of a failed pass or generation get: a retryable 503 when the
        work did not fit or was cancelled at shutdown; the error itself otherwise (a 500,
        and after a native failure the instance reports unhealthy)."""
        if isinstance(error, NativeFailureError):
            self._on_native_failure(error)
        if isinstance(error, CapacityError):
            return UnavailableError(str(error), retryable=True, cause="capacity")
        if isinstance(error, CancelledWorkError):
            return UnavailableError(str(error), retryable=True, cause="stopping")
        if not isinstance(error, NativeFailureError):
            LOG.exception("scoring pass failed")
        return error

    @staticmethod
    def _timing(job: _Job) -> JobTiming:
        started = job.started if job.started is not None else job.enqueued
        return JobTiming(
            queue_seconds=started - job.enqueued,
            scoring_seconds=job.scoring_seconds,
            passes=job.passes,
            batch_requests=job.batch_requests,
            batch_prompts=job.batch_prompts,
            reused_tokens=job.reused,
            evaluated_tokens=job.evaluated,
            pad_tokens=job.pads,
        )

    def _start_chat(self, job: _ChatJob) -> tuple[_ChatJob, GenerationRun] | None:
        if job.cancel.is_set():
            job.future.set_exception(job.cancel.error())
            return None
        if time.monotonic() > job.deadline:
            job.future.set_exception(deadline_error("before generation began"))
            return None
        try:
            run = self.engine.start_generation(
                job.prompt,
                max_new_tokens=job.max_new_tokens,
                sampling=job.sampling,
                stop=job.stop,
            )
        except Exception as error:  # the worker outlives any one request
            job.future.set_exception(self._failure(error))
            return None
        return job, run

    def _step_chat(
        self, job: _ChatJob, run: GenerationRun
    ) -> tuple[_ChatJob, GenerationRun] | None:
        """One token; the generation ends early when its client left or time ran out."""
        try:
            if job.cancel.is_set():
                raise job.cancel.error()
            if time.monotonic() > job.deadline:
                raise deadline_error("during generation")
            if not run.step():
                return job, run
            result = run.result()
        except ApiError as error:
            job.future.set_exception(error)
            run.close()
            return None
        except Exception as error:  # the worker outlives any one request
            job.future.set_exception(self._failure(error))
            run.close()
            return None
        run.close()
        job.future.set_result(result)
        return None

    def _fail_all(self, generation: tuple[_ChatJob, GenerationRun] | None) -> None:
        stopping = shutting_down()
        for job in self._queue:
            job.future.set_exception(stopping)
        self._queue.clear()
        for chat in self._chats:
            chat.future.set_exception(stopping)
        self._chats.clear()
        if generation is not None:
            generation[0].future.set_exception(stopping)
            generation[1].close()


def _busy(message: str, refusal: Refusal, cause: BusyCause) -> BusyError:
    """The 429 of a refusal: when to come back, and the place's token."""
    return BusyError(
        message, cause=cause, retry_after=refusal.retry_after, retry_token=refusal.token
    )
