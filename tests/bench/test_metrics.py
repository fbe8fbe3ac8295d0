"""Benchmark metrics against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.metrics import (
    Answer,
    accuracy,
    brier_score,
    latency_summary,
    percentile,
    top_label_ece,
    validate_answer,
)

LABELS = ("yes", "no")


def test_valid_answer_maps_labels_to_probabilities() -> None:
    answer = validate_answer(LABELS, ["no", "yes"], [0.3, 0.7])
    assert answer == Answer({"no": 0.3, "yes": 0.7})
    assert answer.top == ("yes", 0.7)


@pytest.mark.parametrize(
    ("option_ids", "probabilities"),
    [
        (["yes", "maybe"], [0.5, 0.5]),  # a label the task does not have
        (["yes"], [1.0]),  # a label missing
        (["yes", "no", "maybe"], [0.5, 0.5, 0.0]),  # an extra label
        (["yes", "yes"], [0.5, 0.5]),  # duplicate ids
        (["yes", "no"], [0.5]),  # lengths differ
        (["yes", "no"], [0.6, 0.4 + 2e-3]),  # sum off by more than 1e-3
        (["yes", "no"], [math.nan, 1.0]),
        (["yes", "no"], [1.2, -0.2]),
    ],
)
def test_invalid_answers_are_rejected(option_ids: list[str], probabilities: list[float]) -> None:
    assert validate_answer(LABELS, option_ids, probabilities) is None


def test_sum_within_tolerance_is_valid() -> None:
    assert validate_answer(LABELS, ["yes", "no"], [0.6, 0.4 + 9e-4]) is not None


def test_top_label_ties_go_to_the_first_label() -> None:
    assert Answer({"b": 0.5, "a": 0.5}).top == ("b", 0.5)


def test_accuracy_counts_invalid_answers_as_wrong() -> None:
    answers = [Answer({"yes": 0.7, "no": 0.3}), None, Answer({"yes": 0.4, "no": 0.6})]
    assert accuracy(answers, ["yes", "yes", "no"]) == pytest.approx(2 / 3)
    assert accuracy(answers, ["no", "no", "no"]) == pytest.approx(1 / 3)
    assert math.isnan(accuracy([], []))


def test_brier_is_mean_squared_error_over_valid_answers() -> None:
    answers = [
        Answer({"yes": 0.8, "no": 0.2}),  # expected yes: 0.2^2 + 0.2^2 = 0.08
        Answer({"a": 0.5, "b": 0.3, "c": 0.2}),  # expected b: 0.25 + 0.49 + 0.04 = 0.78
        None,  # invalid: no distribution to score
    ]
    assert brier_score(answers, ["yes", "b", "a"]) == pytest.approx(0.43)
    assert math.isnan(brier_score([None], ["a"]))


def test_top_label_ece_over_ten_bins() -> None:
    answers = [
        Answer({"yes": 0.95, "no": 0.05}),  # bin 9, correct
        Answer({"yes": 0.95, "no": 0.05}),  # bin 9, wrong
        Answer({"yes": 0.55, "no": 0.45}),  # bin 5, correct
        Answer({"yes": 0.35, "no": 0.65}),  # bin 6 (top label "no"), wrong
    ]
    expected = ["yes", "no", "yes", "yes"]
    # bin 9: 2/4 * |0.5 - 0.95| = 0.225; bin 5: 1/4 * |1 - 0.55| = 0.1125;
    # bin 6: 1/4 * |0 - 0.65| = 0.1625
    assert top_label_ece(answers, expected) == pytest.approx(0.5)


def test_confidence_of_one_falls_in_the_last_bin() -> None:
    assert top_label_ece([Answer({"yes": 1.0, "no": 0.0})], ["yes"]) == pytest.approx(0.0)
    assert top_label_ece([Answer({"yes": 1.0, "no": 0.0})], ["no"]) == pytest.approx(1.0)


def test_percentiles_interpolate_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 95) == pytest.approx(3.85)  # rank 2.85: 3 + 0.85 * (4 - 3)
    samples = [0.31, 0.12, 0.5, 0.77, 0.2, 1.9, 0.4]
    for q in (50, 95, 99):
        assert percentile(samples, q) == pytest.approx(float(np.percentile(samples, q)))
    assert percentile([0.2], 99) == 0.2
    assert math.isnan(percentile([], 50))


def test_latency_summary_keys() -> None:
    summary = latency_summary([0.1, 0.2, 0.3])
    assert summary == pytest.approx({"p50": 0.2, "p95": 0.29, "p99": 0.298, "max": 0.3})
