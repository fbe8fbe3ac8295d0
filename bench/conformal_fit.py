"""`semif-calibrate --conformal`: the conformal section from held-out answers, and its report.

The scores are those of each task's right option under the distribution the adapter serves,
with the temperatures and prior fitted on the other folds (cross-fitting: a task's score
never comes from a fit that saw its label), so they are exchangeable with the questions a
server will answer under the final fit, up to the small difference between a fit on k - 1
folds and one on all of them. The report draws many random halves of those scores, takes one
half as the calibration set and the other as questions, and says the coverage the sets
reached and their mean size at each coverage asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bench.metrics import Answer
from model_build.calibration import QuestionKind
from model_build.conformal import (
    METHODS,
    ConformalMethod,
    ConformalScores,
    ConformalSection,
    applies_score,
    nonconformity,
    set_members,
    threshold,
)

COVERAGES = (0.8, 0.9, 0.95)
SPLITS = 200  # random halves the report averages over


Row = tuple[Sequence[float], int]  # a question's served probabilities, the right index


def labelled(answers: Sequence[Answer], expected: Sequence[str]) -> list[Row]:
    """Each answer's probabilities in its options' order and the right option's index."""
    rows: list[Row] = []
    for answer, label in zip(answers, expected, strict=True):
        labels = list(answer.probabilities)
        rows.append(([answer.probabilities[key] for key in labels], labels.index(label)))
    return rows


def _score(method: ConformalMethod, row: Row, each_alone: bool) -> float:
    """The right option's score: of its whole distribution, or (a multi-label question) of
    its own "applies"."""
    probabilities, right = row
    if each_alone:
        return applies_score(method, probabilities[right])
    return nonconformity(method, probabilities, right)


def conformal_section(
    answers: Sequence[Answer],
    expected: Sequence[str],
    kinds: Sequence[QuestionKind],
    *,
    prompt_version: str,
    option_order: str,
) -> ConformalSection:
    """The sorted scores of the right options, per question kind present and method."""
    rows = labelled(answers, expected)
    scores: dict[str, ConformalScores] = {
        kind: held_scores([row for row, own in zip(rows, kinds, strict=True) if own == kind])
        for kind in sorted(set(kinds))
    }
    return ConformalSection(prompt_version, option_order, scores)


def held_scores(rows: Sequence[Row], *, each_alone: bool = False) -> ConformalScores:
    """The sorted scores of the right options, per method (`each_alone`: a multi-label
    question's, whose right option is one that applies)."""
    return ConformalScores(
        {
            method: tuple(sorted(_score(method, row, each_alone) for row in rows))
            for method in METHODS
        }
    )


def coverage_report(
    rows: Sequence[Row],
    *,
    each_alone: bool = False,
    coverages: Sequence[float] = COVERAGES,
    splits: int = SPLITS,
    seed: int = 0,
) -> dict[str, dict[str, dict[str, float]]]:
    """Per coverage asked and method: the share of held-out questions whose set held the
    right option, the mean set size, and how often the set was one option, averaged over
    `splits` random halves (calibrate on one, answer the other). `each_alone`: multi-label
    rows, whose sets are applies_set's and whose right option is one that applies (the
    coverage is then the share of applicable options in their set)."""
    rng = np.random.default_rng(seed)
    report: dict[str, dict[str, dict[str, float]]] = {}
    for coverage in coverages:
        per_method: dict[str, dict[str, float]] = {}
        for method in METHODS:
            covered = sizes = singletons = count = 0
            for _ in range(splits):
                order = rng.permutation(len(rows))
                half = len(rows) // 2
                held = sorted(_score(method, rows[i], each_alone) for i in order[:half])
                limit = threshold(held, coverage)
                for index in order[half:]:
                    probabilities, right = rows[index]
                    members = set_members(method, probabilities, limit, each_alone=each_alone)
                    covered += right in members
                    sizes += len(members)
                    singletons += len(members) == 1
                    count += 1
            per_method[method] = {
                "coverage": covered / count,
                "mean_set_size": sizes / count,
                "singletons": singletons / count,
                "calibration_questions": len(rows) // 2,
            }
        report[f"{coverage:g}"] = per_method
    return report


def format_coverage(report: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The report's lines: one per readout, coverage asked and method."""
    header = f"{'readout':<18}{'asked':>6}{'method':>7}{'covered':>9}{'size':>7}{'single':>8}"
    lines = [header, "-" * len(header)]
    for readout, by_coverage in report.items():
        for asked, methods in by_coverage.items():
            for method, row in methods.items():
                lines.append(
                    f"{readout:<18}{asked:>6}{method:>7}{row['coverage']:>9.3f}"
                    f"{row['mean_set_size']:>7.2f}{row['singletons']:>8.2f}"
                )
    return lines
