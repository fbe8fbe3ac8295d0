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
    ConformalScores,
    ConformalSection,
    nonconformity,
    prediction_set,
    threshold,
)

COVERAGES = (0.8, 0.9, 0.95)
SPLITS = 200  # random halves the report averages over


def _labelled(answer: Answer, expected: str) -> tuple[list[float], int]:
    labels = list(answer.probabilities)
    return [answer.probabilities[label] for label in labels], labels.index(expected)


def conformal_section(
    answers: Sequence[Answer],
    expected: Sequence[str],
    kinds: Sequence[QuestionKind],
    *,
    prompt_version: str,
    option_order: str,
) -> ConformalSection:
    """The sorted scores of the right options, per question kind present and method."""
    scores: dict[str, ConformalScores] = {}
    for kind in sorted(set(kinds)):
        rows = [
            _labelled(answer, label)
            for answer, label, own in zip(answers, expected, kinds, strict=True)
            if own == kind
        ]
        scores[kind] = ConformalScores(
            {
                method: tuple(sorted(nonconformity(method, probs, right) for probs, right in rows))
                for method in METHODS
            }
        )
    return ConformalSection(prompt_version, option_order, scores)


def coverage_report(
    answers: Sequence[Answer],
    expected: Sequence[str],
    *,
    coverages: Sequence[float] = COVERAGES,
    splits: int = SPLITS,
    seed: int = 0,
) -> dict[str, dict[str, dict[str, float]]]:
    """Per coverage asked and method: the share of held-out questions whose set held the
    right option, the mean set size, and how often the set was one option, averaged over
    `splits` random halves (calibrate on one, answer the other)."""
    rows = [_labelled(answer, label) for answer, label in zip(answers, expected, strict=True)]
    rng = np.random.default_rng(seed)
    report: dict[str, dict[str, dict[str, float]]] = {}
    for coverage in coverages:
        per_method: dict[str, dict[str, float]] = {}
        for method in METHODS:
            covered = sizes = singletons = count = 0
            for _ in range(splits):
                order = rng.permutation(len(rows))
                half = len(rows) // 2
                held = sorted(nonconformity(method, *rows[i]) for i in order[:half])
                limit = threshold(held, coverage)
                for index in order[half:]:
                    probabilities, right = rows[index]
                    members = prediction_set(method, probabilities, limit)
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
