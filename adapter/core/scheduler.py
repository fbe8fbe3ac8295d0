"""Continuous batching: one worker owns the engine and scores every waiting request that fits.

Requests wait in a bounded queue. Whenever the worker is free it drops every request that
was cancelled (adapter.cancel: its client has gone, or its caller stopped waiting) or whose
queue timeout or deadline passed, then takes prompts from the queue's head onward while they
fit one pass (the layout's packing rule, `fitting`: sequence ids, a row budget,
SEMIF_MAX_BATCH_REQUESTS requests) and scores them in one engine call, so prompts from
different callers share their common prefix (the template; the whole state when two ask
about the same one). Requests start in arrival order. A request larger than one pass is
scored over several; with prefix reuse it goes behind the requests that waited meanwhile
after each of its passes (round robin: its state stays resident, and it never holds every
later pass); without reuse its later passes are its own, since a newcomer would empty the
cache it reads from.

Who may queue, and what the speed says about waiting and deadlines, is the admission's
(adapter.core.admission): the scheduler asks it under the queue's lock and reports each
pass to it. What a refusal or a failure means to a caller is the service's; the core raises
its own failure types (adapter.core.failures).

Chat runs one generation at a time in the same worker, one token per step, between scoring
passes: scoring never waits for a whole generation. A streamed chat's text is handed out
after each step (`on_text`), as llama.cpp's server sends each task's partial results: what
the tokens so far fix for certain (adapter.core.generation's `new_text`).

Threads: `check_room`, `submit`, `submit_generation`, `seconds_for` and `pass_rows` run
on request threads, under the queue's lock, and `close` on the shutdown thread
(adapter.runtime's close), under it too; `waiting` and `pressure` are read on any thread
without it (an integer, and a snapshot the worker replaces whole, `admission.Pressure`);
everything else runs on the worker, the one thread that decodes or touches the KV cache.
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
from adapter.core.admission import MAX_RETRY_AFTER_S, Admission, Pressure
from adapter.core.engine import BatchTiming, LlamaEngine, PromptScore
from adapter.core.failures import (
    CORE_FAILURES,
    CancelledWorkError,
    NativeFailureError,
)
from adapter.core.generation import Generation, GenerationRun, Sampling
from adapter.core.layout import Price, Work, fitting, price
from adapter.settings import QueueLimits

LOG = logging.getLogger("adapter")


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


# Hears a scoring request's progress on the worker, after each pass that scored some of its
# prompts: every score so far, in prompt order (a streamed request reads each question as
# soon as its prompts are in). It must be quick and must not raise.
ScoreObserver = Callable[[Sequence[PromptScore]], None]


@dataclass
class _Job:
    prompts: Sequence[Sequence[int]]
    continuations: Sequence[Sequence[int]]
    price: Price  # adapter.core.layout: what each prompt adds to a pass
    boundaries: Sequence[Sequence[int]]  # per prompt: where checkpoints may be kept
    scored: Sequence[int]  # per prompt: its last tokens whose log-probabilities are read
    after: Sequence[Sequence[int]]  # per prompt: tokens whose log-probability after it is read
    held_only: Sequence[bool]  # per prompt: sent only to be held (a chunk), never read
    deadline: float
    enqueued: float
    cancel: Cancellation
    on_scored: ScoreObserver | None = None
    lead: int = 0  # prompts its first pass may take at most (0: no limit)
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


# Hears each step of a streamed generation on the worker: the text it adds that can no
# longer change (GenerationRun.new_text; "" when a step only held bytes back). It must be
# quick and must not raise (the service hands it to the event loop's queue).
TextObserver = Callable[[str], None]


@dataclass
class _ChatJob:
    prompt: Sequence[int]
    max_new_tokens: int
    sampling: Sampling
    stop: Sequence[str]
    deadline: float
    cancel: Cancellation
    on_text: TextObserver | None = None
    future: Future[Generation] = field(default_factory=Future)


# Hears each scoring pass on the worker: (requests in it, prompts in it, what it cost). It
# must be quick and must not raise (the service counts the pass in its metrics).
PassObserver = Callable[[int, int, BatchTiming], None]


class Scheduler:
    """The worker thread and its queue (threads: see the module docstring)."""

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
        self.max_batch_requests = limits.max_batch_requests
        self._on_native_failure = on_native_failure
        self._queue: collections.deque[_Job] = collections.deque()
        self._chats: collections.deque[_ChatJob] = collections.deque()
        self._condition = threading.Condition()
        self._closed = False  # set by close: the worker ends and nothing is served after
        self._pass_work = Work()  # what the pass being scored takes off the backlog
        self.admission = Admission(
            max_queue=limits.max_queue,
            queue_timeout_seconds=limits.queue_timeout_seconds,
            max_batch_requests=limits.max_batch_requests,
            pass_rows=engine.pass_rows,
            max_sequences=engine.max_branches,
            prefix_reuse=engine.prefix_reuse,
            horizon_s=MAX_RETRY_AFTER_S,
        )
        self.pressure = Pressure()  # replaced whole under the lock (`_publish`)
        self._thread = threading.Thread(target=self._run, name="semif-scheduler", daemon=True)
        self._thread.start()

    # -- callers ---------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._queue) + len(self._chats)

    def check_room(self, retry_token: str | None = None) -> None:
        """Refuse now what `submit` would refuse now (adapter.core.failures.RefusedError): the
        service asks before rendering and tokenizing, so a refused attempt (a client
        retrying under overload) costs the CPU next to nothing. `submit` checks again (the
        queue may have filled meanwhile) and only then gives the request's place up."""
        with self._condition:
            self._admit(retry_token, claim=False)

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
        after: Sequence[Sequence[int]] = (),
        held_only: Sequence[bool] = (),
        retry_token: str | None = None,
        on_scored: ScoreObserver | None = None,
        lead: int = 0,
    ) -> _Job:
        """Queue a scoring request (already validated), or raise the admission's RefusedError.
        `cost` is the request's price if the caller already asked the layout for it (the
        service does, for the request budget); `boundaries` per prompt, where the engine
        may keep checkpoints, and `scored` per prompt, how many of its last tokens are
        scored, and `after` the tokens read after it (LlamaEngine.score); `held_only` per
        prompt, whether it is sent only to be held for the prompts after it (a long
        prompt's leading chunk: its score is never read); `retry_token` the place in the
        retry line an earlier refusal gave its client. A streamed request gives
        `on_scored`, which hears its scores after each pass, and `lead`, the prompts its
        first pass takes at most (its first question alone, answered after a pass no
        longer than that question would take by itself; the rest follow)."""
        if cost is None:
            cost = price(
                prompts, continuations, stream_cells=self.engine.stream_cells, scored=scored
            )
        cuts = boundaries or [()] * len(prompts)
        counts = scored or [0] * len(prompts)
        following = after or [()] * len(prompts)
        held = held_only or [False] * len(prompts)
        job = _Job(
            prompts,
            continuations,
            cost,
            cuts,
            counts,
            following,
            held,
            deadline,
            time.monotonic(),
            cancel,
            on_scored,
            lead,
        )
        with self._condition:
            self._admit(retry_token, claim=True)
            self._queue.append(job)
            self.admission.queued(cost)
            self._publish()
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
        on_text: TextObserver | None = None,
    ) -> _ChatJob:
        """Queue a chat generation, or raise the admission's RefusedError (a full queue).
        `on_text`, for a streamed chat, hears each step's new text before the future
        holds the whole generation."""
        job = _ChatJob(prompt, max_new_tokens, sampling, stop, deadline, cancel, on_text)
        with self._condition:
            self._open()
            self.admission.admit_chat(time.monotonic(), self.waiting)
            self._chats.append(job)
            self._condition.notify()
        return job

    @property
    def pass_rows(self) -> int:
        """Rows one pass may take now, bounded in time as well as rows (the admission's
        `pass_rows`): a prompt longer than this is sent in chunks (the service)."""
        with self._condition:
            return self.admission.pass_rows

    def seconds_for(self, cost: Price) -> float | None:
        """How long the request's own passes take at the measured speed (None until a pass
        has measured it)."""
        with self._condition:
            return self.admission.seconds_for(cost)

    def _admit(self, retry_token: str | None, *, claim: bool) -> None:
        """A scoring request's room (under the lock): none after `close` (a request admitted
        just before shutdown), else what the admission says."""
        self._open()
        self.admission.admit(time.monotonic(), self._queue, self.waiting, retry_token, claim=claim)

    def _open(self) -> None:
        """Who may enter at all (loading, unhealthy, stopping) is decided once, by
        adapter.runtime's admission; after `close` the queue itself takes nothing."""
        if self._closed:
            raise CancelledWorkError("the server is shutting down")

    def _publish(self) -> None:
        """Replace the back-pressure snapshot (under the lock): the rows queued, less what
        the pass being scored takes off them."""
        queued = sum((job.price.work(job.done) for job in self._queue), Work())
        self.pressure = self.admission.pressure(queued - self._pass_work)

    def close(self, wait_seconds: float) -> bool:
        """Stop the worker (failing whatever waits as cancelled); False if a pass still runs
        after `wait_seconds`."""
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
        every cancelled and expired request (under the lock)."""
        now = time.monotonic()
        for job in [job for job in self._queue if self._expired(job, now)]:
            self._queue.remove(job)  # every pass: not only those the pass would reach
        taken: list[tuple[_Job, int, int]] = []
        rows = sequences = 0
        pass_rows = self.admission.pass_rows
        for job in self._queue:
            if len(taken) >= self.max_batch_requests:
                break
            self._skip_held(job, pass_rows)
            end = fitting(
                job.price.prompts,
                job.done,
                rows=rows,
                sequences=sequences,
                pass_rows=pass_rows,
                max_sequences=self.engine.max_branches,
            )
            if job.passes == 0 and job.done < job.lead:
                end = min(end, job.lead)
            if end == job.done:
                break  # arrival order: nobody overtakes a request that does not fit
            for cost in job.price.prompts[job.done : end]:
                rows += cost.rows
                sequences += cost.sequences
            taken.append((job, job.done, end))
            if end < len(job.prompts):
                break  # the pass is full
            if job.done > 0 and not self.engine.prefix_reuse:
                break  # a newcomer would empty the cache this request's rest reads from
        self._pass_work = sum((job.price.work(start, end) for job, start, end in taken), Work())
        self._publish()
        return taken

    def _skip_held(self, job: _Job, pass_rows: int) -> None:
        """Pass over the job's next chunks (prompts sent only to be held, leading a long
        prompt) where they would cost a pass each for nothing: a chunk a stream already
        holds (a follow-up question inside a resident state), and every chunk once what
        the cache lacks of the prompt they lead to fits one pass. Only with prefix reuse,
        where what the cache holds may be used; a skipped chunk counts as reused whole."""
        if not (self.engine.prefix_reuse and job.held_only[job.done]):
            return
        led = next(i for i in range(job.done, len(job.prompts)) if not job.held_only[i])
        lacking = len(job.prompts[led]) - self.engine.held(job.prompts[led])
        while job.held_only[job.done]:
            chunk = job.prompts[job.done]
            if lacking > pass_rows and self.engine.held(chunk) < len(chunk):
                return
            job.scores.append(PromptScore.held(len(chunk)))
            job.reused += len(chunk)
            job.done += 1

    def _expired(self, job: _Job, now: float) -> bool:
        if job.cancel.is_set():
            job.future.set_exception(job.cancel.error())
            return True
        late = self.admission.timed_out(now, job, len(self._queue))
        if late is not None:
            job.future.set_exception(late)
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
        after = [job.after[i] for job, start, end in batch for i in range(start, end)]
        started = time.monotonic()
        for job, _, _ in batch:
            if job.started is None:
                job.started = started
        work = self._pass_work
        try:
            scores, timing = self.engine.score(
                prompts,
                continuations,
                # Only the queue's head can continue, so its earlier passes came just before.
                continuing=all(start > 0 for _, start, _ in batch),
                boundaries=boundaries,
                scored=scored,
                after=after,
            )
        except Exception as error:  # the worker outlives any one pass
            self._failed(error)
            with self._condition:
                for job, _, _ in batch:
                    self._queue.remove(job)
                    job.future.set_exception(error)
                self._pass_work = Work()
                self._publish()
            return
        seconds = time.monotonic() - started
        if self._on_pass is not None:
            self._on_pass(len(batch), len(prompts), timing)
        priced = max(work.rows, 1)
        offset = 0
        finished = []
        hopeless: list[tuple[_Job, Exception]] = []
        for job, start, end in batch:
            mine = scores[offset : offset + end - start]
            offset += end - start
            job.scores.extend(mine)
            job.done = end
            job.scoring_seconds += seconds
            job.own_seconds += seconds * job.price.charge(start, end) / priced
            job.passes += 1
            job.batch_requests = max(job.batch_requests, len(batch))
            job.batch_prompts = max(job.batch_prompts, len(prompts))
            job.reused += sum(score.reused_tokens for score in mine)
            job.evaluated += len(frozenset().union(*(score.rows for score in mine)))
            job.pads += timing.pad_tokens
            if job.on_scored is not None:
                job.on_scored(tuple(job.scores))
            if job.done == len(job.prompts):
                finished.append(job)
            elif (reason := self.admission.cannot_finish(job, time.monotonic())) is not None:
                hopeless.append((job, reason))
        ended = finished + [job for job, _ in hopeless]
        with self._condition:
            self.admission.passed(seconds, work)
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
            self._pass_work = Work()  # the jobs' `done` now counts it
            self._publish()
        for job in finished:
            job.future.set_result((job.scores, self._timing(job)))
        for job, reason in hopeless:
            job.future.set_exception(reason)

    def _failed(self, error: Exception) -> None:
        """A failed pass or generation (its callers get the error itself): a native
        failure takes the instance out of service; anything but the core's own failures
        is logged with its traceback."""
        if isinstance(error, NativeFailureError):
            self._on_native_failure(error)
        elif not isinstance(error, CORE_FAILURES):
            LOG.exception("scoring pass failed")

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
            self._failed(error)
            job.future.set_exception(error)
            return None
        return job, run

    def _step_chat(
        self, job: _ChatJob, run: GenerationRun
    ) -> tuple[_ChatJob, GenerationRun] | None:
        """One token; the generation ends early when its client left or time ran out."""
        if job.cancel.is_set() or time.monotonic() > job.deadline:
            stopped = job.cancel.error() if job.cancel.is_set() else None
            job.future.set_exception(stopped or deadline_error("during generation"))
            run.close()
            return None
        try:
            finished = run.step()
            if job.on_text is not None:
                job.on_text(run.new_text())
            if not finished:
                return job, run
            result = run.result()
        except Exception as error:  # the worker outlives any one request
            self._failed(error)
            job.future.set_exception(error)
            run.close()
            return None
        run.close()
        job.future.set_result(result)
        return None

    def _fail_all(self, generation: tuple[_ChatJob, GenerationRun] | None) -> None:
        stopping = CancelledWorkError("the server is shutting down")
        for job in self._queue:
            job.future.set_exception(stopping)
        self._queue.clear()
        for chat in self._chats:
            chat.future.set_exception(stopping)
        self._chats.clear()
        if generation is not None:
            generation[0].future.set_exception(stopping)
            generation[1].close()
