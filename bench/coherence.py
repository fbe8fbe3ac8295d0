"""Metamorphic coherence: which relations between answers each readout keeps, measured.

A probability read from a model is only worth acting on if related questions get related
answers. Metamorphic testing (Chen et al., "Metamorphic Testing: A Review of Challenges and
Opportunities", ACM Computing Surveys 2018) checks a system without knowing the right
answers: it changes the input in a way whose effect on the output is known, and counts how
often the output moves as it must. Every relation here is of that kind, so no labels are
needed, and each one is a promise a caller relies on without saying so:
- permutation: reordering the options leaves every option's probability unchanged (the
  letters are asked in the `canonical` order, adapter.ordering);
- batch: a question answered alone and inside a shared-state `decisions` request gets the
  same probabilities (what rides along must not matter);
- choice set (independence of irrelevant alternatives, Luce's choice axiom, "Individual
  Choice Behavior", 1959): removing an option, or adding one, leaves the ratios of the other
  options' probabilities unchanged; a yes/no question gets an "unsure" option added;
- clones: an option declared twice (two ids, one text) gets two equal probabilities that
  together carry what the one copy carried alone, the others unchanged;
- complement: P(yes to "is X?") + P(yes to "is not X?") is 1;
- conjunction: P(yes to "A and B?") <= min(P(yes to A), P(yes to B));
- disjunction: P(yes to "A or B?") >= max(P(yes to A), P(yes to B)) (the conjunction and
  disjunction halves of the Frechet bounds that Paleka et al., "Consistency Checks for
  Language Model Forecasters", ICLR 2025, check);
- paraphrase: a yes/no question reworded gets the same P(yes) (Elazar et al., "Measuring
  and Improving Consistency in Pretrained Language Models", TACL 2021).
The first four are properties a readout can have exactly (the tolerance is for rounding):
the likelihood readout has all four by construction, the canonical letters the first two.
The last four are logic the model has to know, whatever reads it, checked within a stated
tolerance (RELATIONS).

`run_coherence(client, cases)` (`python -m bench.coherence`, or `semif-bench-quality` beside
its other figures) reads each case (bench/tasks/coherence.jsonl: a support ticket, a choice
question with an option it does not list, and six yes/no questions about the ticket) under
each reading (READINGS: the letters, the likelihood readout under each normalization, and
the choice questions asked as multi-label ones, whose clones are options like any other:
each judged alone, equal to the original, nothing split):
every variant the relations compare in one shared-state request, and the choice question
and the first yes/no question alone (the batch relation). It reports, per reading, relation
and question kind, the share of cases (0-100) that keep the relation, and each case's gap
(how far it is from keeping it), so another tolerance can be applied to the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from adapter.errors import RequestError
from adapter.schema import Decision, Option, parse_decision
from adapter.systemone import question_options
from bench.calibrate import LOG_FLOOR
from bench.metrics import Answer
from bench.runner import (
    LIKELIHOOD_READINGS,
    Invoker,
    add_target_arguments,
    finite,
    parse_answer,
    target_client,
)
from bench.tasks import NOUL_LABELS, decision_json, parse_lines, shared_body, single_body

SCHEMA = "semif-bench-coherence/1"
COHERENCE_CASES = Path(__file__).resolve().parent / "tasks" / "coherence.jsonl"
Kind = Literal["choice", "noul"]  # what is asked: one of several options, or yes/no
KINDS: tuple[Kind, ...] = ("choice", "noul")
# The yes/no questions of a case: A, its negation, A reworded, B, A and B, A or B.
YES_NO_ROLES = ("a", "not_a", "a_paraphrase", "b", "a_and_b", "a_or_b")
# System One's noul options (Yes, No) under the ids JevBench gives them (bench.tasks).
YES_NO = tuple(Option(NOUL_LABELS[o.id], o.description) for o in question_options("noul", None, ""))
UNSURE = Option("unsure", "Cannot tell from the evidence.")
CLONE = " (clone)"  # appended to the cloned option's id
ALONE = ("choice", "a")  # the questions also asked alone, for the batch relation
# How each reading is asked for: the letters in the canonical order (order-invariant at one
# prompt, the server default), the likelihood readout under each normalization.
READINGS: dict[str, dict[str, str]] = {
    "letters": {"readout": "letters", "option_order": "canonical"},
    **{f"likelihood {name}": policy for name, policy in LIKELIHOOD_READINGS.items()},
    "multi-label": {},
}
# The reading that asks the choice questions as multi-label ones (each option judged alone,
# adapter.multi_label): only the choice relations apply, and a clone is an option like any
# other (equal to the original, nothing split).
MULTI_LABEL = "multi-label"


@dataclass(frozen=True)
class Relation:
    """One metamorphic relation: the kinds it is checked on, and the largest gap (its
    checker's measure of the violation) that still keeps it."""

    name: str
    kinds: tuple[Kind, ...]
    tolerance: float
    meaning: str

    def holds(self, gap: float) -> bool:
        return gap <= self.tolerance


RELATIONS = {
    relation.name: relation
    for relation in (
        Relation(
            "permutation",
            KINDS,
            1e-9,
            "largest change of an option's probability when the options are reversed",
        ),
        Relation(
            "batch",
            KINDS,
            1e-9,
            "largest change of an option's probability between alone and in a shared batch",
        ),
        Relation(
            "choice set",
            KINDS,
            1e-6,
            "largest relative change of the ratio of two options' probabilities when "
            "another option is removed or added (yes/no: an 'unsure' option added)",
        ),
        Relation(
            "clones",
            ("choice",),
            1e-6,
            "largest relative difference between the clones, or between the options' "
            "probabilities (the clones' summed) and the question's without the clone",
        ),
        Relation("complement", ("noul",), 0.1, "|P(yes to A) + P(yes to not A) - 1|"),
        Relation("conjunction", ("noul",), 1e-9, "P(yes to A and B) - min(P(A), P(B))"),
        Relation("disjunction", ("noul",), 1e-9, "max(P(A), P(B)) - P(yes to A or B)"),
        Relation("paraphrase", ("noul",), 0.1, "|P(yes to A) - P(yes to A reworded)|"),
    )
}


class CoherenceError(RuntimeError):
    """The server's answer cannot be judged (missing or malformed); says which question."""


@dataclass(frozen=True)
class Case:
    """One support ticket and the questions asked about it."""

    id: str
    choice: Decision  # one of three or more options
    extra: Option  # an option the choice question does not list
    yes_no: Mapping[str, Decision]  # by YES_NO_ROLES

    @property
    def clone(self) -> Option:
        """A second option with the first option's text under another id."""
        first = self.choice.options[0]
        return replace(first, id=first.id + CLONE)

    def variants(self) -> dict[str, Decision]:
        """Every question the relations compare, by name, with ids unique in the case."""
        choice, options = self.choice, self.choice.options
        named = {
            "choice": choice,
            "choice reversed": replace(choice, options=options[::-1]),
            "choice removed": replace(choice, options=options[:-1]),
            "choice added": replace(choice, options=(*options, self.extra)),
            "choice cloned": replace(choice, options=(*options, self.clone)),
            **self.yes_no,
            "a reversed": replace(self.yes_no["a"], options=YES_NO[::-1]),
            "a unsure": replace(self.yes_no["a"], options=(*YES_NO, UNSURE)),
        }
        return {
            name: replace(decision, id=f"{self.id}: {name}") for name, decision in named.items()
        }


def _object(raw: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = raw.get(key)
    if not isinstance(value, Mapping):
        raise ValueError(f"{key} must be a JSON object")
    return value


def parse_case(raw: Any) -> Case:
    """One line of a cases file; ValueError says which rule it broke. Every variant is
    checked with the decision API's own rules, so the server never refuses a case."""
    if not isinstance(raw, Mapping):
        raise ValueError("a case must be a JSON object")
    choice, yes_no = _object(raw, "choice"), _object(raw, "yes_no")
    options, extra = _object(choice, "options"), _object(choice, "extra")
    if len(options) < 3:
        raise ValueError("choice.options must have at least 3 options (one is removed)")
    if len(extra) != 1:
        raise ValueError("choice.extra must name exactly one option")
    if sorted(yes_no) != sorted(YES_NO_ROLES):
        raise ValueError(f"yes_no must have exactly the questions {', '.join(YES_NO_ROLES)}")
    case_id, state = raw.get("id"), raw.get("state", "")
    if not isinstance(case_id, str) or not case_id:
        raise ValueError("id must be a non-empty string")
    # The texts are checked below, as the server checks them.
    case = Case(
        id=case_id,
        choice=Decision(
            "choice",
            state,
            choice.get("question", ""),
            tuple(Option(key, text) for key, text in options.items()),
        ),
        extra=next(Option(key, text) for key, text in extra.items()),
        yes_no={role: Decision(role, state, yes_no[role], YES_NO) for role in YES_NO_ROLES},
    )
    try:
        for decision in case.variants().values():
            parse_decision(decision_json(decision), decision.id)
    except RequestError as error:
        raise ValueError(str(error)) from None
    return case


def load_cases(path: Path = COHERENCE_CASES) -> list[Case]:
    with path.open(encoding="utf-8") as handle:
        return parse_lines(handle, str(path), parse_case, "case")


def _log(probability: float) -> float:
    return math.log(max(probability, LOG_FLOOR))


def probability_gap(first: Answer, second: Answer) -> float:
    """The largest change of one option's probability (the same options in both)."""
    return max(abs(p - second.probabilities[key]) for key, p in first.probabilities.items())


def ratio_gap(base: Answer, variant: Answer) -> float:
    """The largest change, in log, of the ratio of two options' probabilities over the
    options both answers have: the spread of their log-probability shifts."""
    shifts = [
        _log(variant.probabilities[key]) - _log(p)
        for key, p in base.probabilities.items()
        if key in variant.probabilities
    ]
    return max(shifts) - min(shifts)


def clone_gap(base: Answer, cloned: Answer, original: str, clone: str) -> float:
    """How far the clones are from splitting the original's probability evenly with the
    rest unchanged: the larger of the log gap between the two, and the largest log change
    of an option's probability (the clones' summed) against the question without the clone."""
    merged = {key: p for key, p in cloned.probabilities.items() if key != clone}
    merged[original] += cloned.probabilities[clone]
    split = abs(_log(cloned.probabilities[original]) - _log(cloned.probabilities[clone]))
    moved = max(abs(_log(merged[key]) - _log(p)) for key, p in base.probabilities.items())
    return max(split, moved)


def complement_gap(yes_a: float, yes_not_a: float) -> float:
    return abs(yes_a + yes_not_a - 1.0)


def conjunction_gap(yes_a: float, yes_b: float, yes_a_and_b: float) -> float:
    return yes_a_and_b - min(yes_a, yes_b)


def disjunction_gap(yes_a: float, yes_b: float, yes_a_or_b: float) -> float:
    return max(yes_a, yes_b) - yes_a_or_b


def paraphrase_gap(yes_a: float, yes_reworded: float) -> float:
    return abs(yes_a - yes_reworded)


def independent_clone_gap(base: Answer, cloned: Answer, original: str, clone: str) -> float:
    """A multi-label question's clones: how far the clone is from the original, and any
    option's probability from the question's without the clone (both in log)."""
    split = abs(_log(cloned.probabilities[original]) - _log(cloned.probabilities[clone]))
    moved = max(
        abs(_log(cloned.probabilities[key]) - _log(p)) for key, p in base.probabilities.items()
    )
    return max(split, moved)


CloneGap = Callable[[Answer, Answer, str, str], float]


def choice_gaps(
    case: Case,
    batch: Mapping[str, Answer],
    alone: Mapping[str, Answer],
    clones: CloneGap = clone_gap,
) -> list[tuple[str, Kind, float]]:
    """The choice question's relations: permutation, batch, choice set, and clones judged
    by `clones` (a multi-label question's: `independent_clone_gap`)."""
    choice = batch["choice"]
    original, clone = case.choice.options[0].id, case.clone.id
    return [
        ("permutation", "choice", probability_gap(choice, batch["choice reversed"])),
        ("batch", "choice", probability_gap(alone["choice"], choice)),
        (
            "choice set",
            "choice",
            max(ratio_gap(choice, batch[f"choice {n}"]) for n in ("removed", "added")),
        ),
        ("clones", "choice", clones(choice, batch["choice cloned"], original, clone)),
    ]


def case_gaps(
    case: Case, batch: Mapping[str, Answer], alone: Mapping[str, Answer]
) -> list[tuple[str, Kind, float]]:
    """Every relation's gap for one case read one way: `batch` holds every variant's answer
    from the shared request (by variant name), `alone` the ALONE questions' answers."""
    yes = {role: batch[role].probabilities["yes"] for role in YES_NO_ROLES}
    return [
        *choice_gaps(case, batch, alone),
        ("permutation", "noul", probability_gap(batch["a"], batch["a reversed"])),
        ("batch", "noul", probability_gap(alone["a"], batch["a"])),
        ("choice set", "noul", ratio_gap(batch["a"], batch["a unsure"])),
        ("complement", "noul", complement_gap(yes["a"], yes["not_a"])),
        ("conjunction", "noul", conjunction_gap(yes["a"], yes["b"], yes["a_and_b"])),
        ("disjunction", "noul", disjunction_gap(yes["a"], yes["b"], yes["a_or_b"])),
        ("paraphrase", "noul", paraphrase_gap(yes["a"], yes["a_paraphrase"])),
    ]


def case_detail(case: Case, batch: Mapping[str, Answer]) -> dict[str, Any]:
    """What the logical relations and the clones were judged on, to read a run by hand:
    P(yes) per yes/no question (where asked), and the cloned option's probability alone and
    both copies' beside each other."""
    original, clone = case.choice.options[0].id, case.clone.id
    cloned = batch["choice cloned"].probabilities
    asked = [role for role in YES_NO_ROLES if role in batch]
    return {
        "p_yes": {role: batch[role].probabilities["yes"] for role in asked},
        "clones": {
            "alone": batch["choice"].probabilities[original],
            "original": cloned[original],
            "clone": cloned[clone],
        },
    }


def answer_of(decision: Decision, result: Any) -> Answer:
    """The answer a result gives `decision`; anything else stops the run: a relation cannot
    be judged on a missing answer, and a malformed one is a server bug to fix first."""
    answer = None
    if isinstance(result, Mapping) and result.get("id") == decision.id:
        answer = parse_answer(decision.option_ids, result)
    if answer is None:
        raise CoherenceError(f"{decision.id}: no valid answer in {json.dumps(result)[:300]}")
    return answer


def read_case(
    client: Invoker, case: Case, policy: Mapping[str, str], *, multi_label: bool = False
) -> tuple[dict[str, Answer], dict[str, Answer]]:
    """Every variant in one shared-state request, then the ALONE questions one by one
    (`multi_label`: the choice questions only, each asked as a multi-label question)."""
    variants = case.variants()
    if multi_label:
        variants = {
            name: replace(decision, kind="multi_label")
            for name, decision in variants.items()
            if name.startswith("choice")
        }
    response = client.invoke({**shared_body(list(variants.values())), **policy})
    results = response.get("results") if isinstance(response, Mapping) else None
    if not isinstance(results, list) or len(results) != len(variants):
        raise CoherenceError(f"{case.id}: the shared request did not answer every question")
    batch = {
        name: answer_of(decision, result)
        for (name, decision), result in zip(variants.items(), results, strict=True)
    }
    alone = {}
    for name in (name for name in ALONE if name in variants):
        answer = client.invoke({**single_body(variants[name]), **policy})
        alone[name] = answer_of(variants[name], answer.get("result"))
    return batch, alone


def summarize(relation: Relation, gaps: Sequence[float]) -> dict[str, Any]:
    """A relation's row for one reading and kind: how many cases keep it, the share
    (0-100), and every case's gap in case order."""
    kept = sum(relation.holds(gap) for gap in gaps)
    return {
        "cases": len(gaps),
        "kept": kept,
        "share": 100.0 * kept / len(gaps),
        "worst_gap": max(gaps),
        "mean_gap": statistics.fmean(gaps),
        "gaps": list(gaps),
    }


def run_coherence(
    client: Invoker,
    cases: Sequence[Case],
    readings: Mapping[str, Mapping[str, str]] = READINGS,
    command: str | None = None,
) -> dict[str, Any]:
    """Every reading's share of cases keeping each relation, per kind, as one JSON-ready
    dict; `command` is the one that reproduces it. A case is read every way in turn, so its
    state stays resident in the server's prefix cache."""
    gaps: dict[str, dict[tuple[str, Kind], list[float]]] = {name: {} for name in readings}
    details: dict[str, dict[str, dict[str, Any]]] = {name: {} for name in readings}
    for case in cases:
        for name, policy in readings.items():
            multi = name == MULTI_LABEL
            batch, alone = read_case(client, case, policy, multi_label=multi)
            judged = (
                choice_gaps(case, batch, alone, independent_clone_gap)
                if multi
                else case_gaps(case, batch, alone)
            )
            for relation, kind, gap in judged:
                gaps[name].setdefault((relation, kind), []).append(gap)
            details[name][case.id] = case_detail(case, batch)
    report = {
        "schema": SCHEMA,
        "command": command,
        "cases": [case.id for case in cases],
        "relations": {
            relation.name: {
                "kinds": list(relation.kinds),
                "tolerance": relation.tolerance,
                "gap": relation.meaning,
            }
            for relation in RELATIONS.values()
        },
        "readings": {
            name: {
                "policy": dict(policy),
                "relations": {
                    relation.name: {
                        kind: summarize(relation, gaps[name][relation.name, kind])
                        for kind in relation.kinds
                        if (relation.name, kind) in gaps[name]
                    }
                    for relation in RELATIONS.values()
                },
                "per_case": details[name],
            }
            for name, policy in readings.items()
        },
    }
    finite_report: dict[str, Any] = finite(report)
    return finite_report


def format_coherence(report: Mapping[str, Any]) -> list[str]:
    """The table: per relation and kind, each reading's share of cases keeping it."""
    readings = report["readings"]
    lines = [
        f"coherence: share of {len(report['cases'])} cases (0-100) keeping each relation",
        f"{'relation':<13}{'kind':<8}{'tolerance':>10}"
        + "".join(f"{name:>17}" for name in readings),
    ]
    for name, relation in report["relations"].items():
        for kind in relation["kinds"]:
            rows = (readings[r]["relations"][name].get(kind) for r in readings)
            shares = ("-" if row is None else f"{row['share']:.1f}" for row in rows)
            lines.append(
                f"{name:<13}{kind:<8}{relation['tolerance']:>10g}"
                + "".join(f"{share:>17}" for share in shares)
            )
    if report.get("command"):
        lines.append(f"reproduce: {report['command']}")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.coherence", description=__doc__.splitlines()[0]
    )
    add_target_arguments(parser)
    parser.add_argument("--cases", type=Path, default=COHERENCE_CASES, help="cases JSONL file")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    arguments = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(arguments)
    cases = load_cases(args.cases)
    command = " ".join(["python -m bench.coherence", *arguments])
    with target_client(args) as (target, client):
        report = run_coherence(client, cases, command=command)
    report["target"] = target
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench-coherence.json"
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    print(f"{target}: {len(cases)} cases from {args.cases}")
    print("\n".join(format_coherence(report)))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
