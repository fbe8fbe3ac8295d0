"""The one door to the engine: prompts, the token limits, scoring, readout and generation.

Every HTTP route (and the benchmarks) reaches the model through this service, so the
token limits are checked in one place, before a request queues, and a native failure marks
the service unhealthy in one place. Threads: its methods run on request threads; they
tokenize (the read-only vocabulary, under `_native` so `close` cannot free it meanwhile)
and hand all decoding to the scheduler's worker (adapter.core.scheduler), then wait for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from adapter.cancel import Cancellation, deadline_error
from adapter.core.admission import Pressure
from adapter.core.engine import BatchTiming, LlamaEngine, PromptScore
from adapter.core.failures import (
    CORE_FAILURES,
    CancelledWorkError,
    CapacityError,
    DeadlineMissedError,
    RefusedError,
    TooSlowError,
)

# Chat's request and answer types, re-exported: the chat API (adapter.chat) reaches the
# core only through this module.
from adapter.core.generation import Generation as Generation
from adapter.core.generation import Sampling as Sampling
from adapter.core.layout import Price, common_prefix_length, distinct_tokens, price
from adapter.core.scheduler import JobTiming, Scheduler
from adapter.errors import BusyError, RequestError, UnavailableError, shutting_down
from adapter.labels import LabelError, LabelSet
from adapter.likelihood import LETTERS, Listing, ReadoutChoice
from adapter.metrics import Metrics
from adapter.option_branches import HINT, OptionBranches
from adapter.ordering import Reading, Variants, expand, read
from adapter.prompts import (
    APPLIES_LABELS,
    LIKELIHOOD_PROMPT_VERSIONS,
    ChatTemplate,
    RenderedPrompt,
    TemplateRenderError,
    answer_labels,
    render_chat_prompt,
    render_decision_prompt,
    render_multi_label_prompt,
)
from adapter.question_work import Entry, LetterWork, MultiLabelWork, QuestionWork, in_chunks
from adapter.readout import NonFiniteLogitsError, SlotReadout
from adapter.schema import Decision, Mode, decision_paths
from adapter.settings import QueueLimits
from model_build.calibration import Calibration, OptionOrder

T = TypeVar("T")


@dataclass
class Health:
    """Whether the native side can still be trusted; /ping reports it."""

    healthy: bool = True
    error: str | None = None


@dataclass(frozen=True)
class ScoredBatch:
    """Readouts of one request's prompts, in request order, with how the work was done."""

    prompts: list[str]
    input_tokens: list[int]
    reused_tokens: list[int]  # per prompt, from resident prefixes
    readouts: list[SlotReadout]
    timing: JobTiming
    total_seconds: float
    distinct_input_tokens: int  # prompt tokens with every shared prefix counted once

    def timing_json(self) -> dict[str, Any]:
        timing = self.timing
        return {
            "input_tokens": sum(self.input_tokens),
            "reused_tokens": timing.reused_tokens,
            "evaluated_tokens": timing.evaluated_tokens,
            "pad_tokens": timing.pad_tokens,
            "queue_seconds": round(timing.queue_seconds, 6),
            "scoring_seconds": round(timing.scoring_seconds, 6),
            "total_seconds": round(self.total_seconds, 6),
            "passes": timing.passes,
            "batch_requests": timing.batch_requests,
            "batch_prompts": timing.batch_prompts,
        }


@dataclass
class DecisionService:
    """Scores decisions with one engine, owned by its scheduler's worker thread."""

    engine: LlamaEngine
    template: ChatTemplate
    labels: LabelSet
    max_tokens: int
    model: dict[str, Any]
    calibration: Calibration | None = None  # the model manifest's (adapter.calibration)
    option_order: OptionOrder = "canonical"  # SEMIF_OPTION_ORDER: requests may override it
    readout: ReadoutChoice = LETTERS  # SEMIF_READOUT and SEMIF_NORMALIZATION: likewise
    listing: Listing = "unlisted"  # SEMIF_LIKELIHOOD_PROMPT: whether options are listed
    limits: QueueLimits = field(default_factory=QueueLimits)
    health: Health = field(default_factory=Health)
    metrics: Metrics | None = None  # hears every pass and every question's readout
    scheduler: Scheduler = field(init=False)
    _native: threading.Lock = field(default_factory=threading.Lock)  # tokenizing vs close
    _closed: bool = False
    _branches: OptionBranches = field(init=False)  # likelihood questions' work

    def __post_init__(self) -> None:
        self._branches = OptionBranches(
            template=lambda: self.template,
            listing=lambda: self.listing,
            tokenize=self.tokenize_prompt,
            cut=self.engine.vocab.prompt_cut,
            boundaries=self._boundaries,
            end_of_turn=self._end_of_turn,
            max_tokens=self.max_tokens,
            whole_streams=self.engine.recurrent,
        )
        self.scheduler = Scheduler(
            self.engine,
            limits=self.limits,
            on_native_failure=self._mark_unhealthy,
            on_pass=self._observe_pass,
        )

    def _observe_pass(self, requests: int, prompts: int, timing: BatchTiming) -> None:
        """A pass's facts for the metrics (on the worker)."""
        if self.metrics is not None:
            self.metrics.observe_pass(
                requests=requests,
                prompts=prompts,
                evaluated=timing.evaluated_tokens,
                reused=timing.reused_tokens,
                pad=timing.pad_tokens,
                seconds=timing.seconds,
            )

    @property
    def model_id(self) -> str:
        """The name clients see in responses and in GET /v1/models: the GGUF file name."""
        return str(self.model.get("file", "unknown"))

    def _mark_unhealthy(self, error: Exception) -> None:
        """A native failure takes the instance out of service (/ping answers 503)."""
        self.health.healthy = False
        self.health.error = str(error)

    def _wait(self, future: Future[T], cancel: Cancellation, started: float, field: str) -> T:
        """Wait for the worker within the request deadline; past it the request is cancelled
        for its deadline (the worker drops it at the next pass or token)."""
        remaining = self.limits.request_timeout_seconds - (time.monotonic() - started)
        try:
            with self._answering(field):
                return future.result(timeout=max(remaining, 0.0))
        except FutureTimeoutError:
            cancel.set("deadline")
            raise deadline_error(
                f"after {self.limits.request_timeout_seconds:g} s, before the work finished"
            ) from None

    @contextmanager
    def _answering(self, field: str) -> Iterator[None]:
        """Calls into the core: its failures become what they mean to a caller, here only
        (`field` names the request's part a 400 is about)."""
        try:
            yield
        except CORE_FAILURES as error:
            raise self._answer(error, field) from None

    def _answer(self, error: Exception, field: str) -> Exception:
        """A core failure as an answer: load (refused, or the deadline out of reach at this
        instance's pace) is a 429 to come back later; a batch the KV cache could not hold
        and a server stopping are 503s; a request too slow even alone is a 400 naming its
        field (no retry helps); a native failure stays itself (a 500; the scheduler has
        already marked the instance unhealthy)."""
        if isinstance(error, RefusedError):
            return BusyError(
                str(error),
                cause=error.cause,
                retry_after=error.retry_after,
                retry_token=error.token,
            )
        if isinstance(error, DeadlineMissedError):
            return BusyError(str(error), cause="deadline")
        if isinstance(error, CapacityError):
            return UnavailableError(str(error), retryable=True, cause="capacity")
        if isinstance(error, CancelledWorkError):
            return shutting_down()
        if isinstance(error, TooSlowError):
            limit = self.limits.request_timeout_seconds
            return _too_slow(field, error.needed_seconds, limit, "its first passes' speed")
        return error

    # -- back pressure: the questions a caller with much work to give asks -----------------

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the worker (any thread)."""
        return self.scheduler.waiting

    @property
    def pressure(self) -> Pressure:
        """The scoring work ready behind the pass being scored (any thread: a snapshot)."""
        return self.scheduler.pressure

    def wants_work(self) -> bool:
        """Whether a caller with much work (a JSON Lines body) should add a request now
        (adapter.core.admission.Admission.wants_work; any thread, the event loop included)."""
        return self.scheduler.admission.wants_work(self.scheduler.pressure)

    def close(self, wait_seconds: float) -> bool:
        """Stop the worker, then free the engine; False (and nothing freed) if a pass still
        runs after `wait_seconds` (the process is exiting: leaking beats a use-after-free)."""
        if not self.scheduler.close(wait_seconds):
            return False
        with self._native:
            if not self._closed:
                self._closed = True
                self.engine.close()
        return True

    @contextmanager
    def _vocabulary(self) -> Iterator[LlamaEngine]:
        """The engine for tokenizing on a request thread: `close` cannot free the
        vocabulary meanwhile, and a closed service answers that it is shutting down."""
        with self._native:
            if self._closed:
                raise shutting_down()
            yield self.engine

    @property
    def likelihood_prompt_version(self) -> str:
        """The version of the likelihood prompt this service renders (its listing's)."""
        return LIKELIHOOD_PROMPT_VERSIONS[self.listing]

    def _end_of_turn(self) -> int:
        with self._vocabulary() as engine:
            return engine.vocab.end_of_turn

    def piece(self, token: int) -> str:
        """A token's text (the readout's top token), unless the model is being freed."""
        with self._vocabulary() as engine:
            return engine.vocab.piece(token)

    def tokenize_prompt(self, prompt: RenderedPrompt, path: str, hint: str = "") -> list[int]:
        """Tokenize a rendered prompt (request spans as plain text), refusing one over
        SEMIF_MAX_TOKENS (the one check)."""
        with self._vocabulary() as engine:
            tokens = engine.vocab.tokenize_prompt(prompt.text, prompt.user_spans)
        if len(tokens) > self.max_tokens:
            raise RequestError(
                path,
                f"prompt is {len(tokens)} tokens; the limit is {self.max_tokens} "
                f"(SEMIF_MAX_TOKENS){hint}",
            )
        return tokens

    def render(self, decisions: Sequence[Decision], mode: Mode) -> list[tuple[str, list[int]]]:
        """Render and tokenize each decision, refusing any prompt over the token limit."""
        paths = decision_paths(mode, len(decisions))
        return [(prompt.text, tokens) for prompt, tokens in self._render(decisions, paths)]

    def _render(
        self, decisions: Sequence[Decision], paths: Sequence[str]
    ) -> list[tuple[RenderedPrompt, list[int]]]:
        prompts = []
        for decision, path in zip(decisions, paths, strict=True):
            try:
                prompt = render_decision_prompt(self.template, decision)
            except (TemplateRenderError, ValueError) as error:
                raise RequestError(path, str(error)) from None
            prompts.append((prompt, self.tokenize_prompt(prompt, path, HINT)))
        return prompts

    def _boundaries(
        self, prompt: RenderedPrompt, tokens: list[int], *, branched: bool = False
    ) -> tuple[int, ...]:
        """Where the prompt's system turn ends and where its question starts (after the
        state and the template's text before the question), in tokens: the prefixes later
        prompts share (another state; another question about this one); `branched` (a
        multi-label option's prompt), also where its option starts (the prefix every
        option of the question shares). Only a model whose memory keeps whole streams needs
        them (the layout keeps checkpoints there); none otherwise. A prefix's tokens are
        counted as far as they agree with the prompt's."""
        spans = prompt.user_spans
        if not self.engine.recurrent or not spans:
            return ()
        offsets = [spans[0][0], spans[1][0] if len(spans) > 1 else spans[0][1]]
        if branched and len(spans) > 2:
            offsets.append(spans[2][0])
        cuts = []
        for offset in offsets:
            head_spans = [(a, min(b, offset)) for a, b in spans if a < offset]
            with self._vocabulary() as engine:
                head = engine.vocab.tokenize_prompt(prompt.text[:offset], head_spans)
            cuts.append(common_prefix_length(head, tokens))
        return tuple(cuts)

    def _labels(self, labels: Sequence[str], path: str) -> list[tuple[int, ...]]:
        try:
            return self.labels.token_ids(labels)
        except LabelError as error:
            raise RequestError(path, str(error)) from None

    def score(
        self,
        decisions: Sequence[Decision],
        paths: Sequence[str],
        cancel: Cancellation | None = None,
        *,
        retry_token: str | None = None,
        readouts: Sequence[ReadoutChoice] | None = None,
        on_work: WorkObserver | None = None,
        lead: int = 0,
    ) -> ScoredBatch:
        """Score decisions of any size in the scheduler's next passes.

        `paths` name each decision in errors; `cancel` (adapter.cancel) is the request's own,
        set by the HTTP layer when its client leaves (in-process callers may omit it);
        `retry_token` the place in the retry line (adapter.core.retry_line) that an earlier
        429 gave its client, which lets it in ahead of newcomers once due; `readouts` per
        decision how it is read (letters when omitted; adapter.question_work).
        Everything is validated (prompt and request token limits) before the request
        queues; decisions about one state share its prefix, options labelled with two
        tokens get their second-token logits in the same pass, and a likelihood question's
        option branches share its prompt.
        A streamed request gives `on_work`, which hears each decision's `ScoredWork` on
        this thread as soon as all its prompts are scored (in the order they finish, before
        this returns), and `lead`: how many decisions, from the first, the first pass holds
        alone, so the first answer comes after a pass no longer than it alone would take.
        """
        started = time.monotonic()
        field = paths[0].split("[")[0].split(".")[0]
        with self._answering(field):  # before the work of rendering and tokenizing
            self.scheduler.check_room(retry_token)
        choices = readouts or [LETTERS] * len(decisions)
        works = [
            self._work(decision, path, choice)
            for decision, path, choice in zip(decisions, paths, choices, strict=True)
        ]
        entries = [(owner, entry) for owner, work in enumerate(works) for entry in work.entries]
        asked = [entry for _, entry in entries]
        self._check_budget(self._price(asked), field)
        sending = self._in_chunks(asked)
        cancel = cancel or Cancellation()
        arrivals = _Arrivals(works, [owner for owner, _ in entries], sending, on_work)
        deadline = started + self.limits.request_timeout_seconds
        with self._answering(field):
            job = self.scheduler.submit(
                [entry.tokens for entry, _ in sending],
                [entry.continuations for entry, _ in sending],
                deadline,
                cancel,
                cost=self._price([entry for entry, _ in sending]),
                boundaries=[entry.boundaries for entry, _ in sending],
                scored=[entry.scored for entry, _ in sending],
                after=[entry.after for entry, _ in sending],
                held_only=[chunk for _, chunk in sending],
                retry_token=retry_token,
                on_scored=None if on_work is None else arrivals.arrived,
                lead=arrivals.sent_before(lead),
            )
        try:
            if on_work is not None:
                arrivals.follow(job.future, deadline)
            parts, timing = self._wait(job.future, cancel, started, field)
            arrivals.take(parts)
        except NonFiniteLogitsError as error:
            self._mark_unhealthy(error)
            raise
        timing = replace(timing, reused_tokens=sum(arrivals.reused))
        self._branches.remember(works, arrivals.mine)
        return ScoredBatch(
            prompts=[work.text for work in works],
            input_tokens=[work.input_tokens() for work in works],
            reused_tokens=arrivals.reused,
            readouts=arrivals.readouts,
            timing=timing,
            total_seconds=time.monotonic() - started,
            distinct_input_tokens=distinct_tokens([entry.tokens for entry in asked]),
        )

    def _price(self, entries: Sequence[Entry]) -> Price:
        return price(
            [entry.tokens for entry in entries],
            [entry.continuations for entry in entries],
            stream_cells=self.engine.stream_cells,
            scored=[entry.scored for entry in entries],
        )

    def _in_chunks(self, entries: Sequence[Entry]) -> list[tuple[Entry, bool]]:
        """The entries as sent: a prompt longer than a pass in chunks first (a pass is
        bounded in time, adapter.core.admission). Not on memory that keeps only whole
        streams, which cannot extend a chunk it must first cut back: there a long prompt
        stays one pass."""
        if self.engine.recurrent:
            return [(entry, False) for entry in entries]
        return in_chunks(entries, self.scheduler.pass_rows)

    def _work(self, decision: Decision, path: str, choice: ReadoutChoice) -> QuestionWork:
        """What the engine is sent for one question: a prompt per option for a multi-label
        question (always read by letters), else by its readout."""
        if decision.kind == "multi_label":
            return self._multi_label_work(decision, path)
        if choice.likelihood:
            return self._branches.work(decision, path, choice)
        return self._letter_work(decision, path)

    def _multi_label_work(self, decision: Decision, path: str) -> MultiLabelWork:
        """A prompt per option, the option alone after the shared state and question, each
        within SEMIF_MAX_TOKENS."""
        entries, texts = [], []
        for index, option in enumerate(decision.options):
            option_path = f"{path}.options[{index}]"
            try:
                prompt = render_multi_label_prompt(self.template, decision, option)
            except (TemplateRenderError, ValueError) as error:
                raise RequestError(option_path, str(error)) from None
            tokens = self.tokenize_prompt(prompt, option_path, HINT)
            boundaries = self._boundaries(prompt, tokens, branched=True)
            entries.append(Entry(tokens, [], 0, boundaries))
            texts.append(prompt.text)
        return MultiLabelWork("".join(texts), entries, self._labels(APPLIES_LABELS, path))

    def _letter_work(self, decision: Decision, path: str) -> LetterWork:
        """The letter prompt, with as many of its label continuations per entry as one pass
        has streams for beside it (a small KV budget, adapter.kv_memory); a repeated entry
        is resident after the first, so only its continuations are decoded again."""
        ((prompt, tokens),) = self._render([decision], [path])
        return LetterWork.of(
            prompt.text,
            tokens,
            self._labels(answer_labels(len(decision.options)), path),
            self._boundaries(prompt, tokens),
            per_pass=self.engine.max_branches - 1,
        )

    def _check_budget(self, cost: Price, path: str) -> None:
        """Refuse, before it queues, a request over SEMIF_MAX_REQUEST_TOKENS (what the layout
        charges it: rows, passes' copies) or one whose own passes, at the measured speed,
        cannot end within SEMIF_REQUEST_TIMEOUT_S: no retry can help either (a 400)."""
        limit = self.limits.max_request_tokens
        if cost.charge() > limit:
            raise RequestError(
                path,
                f"the request costs {cost.charge()} tokens (the rows its passes decode, "
                f"label continuations and stream copies included); the limit is {limit} "
                "(SEMIF_MAX_REQUEST_TOKENS); send fewer or shorter decisions",
            )
        seconds = self.scheduler.seconds_for(cost)
        deadline = self.limits.request_timeout_seconds
        if seconds is not None and seconds > deadline:
            raise _too_slow(path, seconds, deadline, "this model's measured speed")

    def read_variants(
        self,
        variants: Sequence[Variants],
        paths: Sequence[str],
        cancel: Cancellation | None = None,
        *,
        retry_token: str | None = None,
        on_reading: ReadingObserver | None = None,
    ) -> tuple[list[Reading], ScoredBatch]:
        """Score each question's prompts in its option order (adapter.ordering) in one
        batch, and read them back in the caller's order: how every API scores options.
        A streamed request gives `on_reading`, which hears each question read as soon as
        its prompts are scored (its index, its reading, the tokens its prompts reused), the
        first question alone in the first pass."""
        decisions, expanded, readouts = expand(variants, paths)
        heard = None if on_reading is None else _QuestionsHeard(variants, on_reading)
        batch = self.score(
            decisions,
            expanded,
            cancel,
            retry_token=retry_token,
            readouts=readouts,
            on_work=None if heard is None else heard.work,
            lead=len(variants[0].orders) if heard is not None else 0,
        )
        # A streamed request's questions were read as they were told (each once).
        readings = read(variants, batch) if heard is None else heard.readings()
        if self.metrics is not None:
            for variant, reading in zip(variants, readings, strict=True):
                self.metrics.observe_question(
                    variant.kind, variant.mode, reading.allowed_token_mass
                )
        return readings, batch

    def generate(
        self,
        messages: Sequence[dict[str, str]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        cancel: Cancellation | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> Generation:
        """Chat: render the messages, check the prompt limit, and generate while holding the
        engine. A streamed chat passes `on_text`, which hears each step's new text on the
        worker (quick, never raising: adapter.streaming's `Feed.put`) before this returns
        the whole generation, so every failure is still answered here, in one place."""
        started = time.monotonic()
        try:
            prompt = render_chat_prompt(self.template, messages)
        except (TemplateRenderError, ValueError) as error:
            raise RequestError("messages", str(error)) from None
        cancel = cancel or Cancellation()
        tokens = self.tokenize_prompt(prompt, "messages")
        with self._answering("messages"):
            job = self.scheduler.submit_generation(
                tokens,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop=stop,
                deadline=started + self.limits.request_timeout_seconds,
                cancel=cancel,
                on_text=on_text,
            )
        return self._wait(job.future, cancel, started, "messages")


def _too_slow(path: str, needed: float, allowed: float, speed: str) -> RequestError:
    """The 400 for a request that cannot be scored within SEMIF_REQUEST_TIMEOUT_S at `speed`
    (at admission, or after its first passes): no retry can help, a smaller request can."""
    return RequestError(
        path,
        f"the request needs about {needed:.0f} s of scoring at {speed}; a request may take "
        f"{allowed:g} s (SEMIF_REQUEST_TIMEOUT_S); send fewer "
        "or shorter decisions",
    )


# Hears each question of a streamed request read: (its index, its reading, the tokens its
# prompts took from resident prefixes). On the request's thread.
ReadingObserver = Callable[[int, Reading, int], None]


class _QuestionsHeard:
    """A streamed request's questions, each read and told once all its decisions' works
    (one per option order, adapter.ordering.expand) are scored; kept for the answer."""

    def __init__(self, variants: Sequence[Variants], on_reading: ReadingObserver) -> None:
        self._variants, self._on_reading = variants, on_reading
        self._question: list[int] = []  # per work, its question
        for index, variant in enumerate(variants):
            self._question += [index] * len(variant.orders)
        self._works: dict[int, list[tuple[int, ScoredWork]]] = {}
        self._read: dict[int, Reading] = {}

    def readings(self) -> list[Reading]:
        """Every question's reading, in request order (once the request is scored)."""
        return [self._read[question] for question in range(len(self._variants))]

    def work(self, index: int, scored: ScoredWork) -> None:
        question = self._question[index]
        works = self._works.setdefault(question, [])
        works.append((index, scored))
        variant = self._variants[question]
        if len(works) < len(variant.orders):
            return
        ordered = [work for _, work in sorted(works, key=lambda pair: pair[0])]
        reading = variant.read(
            [work.prompt for work in ordered],
            [work.input_tokens for work in ordered],
            [work.readout for work in ordered],
        )
        self._read[question] = reading
        self._on_reading(question, reading, sum(work.reused_tokens for work in ordered))


@dataclass(frozen=True)
class ScoredWork:
    """One decision's prompt read, as a streamed request hears it (adapter.ordering reads
    a question from its decisions' works: one per option order)."""

    prompt: str
    input_tokens: int
    reused_tokens: int
    readout: SlotReadout


# Hears each decision of a streamed request as soon as all its prompts are scored: (its
# index among the decisions scored, its work). On the request's thread.
WorkObserver = Callable[[int, ScoredWork], None]


class _Arrivals:
    """A request's scores gathered by decision as passes deliver them (a streamed request's
    decisions are read and told as each completes; every request's at the end).

    Threads: `arrived` runs on the scheduler's worker and only queues what it is given;
    `follow` and `take` run on the request's thread, which alone reads the works."""

    def __init__(
        self,
        works: Sequence[QuestionWork],
        owners: Sequence[int],  # per entry asked, the work it belongs to
        sending: Sequence[tuple[Entry, bool]],
        on_work: WorkObserver | None,
    ) -> None:
        self._works, self._owners, self._sending = works, owners, sending
        self._on_work = on_work
        self._queue: queue.SimpleQueue[Sequence[PromptScore] | None] = queue.SimpleQueue()
        self.mine: list[list[PromptScore]] = [[] for _ in works]
        self._read: dict[int, SlotReadout] = {}
        self._reused: dict[int, int] = {}
        self._taken = 0  # entries asked (not chunks) whose scores are in `mine`

    def sent_before(self, lead: int) -> int:
        """How many prompts are sent up to the last of the first `lead` decisions' entries
        (their chunks included); 0 for none."""
        if lead <= 0:
            return 0
        entries = sum(len(work.entries) for work in self._works[:lead])
        asked = 0
        for index, (_, chunk) in enumerate(self._sending):
            asked += not chunk
            if asked == entries:
                return index + 1
        return len(self._sending)

    def arrived(self, scores: Sequence[PromptScore]) -> None:
        """The worker's report after a pass: every score so far, in sending order."""
        self._queue.put(scores)

    def follow(self, future: Future[Any], deadline: float) -> None:
        """Take each report until the request's work has ended (done, failed, cancelled) or
        its deadline has passed (then the caller's wait says which)."""
        future.add_done_callback(lambda _: self._queue.put(None))
        while True:
            try:
                scores = self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                return
            if scores is None:
                return
            self.take(scores)

    def take(self, scores: Sequence[PromptScore]) -> None:
        """File the scores of the prompts sent so far under their decisions, and read (and
        tell, when streaming) each decision whose prompts are now all in."""
        parts = _without_chunks(self._sending[: len(scores)], scores)
        for part in parts[self._taken :]:
            owner = self._owners[self._taken]
            self._taken += 1
            own = self.mine[owner]
            own.append(part)
            work = self._works[owner]
            if len(own) < len(work.entries):
                continue
            self._read[owner] = work.read(own)
            self._reused[owner] = work.reused_tokens(own)
            if self._on_work is not None:
                scored = ScoredWork(
                    work.text, work.input_tokens(), self._reused[owner], self._read[owner]
                )
                self._on_work(owner, scored)

    @property
    def readouts(self) -> list[SlotReadout]:
        return [self._read[owner] for owner in range(len(self._works))]

    @property
    def reused(self) -> list[int]:
        return [self._reused[owner] for owner in range(len(self._works))]


def _without_chunks(
    sending: Sequence[tuple[Entry, bool]], parts: Sequence[PromptScore]
) -> list[PromptScore]:
    """The scores of the entries asked for, without their chunks'. What a chunk decoded is
    charged to the entry it was sent for (`in_chunks` sends a chunk just before the first
    entry that needs it), so an entry's reused tokens are those it did not decode itself,
    as when it is sent whole, and a request's reused and evaluated tokens add up to its
    input."""
    kept = []
    decoded = 0  # what the chunks sent for the next entry decoded
    for (entry, chunk), part in zip(sending, parts, strict=True):
        if chunk:
            decoded += len(entry.tokens) - part.reused_tokens
            continue
        kept.append(replace(part, reused_tokens=max(0, part.reused_tokens - decoded)))
        decoded = 0
    return kept
