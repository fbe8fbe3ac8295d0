"""The performance report's figures at GPU sizes, measured with the report's own code.

`semif-bench-report` sizes its workload for a 135M model on two CPU cores (~130-token
decisions, a ~1,000-token state). On a GPU those finish in a few milliseconds and the
figures would measure Python, so issue 14 asks for decisions of ~300 tokens and 16
decisions over a ~2,000-token state. The sizes are found by tokenizing with the model
under test; the rounds themselves are `bench.report.run_round` (limit in-process, `serve`
without and with prefix reuse), so the figures mean exactly what docs/benchmarks.md says.
The goals for figures 1 and 2a are the GPU goals of issue 14.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from adapter.schema import Decision
from adapter.service import DecisionService
from bench.report import Figure, Goal, Samples, build_figures, run_round
from bench.workload import MAX_SHARED, Workload, account_state, build_workload, shared_decisions

SINGLE_TOKENS = 300
STATE_TOKENS = 2000
SINGLES = 12
SHARED = MAX_SHARED  # 16
ROUNDS = 3
REPEATS = 3
GPU_GOALS = {"adapter_overhead": Goal("<=", 1.25), "shared_state_speedup": Goal(">=", 5.0)}
_MAX_EVENTS = 500
_SINGLE_VARIANT = 100  # state variants of single decisions: apart from the follow-ups' ones


@dataclass(frozen=True)
class Sizes:
    """Account-history lengths that give the target prompt sizes, and the sizes they give."""

    single_events: int
    state_events: int
    single_prompt_tokens: list[int]
    shared_prompt_tokens: list[int]


def single_decisions(events: int) -> list[Decision]:
    """Different questions, each about its own state variant (nothing shared between them)."""
    return [
        shared_decisions(account_state(events, _SINGLE_VARIANT + index), SINGLES)[index]
        for index in range(SINGLES)
    ]


def _prompt_tokens(service: DecisionService, decisions: list[Decision]) -> list[int]:
    # "shared" only names each decision in errors; every prompt renders as a single one
    return [len(tokens) for _, tokens in service.render(decisions, "shared")]


def events_for(service: DecisionService, tokens: int) -> int:
    """The fewest history events whose first question's prompt has at least `tokens`."""
    for events in range(_MAX_EVENTS):
        if _prompt_tokens(service, shared_decisions(account_state(events), 1))[0] >= tokens:
            return events
    raise ValueError(f"no state of up to {_MAX_EVENTS} events reaches {tokens} tokens")


def size_workload(service: DecisionService) -> Sizes:
    single_events = events_for(service, SINGLE_TOKENS)
    state_events = events_for(service, STATE_TOKENS)
    return Sizes(
        single_events=single_events,
        state_events=state_events,
        single_prompt_tokens=_prompt_tokens(service, single_decisions(single_events)),
        shared_prompt_tokens=_prompt_tokens(
            service, shared_decisions(account_state(state_events), SHARED)
        ),
    )


def round_workload(sizes: Sizes, round_index: int) -> Workload:
    """The report's workload (shared request, follow-ups) at these sizes, GPU-sized singles."""
    workload = build_workload(1, SHARED, sizes.state_events, REPEATS, round_index)
    return replace(workload, singles=single_decisions(sizes.single_events))


def measure(
    gguf: Path, sizes: Sizes, *, threads: int, n_gpu_layers: int, log_dir: Path, rounds: int
) -> tuple[list[Figure], Samples]:
    """Every round of the report (no peer server: it needs packages the GPU machine lacks)."""
    options = argparse.Namespace(
        threads=threads, n_gpu_layers=n_gpu_layers, out=log_dir, no_peer=True
    )
    samples = Samples()
    for index in range(rounds):
        print(f"figures: round {index + 1}/{rounds}", flush=True)
        run_round(gguf, options, round_workload(sizes, index), samples)
    figures = [
        replace(figure, goal=GPU_GOALS.get(figure.key, figure.goal))
        for figure in build_figures(samples, gguf.stat().st_size)
    ]
    return figures, samples
