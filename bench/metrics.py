"""Scoring a benchmark run: answer validity, accuracy, Brier score, top-label ECE, latency.

Pure functions over plain values, so each figure can be checked by hand. The validity rule
is strict on purpose: an answer whose probabilities do not cover exactly the task's labels,
or do not sum to 1 within SUM_TOLERANCE, is invalid and counts as wrong, because a client
could not act on it. Brier and ECE are computed over valid answers only (an invalid answer
has no distribution to score); the invalid count is always reported next to them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SUM_TOLERANCE = 1e-3
ECE_BINS = 10


@dataclass(frozen=True)
class Answer:
    """A valid answer: one probability per label."""

    probabilities: Mapping[str, float]

    @property
    def top(self) -> tuple[str, float]:
        """The argmax label and its probability; ties go to the first label given."""
        label = max(self.probabilities, key=lambda key: self.probabilities[key])
        return label, self.probabilities[label]


def validate_answer(
    labels: Sequence[str],
    option_ids: Sequence[str],
    probabilities: Sequence[float],
    *,
    distribution: bool = True,
) -> Answer | None:
    """Return the answer if it covers exactly `labels` with a proper distribution (or, not
    `distribution`: a multi-label answer, each option's own probability), else None."""
    if len(option_ids) != len(probabilities) or len(set(option_ids)) != len(option_ids):
        return None
    if set(option_ids) != set(labels) or len(option_ids) != len(labels):
        return None
    if not all(math.isfinite(p) and 0.0 <= p <= 1.0 for p in probabilities):
        return None
    if distribution and abs(math.fsum(probabilities) - 1.0) > SUM_TOLERANCE:
        return None
    return Answer(dict(zip(option_ids, probabilities, strict=True)))


def accuracy(answers: Sequence[Answer | None], expected: Sequence[str]) -> float:
    """Share of tasks whose argmax equals the expected label; invalid answers are wrong."""
    if not expected:
        return math.nan
    correct = sum(
        1
        for answer, label in zip(answers, expected, strict=True)
        if answer is not None and answer.top[0] == label
    )
    return correct / len(expected)


def _valid_pairs(
    answers: Sequence[Answer | None], expected: Sequence[str]
) -> list[tuple[Answer, str]]:
    return [
        (answer, label)
        for answer, label in zip(answers, expected, strict=True)
        if answer is not None
    ]


def brier_score(answers: Sequence[Answer | None], expected: Sequence[str]) -> float:
    """Multi-class Brier score (0 best, 2 worst): mean of sum_k (p_k - onehot_k)^2."""
    pairs = _valid_pairs(answers, expected)
    if not pairs:
        return math.nan
    total = math.fsum(
        math.fsum(
            (p - (1.0 if label == wanted else 0.0)) ** 2
            for label, p in answer.probabilities.items()
        )
        for answer, wanted in pairs
    )
    return total / len(pairs)


def log_loss(answers: Sequence[Answer | None], expected: Sequence[str]) -> float:
    """Mean negative log-probability of the expected label over valid answers (a zero
    probability counts as 1e-12, so one confident miss cannot make it infinite)."""
    pairs = _valid_pairs(answers, expected)
    if not pairs:
        return math.nan
    return math.fsum(
        -math.log(max(answer.probabilities.get(label, 0.0), 1e-12)) for answer, label in pairs
    ) / len(pairs)


def top_label_ece(
    answers: Sequence[Answer | None], expected: Sequence[str], bins: int = ECE_BINS
) -> float:
    """Expected calibration error of the top label over equal-width confidence bins.

    Bin b holds confidences in [b/bins, (b+1)/bins); a confidence of exactly 1 falls in the
    last bin. ECE = sum_b (n_b / n) * |accuracy_b - mean confidence_b|.
    """
    pairs = _valid_pairs(answers, expected)
    if not pairs:
        return math.nan
    counts = [0] * bins
    confidence_sums = [0.0] * bins
    correct_sums = [0] * bins
    for answer, wanted in pairs:
        label, confidence = answer.top
        index = min(int(confidence * bins), bins - 1)
        counts[index] += 1
        confidence_sums[index] += confidence
        correct_sums[index] += label == wanted
    return math.fsum(
        abs(correct_sums[b] - confidence_sums[b]) / len(pairs) for b in range(bins) if counts[b]
    )


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks
    (numpy's default), so reports agree with anyone re-computing from the raw samples."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p95/p99/max of client latencies, in seconds."""
    return {
        "p50": percentile(seconds, 50),
        "p95": percentile(seconds, 95),
        "p99": percentile(seconds, 99),
        "max": max(seconds) if seconds else math.nan,
    }
