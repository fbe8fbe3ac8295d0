"""What a likelihood question's branches cost: the request thread, before and after
tokenizing only the prompt's tail per option, and the rows the option tree decodes (issue
38, "Branches decoded once").

The likelihood readout tokenizes each option as the model reads it after the prompt
(adapter/option_branches.py). Before, each option's text was tokenized after the whole
rendered prompt again: on a long state, a millisecond or two per option, on the request
thread. After, only the prompt's tail from its last special token (Vocabulary.prompt_cut)
is, and the whole prompt only where no cut is certain: `before` is that fallback, taken for
every prompt. For each option count and normalization this builds the same question both
ways on the server's tokenizer (DecisionService.tokenize_prompt, the same locks and limit),
prints the median seconds of `OptionBranches.work` for each, whether the two works are
identical (they must be), and the after time against the limit. Then, on a short state
(the state counts in the reference, so a short one is the strict case) and an empty cache,
it scores each option count by likelihood and sets the rows decoded against the nodes of
the options' prefix tree plus the state (adapter.option_tree: each node decoded once; the
limit is TREE_LIMIT):

    python -m bench.branch_tokens [--gguf PATH] [--state-tokens N] [--repeats N]

bench/report.py publishes both as figure 9.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from adapter.backends import cpu_backend
from adapter.core.engine import LlamaEngine
from adapter.core.layout import distinct_tokens
from adapter.likelihood import ReadoutChoice
from adapter.option_branches import Cut, OptionBranches
from adapter.question_work import LikelihoodWork
from adapter.runtime import prepare_model
from adapter.schema import Decision, Option
from adapter.service import DecisionService
from adapter.settings import QueueLimits
from bench.runner import DEFAULT_MODEL_CACHE
from model_build.calibration import Normalization
from model_build.embedded import fetch_embedded_model

LIMIT_SECONDS = 0.2  # the request-thread time 1,024 options may take (issue 38)
BRANCH_STATE_TOKENS = 2000  # the long state the request thread's time is measured on
TREE_LIMIT = 1.1  # rows a question may decode per node of its option tree and state
TREE_STATE_TOKENS = 100  # the short state the tree's rows are measured on
TREE_BRANCHES = 32  # KV streams for the rows measurement, as a served CPU model has
COUNTS = (32, 255, 1024)  # System One's cap; the likelihood readout's cap
# pmi tokenizes every option after a second prompt too, the neutral one.
NORMALIZATIONS: tuple[Normalization, ...] = ("mean", "pmi")
QUESTION = "What should support do next?"
_SENTENCE = (
    "The customer writes that order 17 arrived late, that the invoice lists the shipping "
    "twice, and that the support line promised a refund last week which never came. "
)
# Short answers sharing their leading words, as an application's routing options do.
_TOPICS = ("billing", "shipping", "account", "technical support", "returns", "warranty")
_ACTIONS = ("refund", "replacement", "callback", "escalation", "credit note", "repair")


@dataclass(frozen=True)
class Row:
    """One question built both ways: median seconds each, and whether the works agree."""

    normalization: Normalization
    options: int
    prompt_tokens: int
    before: float
    after: float
    identical: bool


def options(count: int) -> tuple[Option, ...]:
    """`count` distinct short options, e.g. "billing: refund for order 17"."""
    phrases = itertools.product(range(1, count + 1), _TOPICS, _ACTIONS)
    return tuple(
        Option(f"o{index}", f"{topic}: {action} for order {order}")
        for index, (order, topic, action) in enumerate(itertools.islice(phrases, count))
    )


@dataclass(frozen=True)
class TreeRow:
    """One question scored on an empty cache: the rows decoded, and the nodes of its
    options' prefix tree plus the state (every token of prompt + option, shared ones once)."""

    options: int
    rows: int
    nodes: int
    passes: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.rows / self.nodes


def open_service(gguf: Path, state_tokens: int, threads: int, branches: int = 4) -> DecisionService:
    """The model as the server makes it servable, with room for the long state and no
    request limit in the way (a benchmark's question may be as large as it asks)."""
    engine = LlamaEngine(
        gguf,
        stream_cells=state_tokens + 512,
        max_branches=branches,
        threads=threads,
        n_gpu_layers=0,
        weight_buffers="auto",
        cpu=cpu_backend(None),
    )
    loaded = prepare_model(engine)
    return DecisionService(
        engine=engine,
        template=loaded.template,
        labels=loaded.labels,
        max_tokens=state_tokens + 512,
        model={},
        limits=QueueLimits(request_timeout_seconds=3600, max_request_tokens=10**8),
    )


def branches(service: DecisionService, cut: Cut) -> OptionBranches:
    """The service's likelihood work as the service builds it, cutting prompts with `cut`."""
    vocab = service.engine.vocab
    return OptionBranches(
        template=lambda: service.template,
        listing=lambda: service.listing,
        tokenize=service.tokenize_prompt,
        cut=cut,
        boundaries=lambda prompt, tokens: (),  # checkpoints: whole-stream memory only
        end_of_turn=lambda: vocab.end_of_turn,
        max_tokens=service.max_tokens,
        whole_streams=service.engine.recurrent,
    )


def _whole_prompt(text: str, user_spans: Sequence[tuple[int, int]]) -> None:
    """No cut: every option tokenized after the whole prompt (before this change)."""
    return None


def _timed(
    builder: OptionBranches, decision: Decision, choice: ReadoutChoice, repeats: int
) -> tuple[LikelihoodWork, float]:
    """The work `builder` makes for `decision`, and its median seconds over `repeats`."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work = builder.work(decision, "decision", choice)
        seconds.append(time.perf_counter() - started)
    return work, statistics.median(seconds)


def measure(
    service: DecisionService,
    state_tokens: int,
    counts: Sequence[int] = COUNTS,
    repeats: int = 3,
) -> list[Row]:
    """For each normalization and option count: median seconds of `OptionBranches.work`
    over `repeats`, before (whole prompt per option) and after (its tail), and whether the
    two works are identical."""
    vocab = service.engine.vocab
    state = _SENTENCE * -(-state_tokens // len(vocab.tokenize(_SENTENCE)))
    whole, tail = branches(service, _whole_prompt), branches(service, vocab.prompt_cut)
    rows = []
    for normalization, count in itertools.product(NORMALIZATIONS, counts):
        decision = Decision("bench", state, QUESTION, options(count))
        choice = ReadoutChoice("likelihood", normalization)
        old, before = _timed(whole, decision, choice, repeats)
        new, after = _timed(tail, decision, choice, repeats)
        prompt_tokens = len(old.entries[0].tokens)  # the option tree's root
        rows.append(Row(normalization, count, prompt_tokens, before, after, old == new))
    return rows


def measure_tree(service: DecisionService, counts: Sequence[int] = COUNTS) -> list[TreeRow]:
    """For each option count, a question on a state of `TREE_STATE_TOKENS` scored by
    likelihood (`sum`) on an empty cache: the rows decoded against its tree's nodes."""
    vocab = service.engine.vocab
    state = _SENTENCE * -(-TREE_STATE_TOKENS // len(vocab.tokenize(_SENTENCE)))
    builder = branches(service, vocab.prompt_cut)
    choice = ReadoutChoice("likelihood", "sum")
    rows = []
    for count in counts:
        decision = Decision("bench", state, QUESTION, options(count))
        work = builder.work(decision, "decision", choice)
        prompt = work.entries[0].tokens
        service.engine.reset()
        started = time.perf_counter()
        batch = service.score([decision], ["decision"], readouts=[choice])
        rows.append(
            TreeRow(
                count,
                batch.timing.evaluated_tokens,
                distinct_tokens([[*prompt, *option] for option in work.options]),
                batch.timing.passes,
                time.perf_counter() - started,
            )
        )
    return rows


def verdict(seconds: float) -> str:
    """The after time against the limit, e.g. "limit 0.2 s: 0.05 s, ratio 0.25, PASS"."""
    ratio = seconds / LIMIT_SECONDS
    return f"limit {LIMIT_SECONDS} s: {seconds:.3f} s, ratio {ratio:.3f}, " + (
        "PASS" if ratio < 1 else "FAIL"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF to measure (default: the embedded model)")
    parser.add_argument("--state-tokens", type=int, default=BRANCH_STATE_TOKENS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
    service = open_service(gguf, args.state_tokens, args.threads)
    try:
        rows = measure(service, args.state_tokens, repeats=args.repeats)
    finally:
        service.close(5)
    service = open_service(gguf, TREE_STATE_TOKENS, args.threads, TREE_BRANCHES)
    try:
        trees = measure_tree(service)
    finally:
        service.close(5)
    print(f"{gguf.name}: OptionBranches.work on the request thread, median of {args.repeats}")
    print("normalization | options | prompt_tokens | before_s | after_s | identical | after")
    for row in rows:
        print(
            f"{row.normalization} | {row.options} | {row.prompt_tokens} | {row.before:.3f} | "
            f"{row.after:.3f} | {row.identical} | {verdict(row.after)}"
        )
    print(f"option trees on a {TREE_STATE_TOKENS}-token state, an empty cache, sum")
    print("options | rows | tree nodes + state | passes | seconds | rows per node")
    for tree in trees:
        passed = "PASS" if tree.ratio <= TREE_LIMIT else "FAIL"
        print(
            f"{tree.options} | {tree.rows} | {tree.nodes} | {tree.passes} | "
            f"{tree.seconds:.1f} | limit {TREE_LIMIT}: {tree.ratio:.3f}, {passed}"
        )


if __name__ == "__main__":
    main()
