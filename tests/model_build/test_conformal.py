"""Split conformal prediction sets (model_build.conformal): the coverage promise on synthetic
exchangeable data, order invariance, and the calibration file's section."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from model_build.calibration import CalibrationError, parse_calibration
from model_build.conformal import (
    METHODS,
    ConformalMethod,
    applies_score,
    applies_set,
    fewest_scores,
    nonconformity,
    prediction_set,
    threshold,
)
from tests.support.templates import REPO, VALID_CALIBRATION

OPTIONS = 4
CALIBRATION_QUESTIONS = 200
TEST_QUESTIONS = 200
SPLITS = 300


def _questions(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A model's distributions over 4 options and the right options, drawn from a sharper
    distribution than the model's: a miscalibrated model, which conformal sets must not
    need to be right about."""
    logits = rng.normal(0.0, 1.5, size=(count, OPTIONS))
    served = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    truth = np.exp(2 * logits) / np.exp(2 * logits).sum(axis=1, keepdims=True)
    labels = np.array([rng.choice(OPTIONS, p=row) for row in truth])
    return served, labels


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("coverage", [0.8, 0.9])
def test_sets_cover_at_least_what_they_promise_and_not_much_more(
    method: ConformalMethod, coverage: float
) -> None:
    """Over many random calibration sets, the mean coverage lies in [1 - alpha,
    1 - alpha + 1/(n+1)] (split conformal with continuous scores) give or take a sampling
    margin: 4 standard deviations of the mean over the splits, whose variance is the
    threshold's (alpha(1 - alpha)/(n + 2) per split, the coverage of a calibration set of n
    being Beta distributed) plus the test questions' (alpha(1 - alpha)/test per split)."""
    rng = np.random.default_rng(int(coverage * 100) + len(method))
    alpha = 1 - coverage
    covered = []
    for _ in range(SPLITS):
        served, labels = _questions(rng, CALIBRATION_QUESTIONS + TEST_QUESTIONS)
        held = sorted(
            nonconformity(method, list(served[i]), int(labels[i]))
            for i in range(CALIBRATION_QUESTIONS)
        )
        limit = threshold(held, coverage)
        hits = [
            int(labels[i]) in prediction_set(method, list(served[i]), limit)
            for i in range(CALIBRATION_QUESTIONS, CALIBRATION_QUESTIONS + TEST_QUESTIONS)
        ]
        covered.append(sum(hits) / len(hits))
    mean = float(np.mean(covered))
    variance = alpha * (1 - alpha) * (1 / (CALIBRATION_QUESTIONS + 2) + 1 / TEST_QUESTIONS)
    margin = 4 * math.sqrt(variance / SPLITS)
    assert 1 - alpha - margin <= mean <= 1 - alpha + 1 / (CALIBRATION_QUESTIONS + 1) + margin


def _applicable(rng: np.random.Generator, count: int) -> np.ndarray:
    """The served probabilities of `count` options that do apply, drawn from many options
    judged alone by a miscalibrated model (the truth is sharper than what it serves), about
    a fifth of which apply: the imbalance a multi-label question has."""
    found: list[float] = []
    while len(found) < count:
        logits = rng.normal(-1.5, 1.5, size=4 * count)
        served = 1 / (1 + np.exp(-logits))
        applies = rng.uniform(size=logits.size) < 1 / (1 + np.exp(-2 * logits))
        found.extend(float(p) for p in served[applies])
    return np.array(found[:count])


@pytest.mark.parametrize("method", METHODS)
def test_multi_label_sets_hold_each_applicable_option_as_promised(
    method: ConformalMethod,
) -> None:
    """Label-conditional sets (fitted on the options that apply) hold an applicable option
    with at least the coverage asked, whatever share of options apply; LAC's continuous
    scores also stay within 1/(n+1) of it (the bound and margin above). APS's "applies"
    score ties at 1 for every option under even odds, so only its lower bound holds."""
    rng = np.random.default_rng(len(method))
    coverage, alpha = 0.9, 0.1
    covered = []
    for _ in range(SPLITS):
        served = _applicable(rng, CALIBRATION_QUESTIONS + TEST_QUESTIONS)
        held = sorted(applies_score(method, p) for p in served[:CALIBRATION_QUESTIONS])
        members = applies_set(
            method, list(served[CALIBRATION_QUESTIONS:]), threshold(held, coverage)
        )
        covered.append(len(members) / TEST_QUESTIONS)
    mean = float(np.mean(covered))
    variance = alpha * (1 - alpha) * (1 / (CALIBRATION_QUESTIONS + 2) + 1 / TEST_QUESTIONS)
    margin = 4 * math.sqrt(variance / SPLITS)
    assert mean >= coverage - margin
    if method == "lac":
        assert mean <= coverage + 1 / (CALIBRATION_QUESTIONS + 1) + margin


def test_a_set_depends_on_the_probabilities_not_the_options_order() -> None:
    rng = np.random.default_rng(5)
    for _ in range(50):
        probabilities = list(rng.dirichlet(np.ones(6)))
        permutation = list(rng.permutation(6))
        moved = [probabilities[i] for i in permutation]
        for method in METHODS:
            limit = float(rng.uniform(0.2, 0.95))
            first = set(prediction_set(method, probabilities, limit))
            second = {permutation[i] for i in prediction_set(method, moved, limit)}
            assert first == second


def test_the_scores_and_thresholds_by_hand() -> None:
    probabilities = [0.5, 0.3, 0.2]
    assert nonconformity("lac", probabilities, 1) == pytest.approx(0.7)
    assert nonconformity("aps", probabilities, 1) == pytest.approx(0.8)  # 0.5 + 0.3
    assert nonconformity("aps", [0.4, 0.4, 0.2], 1) == pytest.approx(0.8)  # ties go together
    scores = [0.1, 0.2, 0.3, 0.4]  # n = 4: coverage 0.6 takes the ceil(5 x 0.6) = 3rd
    assert threshold(scores, 0.6) == 0.3
    assert threshold(scores, 0.9) is None  # ceil(4.5) = 5 > 4: too few to leave any out
    assert prediction_set("lac", probabilities, None) == [0, 1, 2]
    assert prediction_set("lac", probabilities, 0.6) == [0]
    assert prediction_set("aps", probabilities, 0.8) == [0, 1]
    assert fewest_scores(0.9) == 9  # with 9 scores, ceil(10 x 0.9) = 9 <= 9
    assert threshold([0.5] * 9, 0.9) == 0.5


def _with_conformal(section: Any) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((REPO / VALID_CALIBRATION).read_text())
    document["conformal"] = section
    return document


SECTION = {
    "letters": {
        "prompt_version": "semif-direct-options/1",
        "option_order": "canonical",
        "scores": {"choice": {"lac": [0.1, 0.4], "aps": [0.5, 0.9]}},
    }
}


def test_the_section_round_trips_and_a_file_without_it_is_unchanged() -> None:
    plain = parse_calibration(json.loads(open(VALID_CALIBRATION).read()))  # noqa: SIM115
    assert "conformal" not in plain.to_document()
    fitted = parse_calibration(_with_conformal(SECTION))
    assert fitted.conformal["letters"].scores["choice"].by_method["lac"] == (0.1, 0.4)
    again = parse_calibration(json.loads(fitted.to_json()))
    assert again == fitted
    assert again.to_document()["conformal"] == SECTION


UNSORTED = {"lac": [0.4, 0.1], "aps": [0.5]}
OUT_OF_RANGE = {"lac": [1.5], "aps": [0.5]}


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"logits": SECTION["letters"]}, r"conformal\.logits: not a readout"),
        (
            {"letters": {**SECTION["letters"], "option_order": "sideways"}},
            r"letters\.option_order",
        ),
        (
            {
                "letters": {
                    **SECTION["letters"],
                    "scores": {"choice": {"lac": [0.4, 0.1], "aps": [0.5]}},
                }
            },
            r"lac: scores must be sorted ascending",
        ),
        (
            {"letters": {**SECTION["letters"], "scores": {"choice": {"lac": [0.1]}}}},
            r"scores\.choice: expected the scores of lac, aps",
        ),
        (
            {"letters": {**SECTION["letters"], "scores": {"choice": OUT_OF_RANGE}}},
            r"expected 1\.\.100000 scores, numbers in 0\.\.1",
        ),
    ],
)
def test_a_bad_section_is_refused_by_field(section: Any, message: str) -> None:
    with pytest.raises(CalibrationError, match=message):
        parse_calibration(_with_conformal(section))
