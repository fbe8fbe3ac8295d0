"""Closed-loop concurrency: throughput and latency with N clients, against the engine's limit,
the same server with batching off, and llama.cpp's own server.

Each of N clients holds one connection and sends its next request as soon as the previous
answer returns (a closed loop: the offered load follows the server's speed, as it does for
an application with N workers). Every level sends a fixed list of decisions, each about its
own ~150-token account state, so a server's prefix cache only ever helps with the template
prefix every prompt shares; the mix sends every 4th decision about one hot account instead.
Throughput is successful answers over the wall time from the first send to the last answer.
A non-200 answer is counted, not retried; a client refused with Retry-After waits that long
before its next request, as the project's client does (a refused client that sent again at
once would spin on the cores the server shares with it here).

The limit scores the same prompts in-process on the server's own engine settings, as many
per engine call as there are clients (no more can be waiting). It and the server with
batching off stay loaded through our server's sweep and are measured right next to its
compare level, one thing at a time, so the machine's drift lands on every side of figures
6b and 6c.
"""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

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
from bench.tasks import single_body
from bench.workload import concurrent_decisions

T = TypeVar("T")
STATE_EVENTS = 4  # ~150 SmolLM2 tokens of account history; prompts are ~250 tokens
SHARED_EVERY = 4  # in the mix, 1 request in 4 is about the hot account
PEER_TOP_TOKENS = 20
CLIENT_TIMEOUT_S = 600.0
WORKLOADS = ("distinct", "mix")
INVOCATION_LIMIT_S = 60.0  # SageMaker's InvokeEndpoint: a later answer never reaches the caller
MAX_RETRY_AFTER_S = 30.0  # the longest Retry-After the adapter sends


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

    def __post_init__(self) -> None:
        if self.compare_level not in self.levels or not set(self.peer_levels) <= set(self.levels):
            raise ValueError("the compare and peer levels must be among the levels")
        if self.limit_repeats < 1:
            raise ValueError("the limit needs at least one timed call")

    def requests(self, clients: int) -> int:
        return max(self.min_requests, self.requests_per_client * clients)

    def decisions(self, workload: str, clients: int) -> list[Decision]:
        """The same decisions for every server at one level; each (workload, level) gets its
        own series of states, so no level finds a state an earlier one left in a cache."""
        series = 1 + 2 * self.levels.index(clients) + WORKLOADS.index(workload)
        shared_every = SHARED_EVERY if workload == "mix" else None
        return concurrent_decisions(
            self.requests(clients), series=series, events=STATE_EVENTS, shared_every=shared_every
        )


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
    pending = iter(range(len(items)))
    lock = threading.Lock()
    samples: list[Sample | None] = [None] * len(items)

    def client(number: int) -> None:
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        with httpx.Client(
            base_url=base_url, timeout=timeout_s, limits=limits, transport=transport
        ) as http:
            while True:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                started = time.perf_counter()
                try:
                    reply = send(http, items[index])
                except httpx.HTTPError as error:
                    reply = Reply(0, error=f"{type(error).__name__}: {error}")
                samples[index] = Sample(started, time.perf_counter() - started, reply, number)
                if reply.retry_after is not None:
                    # As the project's client does: a refused client waits as told before
                    # it sends again, instead of spinning on the server's (shared) cores.
                    time.sleep(min(reply.retry_after, MAX_RETRY_AFTER_S))

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


def send_decision(http: httpx.Client, decision: Decision) -> Reply:
    """One decision to our /invocations; the batch facts come from its `timing`."""
    response = http.post("/invocations", json=single_body(decision))
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
    # Overload: how long a refused request (503) waited for its answer, and how evenly the
    # answers were shared (the fewest and most 200s any one client got).
    refusal_seconds: dict[str, float] | None
    ok_per_client: tuple[int, int]
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
    refused = [s.seconds for s in samples if s.reply.status == 503]
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
        share_with_all_options_in_top_tokens=sum(covers) / len(covers) if covers else None,
        same_prompt_tokens=all(same) if same else None,
        samples=[
            {"seconds": s.seconds, "status": s.reply.status, "queue_seconds": s.reply.queue_seconds}
            for s in samples
        ],
    )


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
    peer: dict[int, Level] = field(default_factory=dict)
    peer_build: dict[str, object] | None = None
    peer_skipped: str | None = None

    @property
    def limit_throughput(self) -> float:
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
            "peer": [level.as_json() for level in self.peer.values()],
            "peer_build": self.peer_build,
            "peer_skipped": self.peer_skipped,
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
        self.calls = [
            prompts[i : i + plan.compare_level] for i in range(0, len(prompts), plan.compare_level)
        ]
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


def _level(server: ServerProcess, plan: Plan, workload: str, clients: int) -> Level:
    return summarize_level(
        clients,
        closed_loop(server.base_url, plan.decisions(workload, clients), clients, send_decision),
    )


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
) -> ConcurrencyRun:
    """Our server (batching on, every level, both workloads) with the in-process limit
    and our server with batching off taken next to its compare level, then llama-server
    at each peer level: one at a time (the idle ones only hold memory)."""
    run = ConcurrencyRun(plan=plan, peer_skipped=peer_skipped)
    settings = Settings(
        gguf_path=gguf,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        weight_buffers=weight_buffers_setting(),
    )
    options: dict[str, Any] = {"log_dir": log_dir, "threads": threads, "n_gpu_layers": n_gpu_layers}
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
    p95 wait for a 503 and the fewest and most answers one client got."""
    header = (
        f"{'server':<22}{'clients':>8}{'requests':>9}{'non-200':>8}{'dec/s':>8}"
        f"{'p50 s':>8}{'p95 s':>8}{'queue p50':>10}{'queue p95':>10}{'batch':>7}{'>60 s':>7}"
        f"{'503 p95':>8}{'ok/client':>10}"
    )
    rows: list[tuple[str, Level]] = [
        (f"ours, {workload}", level)
        for workload, levels in run.ours.items()
        for level in levels.values()
    ]
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
    return "\n".join(lines)


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
