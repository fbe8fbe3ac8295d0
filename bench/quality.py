"""Decision quality, measured: order invariance per option-order mode, what the position prior
recovers, and what debiased costs.

`run_quality(client, tasks)` (the `semif-bench-quality` command, or any caller holding an
Invoker for a running server, e.g. bench/report.py's local server) measures three things:
- invariance: every task sent in its original order, reversed and shuffled (seeded), in each
  mode; argmax flips and mean total-variation distance against the original order, and
  accuracy and Brier pooled over the three orderings. With exact scoring (the server's
  default, docs/adapter.md) equal prompts give bit-identical numbers whatever the cache
  held, so canonical and debiased must show exactly zero;
- prior: semif-calibrate's held-out comparison (bench.calibrate): canonical with the
  cross-fitted position prior divided out against canonical and debiased;
- prediction sets: semif-calibrate --conformal's coverage and mean set size per coverage
  asked, for the letters (canonical), each likelihood normalization (bench.conformal_fit)
  and the choice tasks read as multi-label questions (bench.multi_label_fit);
- cost: as_given against debiased for 3, 5 and 8 options on states of about 150 and 1,000
  tokens, each state new to the server so its prefill is counted: evaluated tokens and the
  client's seconds per request (serial, so no queueing), medians over repeats;
- the likelihood readout (adapter.likelihood): the same invariance figures (and NLL) for
  sum, mean and pmi beside the letters' canonical and debiased, and its cost against the
  letters (canonical and debiased) for 3, 5, 8 and 32 options of 1 to 12 words on a
  ~150-token state (32 options exceed the letters' 16 in the decision API: not measured),
  and scored by a one-word label instead of the words;
- what the likelihood readout should score (ANSWER_TEXTS): each option's description, its
  id as its label, or its id as words (`account_access` -> `account access`), and whether
  the prompt lists the options: the same figures on a second server whose
  SEMIF_LIKELIHOOD_PROMPT is `listed` (the default is `unlisted`; `--local` starts it,
  `--listed-url` names one).
The command also measures coherence on the same server (bench.coherence): the share of
cases whose answers keep each metamorphic relation (permutation, batch, choice set, clones,
complement, conjunction, disjunction, paraphrase), per reading and question kind;
`--only coherence` measures it alone.
Plumbing numbers, not accuracy claims: the smoke tasks are few and easy to overfit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from adapter.prompts import LIKELIHOOD_PROMPT_VERSIONS
from adapter.schema import Decision, Option
from bench.calibrate import DEFAULT_FOLDS, calibrate, score_all
from bench.coherence import COHERENCE_CASES, format_coherence, load_cases, run_coherence
from bench.conformal_fit import format_coverage
from bench.local import serve_model
from bench.metrics import Answer, accuracy, brier_score, log_loss
from bench.runner import (
    DEFAULT_MODEL_CACHE,
    LIKELIHOOD_READINGS,
    Invoker,
    finite,
    open_client,
    read_answer,
)
from bench.tasks import SMOKE_TASKS, Task, load_tasks, single_body
from model_build.calibration import OPTION_ORDERS
from model_build.embedded import fetch_embedded_model

SCHEMA = "semif-bench-quality/1"
ORDERINGS = ("original", "reversed", "shuffled")
COST_OPTION_COUNTS = (3, 5, 8)
COST_STATE_TOKENS = (150, 1000)
COST_REPEATS = 3
# One filler sentence of a support ticket; about 16 tokens with SmolLM2's tokenizer.
FILLER = "The customer wrote again about order 4411, the late parcel and the refund promised. "
FILLER_TOKENS = 16
# How each letters reading is asked for (policy fields of a decision body; the likelihood
# readout's: bench.runner.LIKELIHOOD_READINGS).
LETTER_READINGS: dict[str, dict[str, str]] = {
    mode: {"option_order": mode} for mode in OPTION_ORDERS
}
LIKELIHOOD_COST_OPTIONS = (3, 5, 8, 32)
LIKELIHOOD_COST_STATE = 150
# name -> (policy, whether each option is scored by a one-word label instead of its words)
LIKELIHOOD_COST_READINGS: dict[str, tuple[dict[str, str], bool]] = {
    "canonical": (LETTER_READINGS["canonical"], False),
    "debiased": (LETTER_READINGS["debiased"], False),
    "likelihood": (LIKELIHOOD_READINGS["sum"], False),
    "likelihood label": (LIKELIHOOD_READINGS["sum"], True),
}
# What the likelihood readout scores as an option's answer: its description, its id given
# as its label, or its id as words given as its label.
ANSWER_TEXTS = ("description", "id", "name")
LETTER_MAX_OPTIONS = 16  # the decision API's letter limit (adapter.schema.MAX_OPTIONS)
WORDS = ("route", "the", "case", "to", "billing", "now", "and", "tell", "them", "why", "it", "is")


def reorder(decision: Decision, ordering: str, rng: np.random.Generator) -> Decision:
    """The decision with its options in another order (ids and texts unchanged)."""
    options = decision.options
    if ordering == "reversed":
        return replace(decision, options=options[::-1])
    if ordering == "shuffled":
        return replace(decision, options=tuple(options[i] for i in rng.permutation(len(options))))
    return decision


def total_variation(first: Answer, second: Answer) -> float:
    return 0.5 * sum(abs(p - second.probabilities[k]) for k, p in first.probabilities.items())


def labelled(task: Task, text: str) -> Task:
    """The task with each option scored by `text` (ANSWER_TEXTS) under likelihood."""
    if text == "description":
        return task
    options = tuple(
        replace(o, label=o.id if text == "id" else o.id.replace("_", " ").replace("-", " "))
        for o in task.decision.options
    )
    return replace(task, decision=replace(task.decision, options=options))


def measure_answer_texts(
    client: Invoker, tasks: Sequence[Task], texts: Sequence[str] = ANSWER_TEXTS
) -> dict[str, dict[str, Any]]:
    """Accuracy, Brier and NLL per answer text and normalization (keyed "<text>
    <normalization>"), every task in its given order: the likelihood readout is
    order-invariant by construction, tested for every listing and answer text
    (tests/adapter/test_likelihood.py), so the orderings would repeat the same numbers.
    A task's normalizations are asked one after another, its prompt resident."""
    answers: dict[str, list[Answer | None]] = {
        f"{text} {name}": [] for text in texts for name in LIKELIHOOD_READINGS
    }
    for task in tasks:
        for text in texts:
            body = single_body(labelled(task, text).decision)
            for name, policy in LIKELIHOOD_READINGS.items():
                outcome = read_answer(task, client.invoke({**body, **policy}))
                answers[f"{text} {name}"].append(outcome.answer)
    expected = [task.expected for task in tasks]
    return {
        key: {
            "tasks": len(expected),
            "accuracy": accuracy(rows, expected),
            "brier": brier_score(rows, expected),
            "nll": log_loss(rows, expected),
        }
        for key, rows in answers.items()
    }


def measure_invariance(
    client: Invoker,
    tasks: Sequence[Task],
    seed: int,
    readings: Mapping[str, Mapping[str, str]] = LETTER_READINGS,
) -> dict[str, dict[str, Any]]:
    """Per reading (an option-order mode, or a likelihood normalization): flips and mean
    TV of each reordering against the original order, and the accuracy, Brier and NLL over
    all orderings."""
    rng = np.random.default_rng(seed)
    orders = {task.id: {o: reorder(task.decision, o, rng) for o in ORDERINGS} for task in tasks}
    report: dict[str, dict[str, Any]] = {}
    for name, policy in readings.items():
        answers: dict[str, list[Answer | None]] = {ordering: [] for ordering in ORDERINGS}
        for task in tasks:
            for ordering, decision in orders[task.id].items():
                body = {**single_body(decision), **policy}
                answers[ordering].append(read_answer(task, client.invoke(body)).answer)
        report[name] = _invariance(answers, [task.expected for task in tasks])
    return report


def _invariance(
    answers: Mapping[str, Sequence[Answer | None]], expected: Sequence[str]
) -> dict[str, Any]:
    original = answers["original"]
    flips, tv = {}, {}
    for ordering in ORDERINGS[1:]:
        pairs = [(a, b) for a, b in zip(original, answers[ordering], strict=True) if a and b]
        flips[ordering] = sum(a.top[0] != b.top[0] for a, b in pairs)
        tv[ordering] = statistics.fmean(total_variation(a, b) for a, b in pairs)
    pooled = [answer for ordering in ORDERINGS for answer in answers[ordering]]
    labels = list(expected) * len(ORDERINGS)
    return {
        "tasks": len(expected),
        "argmax_flips": flips,
        "mean_tv": tv,
        "accuracy": accuracy(pooled, labels),
        "brier": brier_score(pooled, labels),
        "nll": log_loss(pooled, labels),
    }


def cost_decision(state_tokens: int, options: int, tag: str) -> Decision:
    """A synthetic decision of about `state_tokens` state tokens; `tag` leads the state so
    no earlier request shares its prefix beyond the system turn."""
    state = f"Case {tag}. " + FILLER * max(1, state_tokens // FILLER_TOKENS)
    return Decision(
        id=f"cost-{tag}",
        state=state,
        question="Which team should take this case next?",
        options=tuple(
            Option(f"team{i}", f"Team {i}: handles cases of kind {i}.") for i in range(options)
        ),
    )


def measure_cost(
    client: Invoker,
    repeats: int = COST_REPEATS,
    state_sizes: Sequence[int] = COST_STATE_TOKENS,
) -> list[dict[str, Any]]:
    """as_given against debiased per state size and option count (medians over repeats)."""
    rows = []
    for state_tokens in state_sizes:
        for count in COST_OPTION_COUNTS:
            row: dict[str, Any] = {"state_tokens": state_tokens, "options": count}
            for mode in ("as_given", "debiased"):
                evaluated, seconds, inputs = [], [], []
                for repeat in range(repeats):
                    decision = cost_decision(state_tokens, count, f"{mode}-{count}-{repeat}")
                    body = {**single_body(decision), "option_order": mode}
                    started = time.perf_counter()
                    response = client.invoke(body)
                    seconds.append(time.perf_counter() - started)
                    result = response["result"]
                    # The request's count: rows its prompts share are evaluated once.
                    evaluated.append(response["timing"]["evaluated_tokens"])
                    inputs.append(result["input_tokens"])
                row[mode] = {
                    "prompts": result["timing"]["prompts"],
                    "input_tokens": statistics.median(inputs),
                    "evaluated_tokens": statistics.median(evaluated),
                    "seconds": statistics.median(seconds),
                }
            row["token_ratio"] = (
                row["debiased"]["evaluated_tokens"] / row["as_given"]["evaluated_tokens"]
            )
            row["time_ratio"] = row["debiased"]["seconds"] / row["as_given"]["seconds"]
            rows.append(row)
    return rows


def _words(start: int, count: int) -> list[str]:
    return [WORDS[(start + k) % len(WORDS)] for k in range(count)]


def likelihood_cost_decision(
    options: int, tag: str, state_tokens: int, label: bool = False
) -> Decision:
    """A state of about `state_tokens` tokens and `options` distinct options of 1 to 12
    words (with `label`, each labelled by its first word)."""
    decision = cost_decision(state_tokens, options, tag)
    worded = tuple(
        Option(
            f"o{i}",
            " ".join([f"team{i}", *(WORDS[(i + k) % len(WORDS)] for k in range(i % 12))]),
            f"team{i}" if label else None,
        )
        for i in range(options)
    )
    return replace(decision, options=worded)


def measure_likelihood_cost(
    client: Invoker,
    repeats: int = COST_REPEATS,
    state_tokens: int = LIKELIHOOD_COST_STATE,
    letters: bool = True,
) -> list[dict[str, Any]]:
    """The likelihood readout against the letters (canonical, debiased) per option count:
    evaluated tokens and seconds (medians over repeats, each state new to the server), and
    likelihood's ratios to each; and scored by labels against by their words. Without
    `letters` (a server that differs only in its likelihood prompt) the letters are not
    measured and their ratios are None."""
    rows = []
    for count in LIKELIHOOD_COST_OPTIONS:
        row: dict[str, Any] = {"state_tokens": state_tokens, "options": count}
        for name, (policy, label) in LIKELIHOOD_COST_READINGS.items():
            if name in LETTER_READINGS and (count > LETTER_MAX_OPTIONS or not letters):
                row[name] = None
                continue
            evaluated, seconds = [], []
            for repeat in range(repeats):
                tag = f"{name}-{count}-{repeat}".replace(" ", "-")
                decision = likelihood_cost_decision(count, tag, state_tokens, label)
                started = time.perf_counter()
                response = client.invoke({**single_body(decision), **policy})
                seconds.append(time.perf_counter() - started)
                evaluated.append(response["timing"]["evaluated_tokens"])
            row[name] = {
                "evaluated_tokens": statistics.median(evaluated),
                "seconds": statistics.median(seconds),
            }
        for mode in ("canonical", "debiased"):
            base = row[mode]
            row[f"tokens_vs_{mode}"] = (
                None
                if base is None
                else row["likelihood"]["evaluated_tokens"] / base["evaluated_tokens"]
            )
            row[f"time_vs_{mode}"] = (
                None if base is None else row["likelihood"]["seconds"] / base["seconds"]
            )
        words, labelled_by = row["likelihood"], row["likelihood label"]
        row["label_tokens_vs_words"] = labelled_by["evaluated_tokens"] / words["evaluated_tokens"]
        rows.append(row)
    return rows


def run_quality(
    client: Invoker,
    tasks: Sequence[Task],
    *,
    seed: int = 0,
    folds: int = DEFAULT_FOLDS,
    cost_repeats: int = COST_REPEATS,
    cost_states: Sequence[int] = COST_STATE_TOKENS,
    likelihood_state: int = LIKELIHOOD_COST_STATE,
    letters: bool = True,
) -> dict[str, Any]:
    """Every figure of this module as one JSON-ready dict (see the module docstring);
    without `letters`, only the likelihood readout's (and the prior's, which its
    calibration is fitted beside)."""
    read = score_all(client, tasks)
    _, prior = calibrate(
        read.scored,
        mode="canonical",
        folds=folds,
        seed=seed,
        prompt_version=read.prompt_version,
        tasks_sha256="0" * 64,
        likelihood_version=read.likelihood_version,
        conformal=True,
    )
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "tasks": len(tasks),
        "prompt_version": read.prompt_version,
        "prior": {"held_out": prior["held_out"], "prior_recovers": prior["prior_recovers"]},
        # semif-calibrate's held-out figures for the likelihood readout's temperatures
        "likelihood_calibration": prior["likelihood_held_out"],
        "conformal": prior["conformal"],
        "likelihood": {
            "cost": measure_likelihood_cost(client, cost_repeats, likelihood_state),
            "answer_texts": measure_answer_texts(client, tasks),
            "prompt_version": read.likelihood_version,
        },
    }
    if letters:
        report["invariance"] = measure_invariance(client, tasks, seed)
        report["cost"] = measure_cost(client, cost_repeats, cost_states)
        report["likelihood"]["invariance"] = measure_invariance(
            client, tasks, seed, LIKELIHOOD_READINGS
        )
    finite_report: dict[str, Any] = finite(report)
    return finite_report


def run_listing(
    client: Invoker,
    tasks: Sequence[Task],
    *,
    cost_repeats: int = COST_REPEATS,
    likelihood_state: int = LIKELIHOOD_COST_STATE,
) -> dict[str, Any]:
    """The likelihood figures on a server with another likelihood prompt (its listing):
    every answer text's figures and the likelihood cost (the letters are the same on
    both), and the prompt version read."""
    answers = measure_answer_texts(client, tasks)
    probe = client.invoke({**single_body(tasks[0].decision), **LIKELIHOOD_READINGS["sum"]})
    report = {
        "prompt_version": probe["result"]["prompt_version"],
        "answer_texts": answers,
        "cost": measure_likelihood_cost(client, cost_repeats, likelihood_state, letters=False),
    }
    finite_report: dict[str, Any] = finite(report)
    return finite_report


def format_quality(report: Mapping[str, Any]) -> str:
    """The tables as text: the letters' (when measured), the likelihood readout's, then
    coherence's (each where the report has it: `--only coherence` has no other)."""
    lines = format_letters(report) if "invariance" in report else []
    if "likelihood" in report:
        lines += format_likelihood(report)
    if "coherence" in report:
        lines += ["", *format_coherence(report["coherence"])]
    return "\n".join(lines).lstrip("\n")


def format_likelihood(report: Mapping[str, Any]) -> list[str]:
    """The likelihood readout's tables (with the letters' invariance beside its own when
    both were measured), and the prediction sets."""
    lines: list[str] = []
    likelihood = report["likelihood"]
    if "invariance" in likelihood:
        invariance = report["invariance"]
        readings = {
            "canonical": invariance["canonical"],
            "debiased": invariance["debiased"],
            **{f"likelihood {n}": r for n, r in likelihood["invariance"].items()},
        }
        lines += ["", *format_readings(readings)]
    lines += ["", *format_likelihood_cost(likelihood["cost"])]
    lines += ["", f"{'held out (likelihood)':<22}{'stage':<14}{'acc':>7}{'nll':>8}{'brier':>8}"]
    for name, stages in report["likelihood_calibration"].items():
        for stage, row in stages.items():
            lines.append(
                f"{name:<22}{stage:<14}{row['accuracy']:>7.3f}{row['nll']:>8.3f}"
                f"{row['brier']:>8.3f}"
            )
    texts = {
        f"{listing_of(likelihood['prompt_version'])} {name}": row
        for name, row in likelihood["answer_texts"].items()
    }
    if "listed" in likelihood:
        listed = likelihood["listed"]
        texts |= {f"listed {name}": row for name, row in listed["answer_texts"].items()}
    lines += ["", f"{'answer text (given order)':<28}{'acc':>7}{'nll':>8}{'brier':>8}"]
    for name, row in texts.items():
        lines.append(f"{name:<28}{row['accuracy']:>7.3f}{row['nll']:>8.3f}{row['brier']:>8.3f}")
    if "listed" in likelihood:
        lines += ["", "listed", *format_likelihood_cost(likelihood["listed"]["cost"])]
    lines += [
        "",
        "prediction sets (held out, random halves)",
        *format_coverage(report["conformal"]),
    ]
    return lines


def listing_of(prompt_version: str) -> str:
    """Which listing a likelihood prompt version renders (its own name if unknown)."""
    names = {version: listing for listing, version in LIKELIHOOD_PROMPT_VERSIONS.items()}
    return names.get(prompt_version, prompt_version)


def format_letters(report: Mapping[str, Any]) -> list[str]:
    """The letters' invariance, prior and debiased-cost tables."""
    lines = [
        f"{'mode':<10}{'flips rev':>10}{'flips shuf':>11}{'TV rev':>8}{'TV shuf':>8}"
        f"{'acc':>7}{'brier':>7}"
    ]
    for mode, row in report["invariance"].items():
        flips, tv = row["argmax_flips"], row["mean_tv"]
        lines.append(
            f"{mode:<10}{flips['reversed']:>10}{flips['shuffled']:>11}{tv['reversed']:>8.3f}"
            f"{tv['shuffled']:>8.3f}{row['accuracy']:>7.3f}{row['brier']:>7.3f}"
        )
    held = report["prior"]["held_out"]
    lines.append("")
    lines.append(f"{'held out':<22}{'acc':>7}{'nll':>8}{'brier':>8}")
    for name, row in (
        ("as_given", held["as_given"]["uncalibrated"]),
        ("canonical", held["canonical"]["uncalibrated"]),
        ("canonical + prior", held["canonical"]["prior"]),
        ("debiased", held["debiased"]["uncalibrated"]),
    ):
        lines.append(f"{name:<22}{row['accuracy']:>7.3f}{row['nll']:>8.3f}{row['brier']:>8.3f}")
    shares = report["prior"]["prior_recovers"]
    lines.append(
        "prior recovers of debiased's gain: "
        + ", ".join(f"{k} {'-' if v is None else f'{v:.0%}'}" for k, v in shares.items())
    )
    lines.append("")
    lines.append(
        f"{'state':>6}{'opts':>5}{'prompts':>8}{'eval as_given':>14}{'eval debiased':>14}"
        f"{'tokens x':>9}{'s as_given':>11}{'s debiased':>11}{'time x':>8}"
    )
    for row in report["cost"]:
        given, debiased = row["as_given"], row["debiased"]
        lines.append(
            f"{row['state_tokens']:>6}{row['options']:>5}{debiased['prompts']:>8}"
            f"{given['evaluated_tokens']:>14.0f}{debiased['evaluated_tokens']:>14.0f}"
            f"{row['token_ratio']:>9.2f}{given['seconds']:>11.4f}"
            f"{debiased['seconds']:>11.4f}{row['time_ratio']:>8.2f}"
        )
    return lines


def format_readings(readings: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Flips, accuracy and NLL per reading."""
    lines = [f"{'reading':<26}{'flips rev':>10}{'flips shuf':>11}{'acc':>7}{'nll':>8}"]
    for name, row in readings.items():
        flips = row["argmax_flips"]
        lines.append(
            f"{name:<26}{flips['reversed']:>10}{flips['shuffled']:>11}"
            f"{row['accuracy']:>7.3f}{row['nll']:>8.3f}"
        )
    return lines


def format_likelihood_cost(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Evaluated tokens per option count, likelihood's ratios to the letters' and a
    label's to the words'."""
    lines = [
        f"{'opts':>5}{'eval canon':>11}{'eval debias':>12}{'eval likely':>12}"
        f"{'tok x canon':>12}{'tok x debias':>13}{'time x canon':>13}{'time x debias':>14}"
        f"{'label x words':>14}"
    ]
    for row in rows:
        canonical, debiased = row["canonical"], row["debiased"]
        lines.append(
            f"{row['options']:>5}"
            f"{cell(canonical and canonical['evaluated_tokens'], '.0f', 11)}"
            f"{cell(debiased and debiased['evaluated_tokens'], '.0f')}"
            f"{cell(row['likelihood']['evaluated_tokens'], '.0f')}"
            f"{cell(row['tokens_vs_canonical'])}{cell(row['tokens_vs_debiased'], width=13)}"
            f"{cell(row['time_vs_canonical'], width=13)}{cell(row['time_vs_debiased'], width=14)}"
            f"{cell(row['label_tokens_vs_words'], width=14)}"
        )
    return lines


def cell(value: float | None, digits: str = ".2f", width: int = 12) -> str:
    """A right-aligned table cell; "-" where a reading was not measured."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{digits}}"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="semif-bench-quality", description=__doc__.splitlines()[0]
    )
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server")
    target.add_argument("--local", action="store_true", help="start `serve` on the embedded model")
    parser.add_argument("--tasks", type=Path, default=SMOKE_TASKS, help="JevBench JSONL file")
    parser.add_argument("--gguf", type=Path, help="with --local: serve this GGUF instead")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--folds", type=int, default=DEFAULT_FOLDS)
    parser.add_argument("--repeats", type=int, default=COST_REPEATS, help="cost repeats")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=Path(".cache/bench"), help="output folder")
    parser.add_argument(
        "--listed-url",
        help="with --url: a server whose SEMIF_LIKELIHOOD_PROMPT is listed, to compare",
    )
    parser.add_argument(
        "--likelihood-only",
        dest="letters",
        action="store_false",
        help="skip the letters' invariance and cost tables (measured the same either way)",
    )
    parser.add_argument(
        "--no-listed",
        dest="listed",
        action="store_false",
        help="with --local: skip the second server (the listed likelihood prompt)",
    )
    parser.add_argument(
        "--cases", type=Path, default=COHERENCE_CASES, help="coherence cases JSONL file"
    )
    parser.add_argument(
        "--only",
        choices=("coherence",),
        help="measure this figure alone (coherence: bench.coherence, a few minutes)",
    )
    args = parser.parse_args(argv)
    if args.only and (args.listed_url or not args.letters):
        parser.error(
            f"--only {args.only} measures no other figure: drop --listed-url and --likelihood-only"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(arguments)
    tasks = load_tasks(args.tasks)
    cases = load_cases(args.cases)
    command = " ".join(["semif-bench-quality", *arguments])

    def client_of(url: str) -> Invoker:
        return open_client(url=url, endpoint=None, region=None, timeout_s=args.timeout)

    def run(url: str) -> dict[str, Any]:
        client = client_of(url)
        report: dict[str, Any] = (
            {"schema": SCHEMA}
            if args.only
            else run_quality(
                client,
                tasks,
                seed=args.seed,
                folds=args.folds,
                cost_repeats=args.repeats,
                letters=args.letters,
            )
        )
        report["coherence"] = run_coherence(client, cases, command=command)
        return report

    def listed(url: str) -> dict[str, Any]:
        return run_listing(client_of(url), tasks, cost_repeats=args.repeats)

    if args.local:
        gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
        with serve_model(gguf, log_dir=args.out, threads=args.threads) as server:
            report = run(server.base_url)
        if args.listed and not args.only:
            other = {"SEMIF_LIKELIHOOD_PROMPT": "listed"}
            with serve_model(
                gguf, log_dir=args.out, threads=args.threads, settings=other, name="serve-listed"
            ) as server:
                report["likelihood"]["listed"] = listed(server.base_url)
    else:
        report = run(args.url)
        if args.listed_url:
            report["likelihood"]["listed"] = listed(args.listed_url)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench-quality.json"
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    if not args.only:
        print(f"{len(tasks)} tasks from {args.tasks}")
    print(f"{len(cases)} coherence cases from {args.cases}")
    print(format_quality(report))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
