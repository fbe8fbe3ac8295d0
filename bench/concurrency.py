"""Closed-loop concurrency: throughput and latency with N clients, against the engine's limit,
the same server with batching off, and llama.cpp's own server.

Each of N clients holds one connection and sends its next request as soon as the previous
answer returns (a closed loop: the offered load follows the server's speed, as it does for
an application with N workers). Every level sends a fixed list of decisions, each about its
own ~150-token account state, so a server's prefix cache only ever helps with the template
prefix every prompt shares; the mix sends every 4th decision about one hot account instead.
Throughput is successful answers over the wall time from the first send to the last answer.
A non-200 answer is counted, not retried; a client refused with Retry-After waits that long
before its next request, plus the jitter the project's client adds (a refused client that
sent again at once would spin on the cores the server shares with it here).

The limit scores the same prompts in-process on the server's own engine settings, as many
per engine call as there are clients (no more can be waiting). It and the server with
batching off stay loaded through our server's sweep and are measured right next to its
compare level, one thing at a time, so the machine's drift lands on every side of figures
6b and 6c.
"""

from __future__ import annotations

import math
import random
import re
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from queue import SimpleQueue
from typing import Any, TypeVar

import httpx

from adapter.core.admission import MAX_RETRY_AFTER_S
from adapter.prompts import answer_labels
from adapter.schema import Decision
from adapter.settings import Settings
from bench.local import (
    InProcessModel,
    ServerProcess,
    serve_llama_server,
    serve_model,
    weight_buffers_setting,
)
from bench.metrics import latency_summary
from bench.peer_server import PeerBinary
from bench.runner import save_figure
from bench.tasks import shared_body, single_body
from bench.workload import account_state, concurrent_decisions, many_questions
from client.decision_client import (
    CUSTOM_ATTRIBUTES_HEADER,
    JSON,
    DecisionClient,
    EndpointError,
    HttpTransport,
    RetryPolicy,
    Transport,
    custom_attributes,
    retry_token_of,
)

T = TypeVar("T")
S = TypeVar("S")
STATE_EVENTS = 4  # ~150 SmolLM2 tokens of account history; prompts are ~250 tokens
SHARED_EVERY = 4  # in the mix, 1 request in 4 is about the hot account
PEER_TOP_TOKENS = 20
CLIENT_TIMEOUT_S = 600.0
WORKLOADS = ("distinct", "mix")
INVOCATION_LIMIT_S = 60.0  # SageMaker's InvokeEndpoint: a later answer never reaches the caller
RETRY_JITTER = RetryPolicy()  # the project's client's jitter after a Retry-After
HEAD_OF_LINE_EVENTS = 7  # the long request's state: ~250 SmolLM2 tokens
SMALL_EVENTS = 0  # the small decision's state: its header line only (prompt ~120 tokens)


@dataclass(frozen=True)
class Plan:
    """How much the concurrency phase sends: `levels` client counts, each sending
    max(min_requests, requests_per_client * clients) decisions; the limit and batching-off
    comparisons at `compare_level`, llama-server at `peer_levels`."""

    levels: tuple[int, ...]
    compare_level: int
    peer_levels: tuple[int, ...]
    requests_per_client: int
    min_requests: int
    limit_repeats: int
    # Overload as an application sees it (figure 6d): this many closed-loop clients, each
    # the project's DecisionClient (retries within its budget); None skips it.
    client_level: int | None = None
    # Head-of-line wait (figure 6e): a small decision sent `head_of_line_delay_s` after one
    # shared-state request of this many questions (several passes); 0 skips it.
    head_of_line_decisions: int = 0
    head_of_line_delay_s: float = 1.0

    def __post_init__(self) -> None:
        if self.compare_level not in self.levels or not set(self.peer_levels) <= set(self.levels):
            raise ValueError("the compare and peer levels must be among the levels")
        if self.limit_repeats < 1:
            raise ValueError("the limit needs at least one timed call")
        if self.client_level is not None and self.client_level < 1:
            raise ValueError("the client level needs at least one client")

    def requests(self, clients: int) -> int:
        return max(self.min_requests, self.requests_per_client * clients)

    def decisions(self, workload: str, clients: int, *, again: bool = False) -> list[Decision]:
        """The same decisions for every server at one level; each (workload, level) gets its
        own series of states, so no level finds a state an earlier one left in a cache, and
        so does the compare level's repeat (`again`, after the levels above it)."""
        series = 1 + 2 * self.levels.index(clients) + WORKLOADS.index(workload)
        if again:
            series = 3 + 2 * len(self.levels)
        shared_every = SHARED_EVERY if workload == "mix" else None
        return concurrent_decisions(
            self.requests(clients), series=series, events=STATE_EVENTS, shared_every=shared_every
        )

    def client_decisions(self) -> list[Decision]:
        """Figure 6d's calls: as many as a level of `client_level` clients sends, on states
        of their own series (after every level's)."""
        if self.client_level is None:
            return []
        return concurrent_decisions(
            self.requests(self.client_level), series=1 + 2 * len(self.levels), events=STATE_EVENTS
        )

    def head_of_line(self) -> tuple[list[Decision], Decision]:
        """Figure 6e's long request (questions about one ~250-token state) and the small
        decision sent after it, on states no level uses."""
        series = 2 + 2 * len(self.levels)
        variant = series * 100_000 + 50_000  # beside the series' own accounts
        state = account_state(HEAD_OF_LINE_EVENTS, variant, variant * HEAD_OF_LINE_EVENTS)
        (small,) = concurrent_decisions(1, series=series, events=SMALL_EVENTS)
        return many_questions(state, self.head_of_line_decisions), small


WARM_UP = concurrent_decisions(1, series=0, events=STATE_EVENTS)[0]


# -- the closed loop ----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What one request got back; status 0 means no HTTP answer (connection error, timeout).
    The optional fields are read with defaults, so older servers still report."""

    status: int
    queue_seconds: float | None = None
    batch_requests: int | None = None
    covers_options: bool | None = None  # peer: every option letter among its top tokens
    same_prompt: bool | None = None  # peer: it evaluated exactly the tokens sent
    error: str | None = None
    retry_after: float | None = None  # a refusal's Retry-After, in seconds
    attempts: int | None = None  # the project's client: HTTP attempts the call took


@dataclass(frozen=True)
class Sample:
    started: float  # time.perf_counter() at send
    seconds: float
    reply: Reply
    client: int = 0  # which of the level's clients sent it


Send = Callable[[httpx.Client, T], Reply]


def closed_loop(
    base_url: str,
    items: Sequence[T],
    clients: int,
    send: Send[T],
    *,
    timeout_s: float = CLIENT_TIMEOUT_S,
    transport: httpx.BaseTransport | None = None,
) -> list[Sample]:
    """Send every item once from `clients` threads, each with its own single connection,
    each taking the next unsent item as soon as its previous answer is in. Samples come
    back in item order."""

    def connect() -> httpx.Client:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        return httpx.Client(
            base_url=base_url, timeout=timeout_s, limits=limits, transport=transport
        )

    return run_clients(items, clients, connect, send)


def run_clients(
    items: Sequence[T],
    clients: int,
    connect: Callable[[], AbstractContextManager[S]],
    send: Callable[[S, T], Reply],
) -> list[Sample]:
    """The closed loop over any client: `clients` threads, each with its own session from
    `connect`, each sending the next unsent item as soon as its previous call returned."""
    pending = iter(range(len(items)))
    jitters = random.Random(len(items))  # noqa: S311 - jitter, seeded: runs repeat
    lock = threading.Lock()
    samples: list[Sample | None] = [None] * len(items)

    def client(number: int) -> None:
        with connect() as session:
            while True:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                started = time.perf_counter()
                try:
                    reply = send(session, items[index])
                except httpx.HTTPError as error:
                    reply = Reply(0, error=f"{type(error).__name__}: {error}")
                samples[index] = Sample(started, time.perf_counter() - started, reply, number)
                if reply.retry_after is not None:
                    # As the project's client does: a refused client waits as told, plus
                    # its jitter, before it sends again, instead of spinning on the
                    # server's (shared) cores, or returning in one burst with all the others
                    # told the same second.
                    jitter = RETRY_JITTER.retry_after_jitter_s * jitters.random()
                    time.sleep(min(reply.retry_after, MAX_RETRY_AFTER_S) + jitter)

    with ThreadPoolExecutor(max_workers=clients) as pool:
        for running in [pool.submit(client, number) for number in range(clients)]:
            running.result()  # a bug in `send` surfaces here, not as a missing sample
    return [sample for sample in samples if sample is not None]


def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _failure(response: httpx.Response) -> Reply:
    retry_after = response.headers.get("retry-after", "")
    return Reply(
        response.status_code,
        error=response.text[:300],
        retry_after=float(retry_after) if retry_after.isdigit() else None,
    )


def hold_place(http: httpx.Client, response: httpx.Response) -> None:
    """As a raw HTTP caller keeps its place in the server's retry line: a refusal's
    `retry_token` goes back with the session's next request; any other answer ends it."""
    try:
        token = retry_token_of(response.json()) if response.status_code == 429 else None
    except ValueError:
        token = None
    if token is None:
        http.headers.pop(CUSTOM_ATTRIBUTES_HEADER, None)
    else:
        http.headers[CUSTOM_ATTRIBUTES_HEADER] = custom_attributes(token)


def send_decision(http: httpx.Client, decision: Decision) -> Reply:
    """One decision to our /invocations; the batch facts come from its `timing`. A refused
    client's next request brings its retry token (`hold_place`)."""
    response = http.post("/invocations", json=single_body(decision))
    hold_place(http, response)
    if response.status_code != 200:
        return _failure(response)
    timing = response.json().get("timing") or {}
    batch = _number(timing.get("batch_requests"))
    return Reply(
        200,
        queue_seconds=_number(timing.get("queue_seconds")),
        batch_requests=None if batch is None else int(batch),
    )


@dataclass(frozen=True)
class PeerPrompt:
    """Our exact prompt tokens for one decision, and the first token of each option label."""

    tokens: list[int]
    label_tokens: frozenset[int]


def send_completion(http: httpx.Client, prompt: PeerPrompt) -> Reply:
    """One token from llama-server's /completion with the top token probabilities before
    sampling (a softmax of the logits): how a user of that server gets option scores."""
    body = {
        "prompt": prompt.tokens,  # token ids: the server adds no BOS to these
        "n_predict": 1,
        "n_probs": PEER_TOP_TOKENS,
        "temperature": 0.0,
        "cache_prompt": True,
        "response_fields": ["completion_probabilities", "tokens_evaluated"],
    }
    response = http.post("/completion", json=body)
    if response.status_code != 200:
        return _failure(response)
    return read_completion(response.json(), prompt)


def read_completion(answer: dict[str, Any], prompt: PeerPrompt) -> Reply:
    top = {entry["id"] for entry in answer["completion_probabilities"][0]["top_logprobs"]}
    return Reply(
        200,
        covers_options=prompt.label_tokens <= top,
        same_prompt=answer.get("tokens_evaluated") == len(prompt.tokens),
    )


# -- summaries ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """One level's figures: throughput, latency of answered requests, errors, queueing."""

    clients: int
    requests: int
    ok: int
    non_200: int
    non_200_statuses: dict[str, int]
    first_error: str | None
    wall_seconds: float
    decisions_per_second: float
    latency_seconds: dict[str, float]
    queue_seconds: dict[str, float] | None
    batch_requests_mean: float | None
    batch_requests_max: int | None
    ok_past_invocation_limit: int  # 200s that SageMaker would have turned into errors
    # Overload: how long a refused request (429) waited for its answer, and how evenly the
    # answers were shared (the fewest and most 200s any one client got; how many clients
    # got at least one).
    refusal_seconds: dict[str, float] | None
    ok_per_client: tuple[int, int]
    clients_answered: int
    share_with_all_options_in_top_tokens: float | None
    same_prompt_tokens: bool | None
    samples: list[dict[str, Any]] = field(repr=False)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize_level(clients: int, samples: Sequence[Sample]) -> Level:
    if not samples:
        raise ValueError("a level needs at least one sample")
    ok = [sample for sample in samples if sample.reply.status == 200]
    wall = max(s.started + s.seconds for s in samples) - min(s.started for s in samples)
    queue = [s.reply.queue_seconds for s in ok if s.reply.queue_seconds is not None]
    batch = [s.reply.batch_requests for s in ok if s.reply.batch_requests is not None]
    covers = [s.reply.covers_options for s in ok if s.reply.covers_options is not None]
    same = [s.reply.same_prompt for s in ok if s.reply.same_prompt is not None]
    refused = [s.seconds for s in samples if s.reply.status == 429]
    per_client = Counter({s.client: 0 for s in samples})
    per_client.update(s.client for s in ok)
    return Level(
        clients=clients,
        requests=len(samples),
        ok=len(ok),
        non_200=len(samples) - len(ok),
        non_200_statuses=dict(
            Counter(str(s.reply.status) for s in samples if s.reply.status != 200)
        ),
        first_error=next((s.reply.error for s in samples if s.reply.error), None),
        wall_seconds=wall,
        decisions_per_second=len(ok) / wall if wall > 0 else math.nan,
        latency_seconds=latency_summary([sample.seconds for sample in ok]),
        queue_seconds=latency_summary(queue) if queue else None,
        batch_requests_mean=statistics.fmean(batch) if batch else None,
        batch_requests_max=max(batch) if batch else None,
        ok_past_invocation_limit=sum(1 for s in ok if s.seconds > INVOCATION_LIMIT_S),
        refusal_seconds=latency_summary(refused) if refused else None,
        ok_per_client=(min(per_client.values()), max(per_client.values())),
        clients_answered=sum(1 for count in per_client.values() if count > 0),
        share_with_all_options_in_top_tokens=sum(covers) / len(covers) if covers else None,
        same_prompt_tokens=all(same) if same else None,
        samples=[
            {
                "seconds": s.seconds,
                "status": s.reply.status,
                "queue_seconds": s.reply.queue_seconds,
                "client": s.client,
            }
            for s in samples
        ],
    )


# -- overload as an application sees it ---------------------------------------------------


class _CountingTransport:
    """The project's HTTP transport, counting the attempts of the call in progress (the
    client retries inside one `invoke`; this says how many tries a call took)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.attempts = 0

    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> Any:
        self.attempts += 1
        return self.inner.post(body, retry_token, content_type)

    def wait_until_ready(
        self, timeout_s: float, progress: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        return self.inner.wait_until_ready(timeout_s, progress)

    def describe(self) -> str:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()


class ProjectClient:
    """One application thread's `DecisionClient` on a counting transport: by default
    `HttpTransport(base_url)`'s and the client's own retry policy, as an application has."""

    def __init__(self, inner: Transport, *, retry: RetryPolicy | None = None) -> None:
        self.counter = _CountingTransport(inner)
        self.client = DecisionClient(self.counter, retry=retry)

    def __enter__(self) -> ProjectClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()


def send_with_client(caller: ProjectClient, decision: Decision) -> Reply:
    """One call of the project's client: busy answers retried as its policy says (waiting
    each Retry-After), so a non-200 here is a final failure the application sees."""
    caller.counter.attempts = 0
    try:
        answer = caller.client.invoke(single_body(decision))
    except EndpointError as error:  # an UnreachableError too: status 0, no HTTP answer
        return Reply(error.status, error=error.message[:300], attempts=caller.counter.attempts)
    timing = (answer.get("timing") or {}) if isinstance(answer, dict) else {}
    return Reply(
        200, queue_seconds=_number(timing.get("queue_seconds")), attempts=caller.counter.attempts
    )


@dataclass(frozen=True)
class ClientLevel:
    """Figure 6d: closed-loop clients that are each the project's client. `level` counts
    calls (a call's time includes its retries); a non-200 is a call that finally failed."""

    level: Level
    final_failure_statuses: dict[str, int]
    final_failure_seconds: dict[str, float] | None  # time from a call's start to its failure
    attempts: dict[str, float]  # per call: p50/p95/p99/max
    retried_calls: int  # calls that needed more than one attempt

    @property
    def failure_fraction(self) -> float:
        return self.level.non_200 / self.level.requests

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "failure_fraction": self.failure_fraction}


def summarize_client_level(clients: int, samples: Sequence[Sample]) -> ClientLevel:
    failed = [s for s in samples if s.reply.status != 200]
    attempts = [float(s.reply.attempts or 1) for s in samples]
    return ClientLevel(
        level=summarize_level(clients, samples),
        final_failure_statuses=dict(Counter(str(s.reply.status) for s in failed)),
        final_failure_seconds=latency_summary([s.seconds for s in failed]) if failed else None,
        attempts=latency_summary(attempts),
        retried_calls=sum(1 for count in attempts if count > 1),
    )


@dataclass(frozen=True)
class Probe:
    """One request of the head-of-line check: its answer's status and the server's timing."""

    status: int
    sent: float  # time.perf_counter() at send
    seconds: float  # client wall time
    queue_seconds: float | None = None
    scoring_seconds: float | None = None
    passes: int | None = None
    input_tokens: int | None = None
    error: str | None = None
    attempts: int = 1  # the small decision is sent by the project's client, which retries


def read_probe(status: int, sent: float, seconds: float, answer: Any) -> Probe:
    """A probe from an /invocations answer; a non-200 keeps its error text, and a missing
    timing field is None (an older server still reports)."""
    if status != 200 or not isinstance(answer, dict):
        return Probe(status, sent, seconds, error=str(answer)[:300])
    timing = answer.get("timing") or {}
    passes = _number(timing.get("passes"))
    tokens = _number(timing.get("input_tokens"))
    if tokens is None:  # a single decision's answer has its tokens in its result
        tokens = _number((answer.get("result") or {}).get("input_tokens"))
    return Probe(
        status,
        sent,
        seconds,
        queue_seconds=_number(timing.get("queue_seconds")),
        scoring_seconds=_number(timing.get("scoring_seconds")),
        passes=None if passes is None else int(passes),
        input_tokens=None if tokens is None else int(tokens),
    )


@dataclass(frozen=True)
class HeadOfLine:
    """Figure 6e: a small decision sent while a long shared-state request is being scored
    over several passes. With round robin it waits at most the pass in flight."""

    decisions: int  # questions in the long request
    long: Probe
    small: Probe
    planned: int = 0  # questions planned; fewer were sent when the server's budget said so

    @property
    def delay_seconds(self) -> float:
        return self.small.sent - self.long.sent

    @property
    def pass_seconds(self) -> float | None:
        """One pass, from the long request's own timing (its scoring over its passes)."""
        long = self.long
        if long.status != 200 or not long.passes or long.scoring_seconds is None:
            return None
        return long.scoring_seconds / long.passes

    def problem(self) -> str | None:
        """Why the figure cannot be read from this run; None when it can."""
        if self.long.status != 200:
            return f"the long request got {self.long.status}: {self.long.error}"
        if self.pass_seconds is None or (self.small.status == 200) != (
            self.small.queue_seconds is not None
        ):
            return "the answers carry no timing.passes, scoring_seconds or queue_seconds"
        if (self.long.passes or 0) < 2:
            return "the long request took one pass: nothing to wait behind"
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "delay_seconds": self.delay_seconds,
            "pass_seconds": self.pass_seconds,
            "problem": self.problem(),
        }


_OVER_BUDGET = re.compile(r"needs about ([0-9.]+) s of scoring.*? may take ([0-9.]+) s")
RESIZES = 4  # the long request is resized at most this many times
FIT_MARGIN = 0.5  # a resized request aims at this share of the budget: the speed drifts, and
# the server estimates it from recent passes, which may be shorter (cheaper per row)


def fitted_count(count: int, error: str) -> int | None:
    """How many of `count` questions fit, from a 400 that says the request needs more time
    than a request may take at the server's measured speed; None for any other answer or
    when fewer than 2 would fit."""
    match = _OVER_BUDGET.search(error)
    if match is None:
        return None
    needed, allowed = float(match[1]), float(match[2])
    fitted = math.floor(count * FIT_MARGIN * allowed / needed) if needed > 0 else count
    return fitted if 2 <= fitted < count else None


def _post_probe(
    base_url: str,
    body: dict[str, Any],
    transport: httpx.BaseTransport | None,
    on_send: Callable[[float], object] = lambda sent: None,
) -> Probe:
    with httpx.Client(base_url=base_url, timeout=CLIENT_TIMEOUT_S, transport=transport) as http:
        sent = time.perf_counter()
        on_send(sent)
        response = http.post("/invocations", json=body)
        seconds = time.perf_counter() - sent
    answer: Any = response.json() if response.status_code == 200 else response.text
    return read_probe(response.status_code, sent, seconds, answer)


def client_probe(caller: ProjectClient, body: dict[str, Any]) -> Probe:
    """One call of the project's client as a probe: a refusal is retried as the client does
    (its Retry-After waited), so the time is what the application waits."""
    caller.counter.attempts = 0
    sent = time.perf_counter()
    try:
        answer = caller.client.invoke(body)
    except EndpointError as error:
        return Probe(
            error.status,
            sent,
            time.perf_counter() - sent,
            error=error.message[:300],
            attempts=caller.counter.attempts,
        )
    probe = read_probe(200, sent, time.perf_counter() - sent, answer)
    return replace(probe, attempts=caller.counter.attempts)


def head_of_line(
    base_url: str,
    long: Sequence[Decision],
    small: Decision,
    delay_s: float,
    *,
    transport: httpx.BaseTransport | None = None,
    small_client: Callable[[], ProjectClient] | None = None,
) -> HeadOfLine:
    """Send the long shared-state request and, `delay_s` later (while its first pass runs),
    the small decision through the project's client; both answers' timings. The long one
    is within budget: when the server answers that it would take longer than a request may
    (a 400: at once, at its measured speed, or after the long one's first pass, at that
    pass's speed), it is sent again with as many questions as fit, and the small one after
    it again, up to RESIZES times."""
    count = len(long)
    connect = small_client or (lambda: ProjectClient(HttpTransport(base_url)))
    with ThreadPoolExecutor(max_workers=1) as pool, connect() as caller:
        resizes = 0
        while True:
            sends: SimpleQueue[float] = SimpleQueue()
            body = shared_body(long[:count])
            first = pool.submit(_post_probe, base_url, body, transport, sends.put)
            sent = sends.get(timeout=CLIENT_TIMEOUT_S)  # the delay counts from the send
            try:
                answered = first.result(timeout=max(0.0, sent + delay_s - time.perf_counter()))
            except TimeoutError:
                answered = None  # being scored
            fitted = None if answered is None else _resized(count, answered)
            if fitted is not None and resizes < RESIZES:
                count, resizes = fitted, resizes + 1
                continue
            time.sleep(max(0.0, sent + delay_s - time.perf_counter()))
            second = client_probe(caller, single_body(small))
            result = HeadOfLine(count, first.result(), second, planned=len(long))
            fitted = _resized(count, result.long)
            if fitted is None or resizes == RESIZES:
                return result
            count, resizes = fitted, resizes + 1


def _resized(count: int, answer: Probe) -> int | None:
    """Questions to send instead, when the long request's answer is the budget's 400."""
    return fitted_count(count, answer.error or "") if answer.status == 400 else None


def measure_overload(server: ServerProcess, plan: Plan, run: ConcurrencyRun) -> None:
    """Figures 6d and 6e on an idle, warmed-up server: the head-of-line check first (it
    needs an empty queue), then the project's client at `client_level`."""
    if plan.head_of_line_decisions:
        long, small = plan.head_of_line()
        run.head_of_line = head_of_line(server.base_url, long, small, plan.head_of_line_delay_s)
    if plan.client_level is not None:
        samples = run_clients(
            plan.client_decisions(),
            plan.client_level,
            lambda: ProjectClient(HttpTransport(server.base_url)),
            send_with_client,
        )
        run.client = summarize_client_level(plan.client_level, samples)


# -- the phase ----------------------------------------------------------------------------


@dataclass
class ConcurrencyRun:
    """Everything the concurrency phase measured; levels keyed by client count."""

    plan: Plan
    limit_seconds: list[float] = field(default_factory=list)
    limit_prompts: int = 0
    limit_calls: int = 0
    limit_timings: list[dict[str, Any]] = field(default_factory=list)  # the last repeat's
    prompt_tokens: list[int] = field(default_factory=list)
    ours: dict[str, dict[int, Level]] = field(default_factory=dict)
    serial: Level | None = None
    # The compare level once more, after the levels above it: goodput under overload is
    # read against both, so the machine's drift over the sweep lands on both sides.
    compare_again: Level | None = None
    peer: dict[int, Level] = field(default_factory=dict)
    peer_build: dict[str, object] | None = None
    peer_skipped: str | None = None
    client: ClientLevel | None = None  # figure 6d
    head_of_line: HeadOfLine | None = None  # figure 6e

    @property
    def compare_throughput(self) -> float:
        """Decisions/s at the compare level: the mean of its run and its repeat."""
        runs = [self.ours["distinct"][self.plan.compare_level], self.compare_again]
        return statistics.mean(lv.decisions_per_second for lv in runs if lv is not None)

    @property
    def limit_throughput(self) -> float:
        if not self.limit_seconds:  # --overload-only measures no limit
            return math.nan
        return self.limit_prompts / statistics.median(self.limit_seconds)

    def as_json(self) -> dict[str, Any]:
        return {
            "plan": asdict(self.plan),
            "limit": {
                "prompts": self.limit_prompts,
                "engine_calls": self.limit_calls,
                "seconds": self.limit_seconds,
                "decisions_per_second": self.limit_throughput,
                "engine_timings": self.limit_timings,
            },
            "prompt_tokens": self.prompt_tokens,
            "ours": {
                workload: [level.as_json() for level in levels.values()]
                for workload, levels in self.ours.items()
            },
            "serial": self.serial.as_json() if self.serial else None,
            "compare_again": self.compare_again.as_json() if self.compare_again else None,
            "peer": [level.as_json() for level in self.peer.values()],
            "peer_build": self.peer_build,
            "peer_skipped": self.peer_skipped,
            "client": self.client.as_json() if self.client else None,
            "head_of_line": self.head_of_line.as_json() if self.head_of_line else None,
        }


class BatchLimit(InProcessModel):
    """The in-process limit at the compare level, loaded for the whole sweep of our
    servers so that its repeats are taken right before and after the compare level
    (this machine's speed drifts 15-40 % within minutes). It also renders the warm-up's
    and every peer level's prompt tokens (the peer is sent our exact tokens, so both
    engines evaluate the same sequences).

    N closed-loop clients never have more than N requests waiting, so the limit scores the
    level's prompts N at a time, one engine call each, in order, on the server's engine
    settings: the best any server could do with those clients."""

    def __init__(self, settings: Settings, plan: Plan) -> None:
        super().__init__(settings)
        prompts = [self._prompt(d).tokens for d in plan.decisions("distinct", plan.compare_level)]
        # As many prompts a call as the level has clients, or as the engine's streams hold
        # (SEMIF_KV_MEMORY may give it fewer sequences a pass).
        width = min(plan.compare_level, self.engine.max_branches)
        self.calls = [prompts[i : i + width] for i in range(0, len(prompts), width)]
        self.peer = {
            n: [self._prompt(d) for d in plan.decisions("distinct", n)] for n in plan.peer_levels
        }
        self.warm_up = self._prompt(WARM_UP)
        self.engine.score([self.warm_up.tokens])  # untimed: first decodes allocate and page in

    def _prompt(self, decision: Decision) -> PeerPrompt:
        (_, tokens), *_ = self.service.render([decision], "single")
        labels = self.service.labels.token_ids(answer_labels(len(decision.options)))
        return PeerPrompt(tokens, frozenset(label[0] for label in labels))

    def measure(self, run: ConcurrencyRun, repeats: int) -> None:
        """`repeats` timed runs of every call, each from a cleared cache."""
        for _ in range(repeats):
            self.engine.reset()
            started = time.perf_counter()
            timings = [self.engine.score(call)[1] for call in self.calls]
            run.limit_seconds.append(time.perf_counter() - started)
            run.limit_timings = [asdict(timing) for timing in timings]
        run.limit_prompts = sum(len(call) for call in self.calls)
        run.limit_calls = len(self.calls)
        run.prompt_tokens = [len(tokens) for call in self.calls for tokens in call]


def _level(
    server: ServerProcess, plan: Plan, workload: str, clients: int, *, again: bool = False
) -> Level:
    decisions = plan.decisions(workload, clients, again=again)
    return summarize_level(clients, closed_loop(server.base_url, decisions, clients, send_decision))


def _warm_up(server: ServerProcess, send: Send[T], item: T) -> None:
    """One untimed request about a state no level uses: a new process's first decodes
    page weights in and allocate buffers, which no steady-state request pays."""
    closed_loop(server.base_url, [item], 1, send)


def measure_concurrency(
    gguf: Path,
    plan: Plan,
    *,
    log_dir: Path,
    threads: int,
    n_gpu_layers: int,
    peer: PeerBinary | None,
    peer_skipped: str | None = None,
    overload_only: bool = False,
) -> ConcurrencyRun:
    """Our server (batching on, every level, both workloads) with the in-process limit
    and our server with batching off taken next to its compare level, then on the same
    server the head-of-line check and the project's client (figures 6d and 6e), then
    llama-server at each peer level: one at a time (the idle ones only hold memory).
    `overload_only` runs figures 6d and 6e alone, on a fresh server."""
    run = ConcurrencyRun(plan=plan, peer_skipped=peer_skipped)
    settings = Settings(
        gguf_path=gguf,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        weight_buffers=weight_buffers_setting(),
    )
    options: dict[str, Any] = {"log_dir": log_dir, "threads": threads, "n_gpu_layers": n_gpu_layers}
    if overload_only:
        with serve_model(gguf, **options) as server:
            _warm_up(server, send_decision, WARM_UP)
            measure_overload(server, plan, run)
        return run
    with (
        BatchLimit(settings, plan) as limit,
        serve_model(gguf, **options) as server,
        serve_model(gguf, max_batch_requests=1, **options) as serial,
    ):
        _warm_up(server, send_decision, WARM_UP)
        _warm_up(serial, send_decision, WARM_UP)
        for workload in WORKLOADS:
            run.ours[workload] = {}
            for clients in plan.levels:
                compare = workload == "distinct" and clients == plan.compare_level
                if compare:
                    limit.measure(run, (plan.limit_repeats + 1) // 2)
                run.ours[workload][clients] = _level(server, plan, workload, clients)
                if compare:
                    run.serial = _level(serial, plan, workload, clients)
                    limit.measure(run, plan.limit_repeats // 2)
            if workload == "distinct":
                run.compare_again = _level(server, plan, workload, plan.compare_level, again=True)
        measure_overload(server, plan, run)
        peer_warm_up, peer_prompts = limit.warm_up, limit.peer
    if peer is not None:
        run.peer_build = peer.info
        for clients, prompts in peer_prompts.items():
            longest = max(len(prompt.tokens) for prompt in prompts)
            slot = 256 * math.ceil((longest + 2) / 256)  # the prompt and the one token out
            with serve_llama_server(
                peer.path, gguf, parallel=clients, slot_context=slot, **options
            ) as server:
                _warm_up(server, send_completion, peer_warm_up)
                run.peer[clients] = summarize_level(
                    clients, closed_loop(server.base_url, prompts, clients, send_completion)
                )
    return run


# -- output -------------------------------------------------------------------------------


def format_levels(run: ConcurrencyRun) -> str:
    """One line per server, workload and level: throughput, latency, errors, queueing,
    answers that came after SageMaker's 60 s invocation limit (errors behind SageMaker), the
    p95 wait for a 429 and the fewest and most answers one client got."""
    header = (
        f"{'server':<22}{'clients':>8}{'requests':>9}{'non-200':>8}{'dec/s':>8}"
        f"{'p50 s':>8}{'p95 s':>8}{'queue p50':>10}{'queue p95':>10}{'batch':>7}{'>60 s':>7}"
        f"{'429 p95':>8}{'ok/client':>10}"
    )
    rows: list[tuple[str, Level]] = [
        (f"ours, {workload}", level)
        for workload, levels in run.ours.items()
        for level in levels.values()
    ]
    if run.compare_again:
        rows.append(("ours, distinct, again", run.compare_again))
    if run.serial:
        rows.append(("ours, batching off", run.serial))
    rows += [("llama-server", level) for level in run.peer.values()]
    lines = [header, "-" * len(header)]
    for name, level in rows:
        queue = level.queue_seconds or {}
        batch = level.batch_requests_mean
        lines.append(
            f"{name:<22}{level.clients:>8}{level.requests:>9}{level.non_200:>8}"
            f"{level.decisions_per_second:>8.2f}{level.latency_seconds['p50']:>8.2f}"
            f"{level.latency_seconds['p95']:>8.2f}{queue.get('p50', math.nan):>10.2f}"
            f"{queue.get('p95', math.nan):>10.2f}"
            + (f"{batch:>7.1f}" if batch is not None else f"{'-':>7}")
            + f"{level.ok_past_invocation_limit:>7}"
            + f"{(level.refusal_seconds or {}).get('p95', math.nan):>8.2f}"
            + f"{'{}-{}'.format(*level.ok_per_client):>10}"
        )
    return "\n".join(lines + overload_lines(run))


def overload_lines(run: ConcurrencyRun) -> list[str]:
    """Figures 6d and 6e in words: the project's client's final failures and how long they
    took; the small decision's wait behind the long request, in passes."""
    lines = []
    if run.client is not None:
        level, client = run.client.level, run.client
        failed = client.final_failure_seconds or {}
        lines.append(
            f"project client, {level.clients} clients: {level.non_200} of {level.requests} "
            f"calls failed after retries ({100 * client.failure_fraction:.1f} %), time to a "
            f"final failure p50 {failed.get('p50', math.nan):.1f} s, max "
            f"{failed.get('max', math.nan):.1f} s; answered calls p50 "
            f"{level.latency_seconds['p50']:.1f} s, p95 {level.latency_seconds['p95']:.1f} s; "
            f"attempts per call p50 {client.attempts['p50']:.0f}, max "
            f"{client.attempts['max']:.0f}; {level.decisions_per_second:.2f} decisions/s"
        )
    if run.head_of_line is not None:
        check = run.head_of_line
        problem = check.problem()
        if problem is not None:
            lines.append(f"head of line: not measured ({problem})")
        else:
            one = check.pass_seconds or math.nan
            queue = check.small.queue_seconds or 0.0
            small_failed = check.small.status != 200
            lines.append(
                f"head of line: {check.decisions} questions in {check.long.passes} passes of "
                f"{one:.2f} s ({check.long.input_tokens} prompt tokens, {check.long.seconds:.1f} "
                f"s); a {check.small.input_tokens}-token decision sent "
                f"{check.delay_seconds:.2f} s later ({check.small.attempts} attempts by the "
                + (
                    f"project's client) finally failed after {check.small.seconds:.2f} s "
                    f"({check.small.seconds / one:.2f} passes): {check.small.error}"
                    if small_failed
                    else f"project's client) queued {queue:.2f} s "
                    f"({queue / one:.2f} passes) and took {check.small.seconds:.2f} s "
                    f"({check.small.seconds / one:.2f} passes)"
                )
            )
    return lines


def write_plot(run: ConcurrencyRun, path: Path) -> Path:
    """Throughput and p95 latency against client count (log scale), every server on both."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    from matplotlib import pyplot

    figure, (throughput, tail) = pyplot.subplots(1, 2, figsize=(11, 4.5))
    series: dict[str, dict[int, Level]] = {f"ours, {w}": levels for w, levels in run.ours.items()}
    if run.serial:
        series["ours, batching off"] = {run.serial.clients: run.serial}
    if run.peer:
        series["llama-server"] = run.peer
    for label, levels in series.items():
        clients = list(levels)
        throughput.plot(
            clients, [lv.decisions_per_second for lv in levels.values()], "o-", label=label
        )
        tail.plot(clients, [lv.latency_seconds["p95"] for lv in levels.values()], "o-", label=label)
    limit = f"limit: engine calls of {run.plan.compare_level} prompts"
    throughput.axhline(run.limit_throughput, linestyle="--", color="grey", label=limit)
    throughput.set_ylabel("decisions/s")
    tail.set_ylabel("p95 latency (s)")
    for axes in (throughput, tail):
        axes.set_xscale("log", base=2)
        axes.set_xticks(list(run.plan.levels), [str(n) for n in run.plan.levels])
        axes.set_xlabel("concurrent clients (closed loop)")
        axes.legend(fontsize="small")
    figure.suptitle("single decisions on ~150-token states")
    return save_figure(figure, path)
