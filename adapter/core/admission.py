"""Who may queue for the worker, and when the refused come back: the speed model, the wait
estimate, the room decisions and the retry line, in one owner.

Overload is refused at arrival. Once a pass has measured the speed, a request that finds more
work queued ahead than it may wait (SEMIF_QUEUE_TIMEOUT_S) is refused at once instead of
after the wait; a full queue (SEMIF_MAX_QUEUE) and a request still waiting after its queue
timeout are refused too. Every refusal is a place in a line (adapter.core.retry_line): a
Retry-After of its own, a typical request's work after the last place, and a token the
client sends back. After each of a multi-pass request's passes, its own speed says whether
its remaining passes can still end by its deadline.

The speed model. A pass takes about `a + b * rows + c * cells` seconds: a fixed cost, a
cost per row decoded (copies charged as rows, adapter.core.layout) and a cost per cell a
row attends to, since a row deep in a long prompt attends to every position before it. The
three are fitted by least squares over recent passes (each weighing `FORGET` as much as the
pass after it), pulled towards the plain seconds-per-row ratio while the passes seen cannot
tell them apart. With one ratio, a 3,000-token state was estimated from the short prompts
around it and ran at least 2x longer than estimated.

Invariants (tests/adapter/test_admission.py checks them on randomized inputs, fake clock):
- a full queue refuses (`queue_full`) and nothing else does while no pass has measured
  the speed;
- with no place held in the retry line, a request whose wait for the passes ahead fits
  its queue timeout is admitted: behind one long request (which takes turns pass by pass
  with prefix reuse) a small one waits for one pass of it, not for all of it;
- a typical request's work (the retry line's spacing) is the median of recent requests,
  so one long request does not push everyone refused after it tens of seconds back;
- once the speed is fitted, the estimate for a multi-pass request is within
  `ESTIMATE_FACTOR` of the time its passes take, long prompts included;
- every refusal's Retry-After is between 1 and `horizon_s` (the retry line's own
  invariants hold: tests/adapter/test_retry_line.py).

Pure: the caller passes the clock and a read-only view of the queue (`Waiting`). Threads:
the scheduler calls its methods under its queue's lock, and the worker reports each pass
(`passed`) there too, so the model is never read half-written. Two need no lock:
`cannot_finish` reads only the job it is given, and `wants_work` only the `Pressure`
snapshot it is given (the service calls it on the event loop).
"""

from __future__ import annotations

import collections
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from adapter.core.failures import DeadlineMissedError, RefusedError, TooSlowError
from adapter.core.layout import Price, Work
from adapter.core.retry_line import RetryLine

MAX_RETRY_AFTER_S = 30  # the longest Retry-After a refusal is told
# Seconds a refused client may be late for its place before the line forgets it (it gave
# up, or went elsewhere): long enough for a retry's jitter and a round trip.
RETURN_GRACE_S = 2.0
PLACES_PER_QUEUE_SLOT = 4  # the retry line holds this many places per SEMIF_MAX_QUEUE slot
FORGET = 0.9  # a pass's weight in the speed fit, relative to the pass after it
# How strongly the fit is pulled towards the plain seconds-per-row ratio (a prior worth
# about this many passes): enough to keep three unknowns from chasing noise while recent
# passes look alike, little enough that passes of different shapes decide.
PRIOR_PASSES = 0.5
TYPICAL_OF = 32  # recent admitted requests whose median is a typical request's work
# A pass is bounded in time as well as rows: at most this share of the queue timeout at the
# measured speed (a newcomer waits about one pass behind a long request), never fewer rows
# than MIN_PASS_ROWS (a pass must still share a template and a state across prompts).
PASSES_PER_QUEUE_TIMEOUT = 8
MIN_PASS_ROWS = 128
ESTIMATE_FACTOR = 1.5  # the stated bound on a multi-pass request's estimate (see above)

Cause = Literal["queue_full", "overloaded", "queue_timeout"]


class Waiting(Protocol):
    """What admission reads of a queued request (the scheduler's own job, read-only)."""

    @property
    def price(self) -> Price: ...

    @property
    def done(self) -> int: ...  # prompts scored so far

    @property
    def enqueued(self) -> float: ...

    @property
    def started(self) -> float | None: ...


class Running(Waiting, Protocol):
    """A request part-way through: its deadline and the seconds its passes charged it."""

    @property
    def deadline(self) -> float: ...

    @property
    def own_seconds(self) -> float: ...

    @property
    def passes(self) -> int: ...


@dataclass(frozen=True)
class Pressure:
    """What a caller with much work to give reads without the lock: the rows ready for the
    passes after the one being scored, and what they take at the measured speed (None until
    a pass measured it). Replaced whole under the lock, read whole off it."""

    ready_rows: int = 0
    ready_seconds: float | None = None
    pass_rows: int = 0  # rows a pass may take (0: not yet published, any work is welcome)


class SpeedModel:
    """Seconds a pass takes, `a + b * rows + c * cells`, fitted over recent passes."""

    def __init__(self) -> None:
        self._gram = np.zeros((3, 3))  # weighted sums of x x^T, x = (1, rows, cells)
        self._moment = np.zeros(3)  # weighted sums of x * seconds
        self._seconds = 0.0  # weighted sums for the plain ratio
        self._rows = 0.0
        self.coefficients: tuple[float, float, float] | None = None

    def passed(self, seconds: float, work: Work) -> None:
        x = np.array([1.0, float(work.rows), float(work.cells)])
        self._gram = FORGET * self._gram + np.outer(x, x)
        self._moment = FORGET * self._moment + x * seconds
        self._seconds = FORGET * self._seconds + seconds
        self._rows = FORGET * self._rows + max(work.rows, 1)
        self.coefficients = self._fit()

    def rows_within(self, seconds: float) -> int | None:
        """The rows a pass can decode in `seconds`, at the cells per row recent passes
        attended to (None until a pass was measured)."""
        if self.coefficients is None:
            return None
        fixed, per_row, per_cell = self.coefficients
        cells_per_row = self._gram[0, 2] / max(self._gram[0, 1], 1e-12)
        return int(max(seconds - fixed, 0.0) / (per_row + per_cell * cells_per_row))

    def seconds(self, work: Work, passes: int = 1) -> float | None:
        """What `work` takes over `passes` passes; None until a pass was measured."""
        if self.coefficients is None:
            return None
        fixed, per_row, per_cell = self.coefficients
        return passes * fixed + work.rows * per_row + work.cells * per_cell

    def _fit(self) -> tuple[float, float, float]:
        """Least squares with a ridge towards (0, the plain ratio, 0), scaled to the data;
        a negative fixed or per-cell cost (noise) is dropped and the rest refitted."""
        ratio = self._seconds / self._rows
        prior = np.array([0.0, ratio, 0.0])
        scale = np.maximum(np.diag(self._gram), 1e-12) * PRIOR_PASSES / max(self._gram[0, 0], 1e-12)
        free = [True, True, True]
        while True:
            index = [i for i in range(3) if free[i]]
            gram = self._gram[np.ix_(index, index)] + np.diag(scale[index])
            moment = self._moment[index] + scale[index] * prior[index]
            solved = np.linalg.solve(gram, moment)
            fitted = np.zeros(3)
            fitted[index] = solved
            negative = [i for i in (0, 2) if free[i] and fitted[i] < 0]
            if not negative:
                break
            for i in negative:
                free[i] = False
        if fitted[1] <= 0:  # never a free row: fall back to the ratio
            return (0.0, ratio, 0.0)
        return (float(fitted[0]), float(fitted[1]), float(fitted[2]))


class Admission:
    """Room in the queue and the speed it drains at, for one scheduler."""

    def __init__(
        self,
        *,
        max_queue: int,
        queue_timeout_seconds: float,
        max_batch_requests: int,
        pass_rows: int,
        max_sequences: int,
        prefix_reuse: bool,
        horizon_s: int,
    ) -> None:
        self.max_queue = max_queue
        self.queue_timeout_seconds = queue_timeout_seconds
        self.max_batch_requests = max_batch_requests
        self.most_pass_rows = pass_rows
        self.max_sequences = max_sequences
        self.prefix_reuse = prefix_reuse
        self.speed = SpeedModel()
        self._pass_seconds = 0.5  # a pass's running time, for a full queue's Retry-After
        self._recent: collections.deque[Work] = collections.deque(maxlen=TYPICAL_OF)
        self._line = RetryLine(
            horizon_s=horizon_s, grace_s=RETURN_GRACE_S, capacity=PLACES_PER_QUEUE_SLOT * max_queue
        )

    # -- the speed -------------------------------------------------------------------------

    @property
    def pass_rows(self) -> int:
        """Rows one pass may take: the engine's most, fewer where the measured speed would
        make such a pass outlast its share of the queue timeout (PASSES_PER_QUEUE_TIMEOUT),
        never fewer than MIN_PASS_ROWS (or the engine's most, if that is less). A prompt
        longer than this is decoded over several passes (the service sends its leading
        chunks first), so no pass holds the worker for long: what a newcomer waits behind
        is about one such pass."""
        within = self.speed.rows_within(self.queue_timeout_seconds / PASSES_PER_QUEUE_TIMEOUT)
        if within is None:
            return self.most_pass_rows
        return min(self.most_pass_rows, max(MIN_PASS_ROWS, within))

    def passed(self, seconds: float, work: Work) -> None:
        """The worker scored a pass of `work` in `seconds`."""
        self._pass_seconds = 0.8 * self._pass_seconds + 0.2 * seconds
        self.speed.passed(seconds, work)

    def queued(self, price: Price) -> None:
        """A scoring request was admitted (what a typical request costs)."""
        self._recent.append(price.work())

    def seconds_for(self, price: Price, start: int = 0) -> float | None:
        """What the request's own passes from prompt `start` on take alone at the measured
        speed (None until a pass measured it)."""
        passes = price.passes(self.pass_rows, self.max_sequences, start)
        return self.speed.seconds(sum(passes, Work()), len(passes))

    def typical_seconds(self) -> float:
        """A typical request's work at the measured speed: the median of recent requests,
        so one long request does not stretch every refused client's wait (0 until known)."""
        if not self._recent:
            return 0.0
        rows = statistics.median_low(work.rows for work in self._recent)
        typical = next(work for work in self._recent if work.rows == rows)
        return self.speed.seconds(typical) or 0.0

    # -- arrival ---------------------------------------------------------------------------

    def admit(
        self,
        now: float,
        queue: Iterable[Waiting],
        waiting: int,
        token: str | None,
        *,
        claim: bool,
    ) -> None:
        """Let a scoring request queue now, or raise its RefusedError: a full queue, more work
        ahead than it may wait, or a returning client's place not yet due (`token`; `claim`
        gives a due place up: the request queues; a check before the real entry keeps it)."""
        if waiting >= self.max_queue:
            raise self._full(now, waiting, token, place=True)
        if self.speed.coefficients is None:
            return
        ahead = self.wait_seconds(now, queue)
        limit = self.queue_timeout_seconds
        refusal = self._line.enter(
            now, token, ahead_s=ahead, request_s=self.typical_seconds(), limit_s=limit, claim=claim
        )
        if refusal is None:
            return
        reason = (
            f"about {ahead:.0f} s of work is queued ahead, more than a request may wait "
            f"(SEMIF_QUEUE_TIMEOUT_S={limit:g})"
            if ahead > limit
            else "clients refused earlier are due first"
        )
        raise RefusedError(f"busy: {reason}", "overloaded", refusal.retry_after, refusal.token)

    def admit_chat(self, now: float, waiting: int) -> None:
        """A chat request's room: only a full queue refuses it, with a Retry-After and no
        place (chat clients bring no token back)."""
        if waiting >= self.max_queue:
            raise self._full(now, waiting, None, place=False)

    def _full(self, now: float, waiting: int, token: str | None, *, place: bool) -> RefusedError:
        drain = self._drain_seconds(waiting)
        if not place:
            retry_after, handed = self._line.told(drain), None
        else:
            refusal = self._line.refuse(
                now, earliest_s=drain, request_s=self.typical_seconds(), token=token
            )
            retry_after, handed = refusal.retry_after, refusal.token
        return RefusedError(
            f"busy: {waiting} requests are queued (SEMIF_MAX_QUEUE={self.max_queue})",
            "queue_full",
            retry_after,
            handed,
        )

    def wait_seconds(self, now: float, queue: Iterable[Waiting]) -> float:
        """Seconds of queued work a request arriving now waits for, at the measured speed:
        with prefix reuse requests take turns pass by pass, so each request ahead's next
        pass; without, all of each. A request that will reach its queue timeout before its
        turn is dropped, not run, and is not counted (a server flooded before its first
        pass measured the speed holds minutes of such work, and counting it would send the
        refused away for minutes while the queue empties in seconds)."""
        ahead = Work()
        seconds = 0.0
        for job in queue:
            if job.started is None and now + seconds > job.enqueued + self.queue_timeout_seconds:
                continue
            ahead += self._ahead(job)
            seconds = self.speed.seconds(ahead, -(-ahead.rows // self.pass_rows)) or 0.0
        return seconds

    def _ahead(self, job: Waiting) -> Work:
        if not self.prefix_reuse:
            return job.price.work(job.done)
        passes = job.price.passes(self.pass_rows, self.max_sequences, job.done)
        return passes[0] if passes else Work()

    def _drain_seconds(self, waiting: int) -> float:
        """Seconds until the queue has likely drained by a batch's worth."""
        return waiting / max(self.max_batch_requests, 1) * self._pass_seconds

    # -- waiting and running ---------------------------------------------------------------

    def timed_out(self, now: float, job: Waiting, waiting: int) -> RefusedError | None:
        """A request still unstarted after its queue timeout, refused with a place."""
        if job.started is not None or now - job.enqueued <= self.queue_timeout_seconds:
            return None
        refusal = self._line.refuse(
            now, earliest_s=self._drain_seconds(waiting), request_s=self.typical_seconds()
        )
        return RefusedError(
            f"busy: waited {now - job.enqueued:.1f} s in the queue "
            f"(SEMIF_QUEUE_TIMEOUT_S={self.queue_timeout_seconds:g})",
            "queue_timeout",
            refusal.retry_after,
            refusal.token,
        )

    @staticmethod
    def cannot_finish(job: Running, now: float) -> Exception | None:
        """Why a request part-way through cannot end by its deadline, judged by the speed of
        its own passes so far (its share of each): TooSlowError when its passes alone
        outlast the time a request may take (a retry cannot help), DeadlineMissedError when
        they only outlast what is left of it; None while it can still make it. The estimate
        at arrival reads other requests' passes; this reads its own, before the worker
        spends more on it."""
        charged = job.price.charge() - job.price.charge(job.done)
        left = job.price.charge(job.done) * job.own_seconds / max(charged, 1)
        allowed = job.deadline - job.enqueued
        if job.own_seconds + left > allowed:
            return TooSlowError(job.own_seconds + left, allowed)
        if now + left > job.deadline:
            return DeadlineMissedError(
                f"the request cannot end by its deadline (SEMIF_REQUEST_TIMEOUT_S): after "
                f"{job.passes} passes the rest needs about {left:.0f} s at their speed, and "
                f"{max(job.deadline - now, 0):.0f} s are left"
            )
        return None

    # -- back pressure ---------------------------------------------------------------------

    def pressure(self, ready: Work) -> Pressure:
        """The published view of `ready` work (see Pressure)."""
        seconds = self.speed.seconds(ready, 0) if ready.rows else 0.0
        return Pressure(ready.rows, seconds, self.pass_rows)

    def wants_work(self, pressure: Pressure) -> bool:
        """Whether a caller with much work to give (a JSON Lines body, adapter.lines) should
        add a request now: while less than a pass of rows is ready behind the pass being
        scored and (once a pass has measured the speed) it takes less than half the queue
        timeout. The next pass is then full when it starts, and what is added starts within
        its queue timeout, one pass or two after it arrived. More would only wait: requests
        take turns pass by pass, so a queue of many would all finish late, past their
        deadlines. Any thread: it reads only the published `pressure` and settings."""
        if pressure.pass_rows and pressure.ready_rows >= pressure.pass_rows:
            return False
        seconds = pressure.ready_seconds
        return seconds is None or seconds < self.queue_timeout_seconds / 2
