"""Split conformal prediction sets: the calibration file's `conformal` section and its math.

A prediction set holds the right option with probability at least the coverage asked for,
whatever the model, provided the questions served are exchangeable with the labelled ones
the section was fitted on (Angelopoulos & Bates, "A Gentle Introduction to Conformal
Prediction", section 1; docs/decision-quality.md says what that does and does not promise).
Fitting keeps each labelled question's nonconformity score, the score of its right option
under the distribution the adapter serves; serving at coverage 1 - alpha takes the
ceil((n + 1)(1 - alpha))-th smallest of the n scores as the threshold and puts in the set
every option scoring at most that. Keeping the sorted scores (not quantiles at fixed alphas)
lets a request ask for any coverage.

Two scores (`METHODS`):
- `lac` (least ambiguous classifier): 1 - p(option). The smallest sets on average; a set may
  be empty when the model is confident in a wrong option.
- `aps` (adaptive prediction sets, without randomization): the probability of every option at
  least as likely as this one, this one included. Sets grow where the model is unsure and
  are never empty; a little larger on average.
Both depend on the probabilities alone, never on the options' order: a permutation of the
options permutes the set with them. Equal probabilities are treated alike (ties go in or out
together).

Format (inside the calibration file, model_build.calibration; docs/manifest.md):
    "conformal": {"letters": {"prompt_version": "semif-direct-options/1",
                              "option_order": "canonical",
                              "scores": {"choice": {"lac": [0.02, ...], "aps": [...]}}},
                  "likelihood:mean": {...}}
keyed by readout (`letters`, or `likelihood:<normalization>`), each fitted under one prompt
version and option order, with the sorted scores per question kind and method. The
`multi_label` kind (letters only) keeps one score per option that applies (`applies_score`):
its set is the options whose "applies" is within the threshold, whatever the order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

ConformalMethod = Literal["lac", "aps"]
METHODS: tuple[ConformalMethod, ...] = ("lac", "aps")
MAX_SCORES = 100_000  # held-out questions a section keeps per kind and method


class ConformalError(ValueError):
    """The conformal section is not valid; the message names the field."""


def nonconformity(method: ConformalMethod, probabilities: Sequence[float], label: int) -> float:
    """How unusual option `label` is under `probabilities` (higher: less likely to be right)."""
    mine = probabilities[label]
    if method == "lac":
        return 1.0 - mine
    return math.fsum(p for p in probabilities if p >= mine)


def applies_score(method: ConformalMethod, probability: float) -> float:
    """How unusual "applies" is for a multi-label option the model gives `probability` of
    applying: the option's own two answers scored like any distribution's. Fitted on the
    options that do apply only (label-conditional, Mondrian), so the set's promise is about
    them: each applicable option is in it with at least the coverage asked for."""
    return nonconformity(method, (probability, 1.0 - probability), 0)


def _rank(count: int, coverage: float) -> int:
    """Which of `count` sorted scores is the threshold at `coverage` (1-based)."""
    return math.ceil((count + 1) * coverage)


def threshold(scores: Sequence[float], coverage: float) -> float | None:
    """The largest score a set admits at `coverage`, from the sorted held-out `scores`; None
    when there are too few of them to promise it (every option then goes in the set)."""
    rank = _rank(len(scores), coverage)
    return scores[rank - 1] if rank <= len(scores) else None


def prediction_set(
    method: ConformalMethod, probabilities: Sequence[float], limit: float | None
) -> list[int]:
    """The indexes of the options whose score is at most `limit` (all of them for None)."""
    return [
        index
        for index in range(len(probabilities))
        if limit is None or nonconformity(method, probabilities, index) <= limit
    ]


def applies_set(
    method: ConformalMethod, probabilities: Sequence[float], limit: float | None
) -> list[int]:
    """A multi-label question's set (`probabilities` each an option's own): the indexes of
    the options whose "applies" scores at most `limit` (all of them for None)."""
    return [
        index
        for index, probability in enumerate(probabilities)
        if limit is None or applies_score(method, probability) <= limit
    ]


def set_members(
    method: ConformalMethod,
    probabilities: Sequence[float],
    limit: float | None,
    *,
    each_alone: bool = False,
) -> list[int]:
    """A set's members: `prediction_set`'s, or (`each_alone`, a multi-label question's
    probabilities, each an option's own) `applies_set`'s: the one choice the server and the
    fit's report both make."""
    return (applies_set if each_alone else prediction_set)(method, probabilities, limit)


def fewest_scores(coverage: float) -> int:
    """The held-out questions needed before a set at `coverage` can leave an option out:
    about coverage / (1 - coverage), settled by the threshold's own rule (no rounding slip)."""
    count = max(math.floor(coverage / (1 - coverage)) - 1, 1)
    while _rank(count, coverage) > count:
        count += 1
    return count


@dataclass(frozen=True)
class ConformalScores:
    """The sorted held-out scores of one question kind, per method."""

    by_method: dict[ConformalMethod, tuple[float, ...]]

    @property
    def count(self) -> int:
        return min(len(scores) for scores in self.by_method.values())


@dataclass(frozen=True)
class ConformalSection:
    """One readout's scores, fitted under `prompt_version` and `option_order`."""

    prompt_version: str
    option_order: str
    scores: dict[str, ConformalScores]  # by question kind

    def to_document(self) -> dict[str, Any]:
        return {
            "prompt_version": self.prompt_version,
            "option_order": self.option_order,
            "scores": {
                kind: {method: list(values) for method, values in fitted.by_method.items()}
                for kind, fitted in self.scores.items()
            },
        }


def parse_conformal(
    section: Mapping[str, Any],
    where: str,
    *,
    readouts: Sequence[str],
    kinds: Sequence[str],
    orders: Sequence[str],
) -> dict[str, ConformalSection]:
    """Validate the `conformal` section (readout keys, kinds and option orders named by the
    calibration format that holds it); raises `ConformalError` naming the field."""
    parsed: dict[str, ConformalSection] = {}
    for readout, entry in section.items():
        path = f"{where}.{readout}"
        if readout not in readouts:
            raise ConformalError(f"{path}: not a readout ({', '.join(readouts)})")
        if not isinstance(entry, Mapping):
            raise ConformalError(f"{path}: expected an object")
        version = entry.get("prompt_version")
        if not isinstance(version, str) or not version:
            raise ConformalError(f"{path}.prompt_version: required, a non-empty string")
        order = entry.get("option_order")
        if order not in orders:
            raise ConformalError(f"{path}.option_order: {order!r} is not one of {orders}")
        scores = entry.get("scores")
        if not isinstance(scores, Mapping) or not scores:
            raise ConformalError(f"{path}.scores: expected an object of question kinds")
        by_kind: dict[str, ConformalScores] = {}
        for kind, methods in scores.items():
            if kind not in kinds:
                raise ConformalError(f"{path}.scores.{kind}: not a question kind")
            by_kind[kind] = _scores(methods, f"{path}.scores.{kind}")
        parsed[readout] = ConformalSection(version, str(order), by_kind)
    return parsed


def _scores(methods: object, path: str) -> ConformalScores:
    if not isinstance(methods, Mapping) or set(methods) != set(METHODS):
        raise ConformalError(f"{path}: expected the scores of {', '.join(METHODS)}")
    by_method: dict[ConformalMethod, tuple[float, ...]] = {}
    for method in METHODS:
        values = methods[method]
        if (
            not isinstance(values, list)
            or not 1 <= len(values) <= MAX_SCORES
            or not all(_score(value) for value in values)
        ):
            raise ConformalError(
                f"{path}.{method}: expected 1..{MAX_SCORES} scores, numbers in 0..1"
            )
        if any(later < earlier for earlier, later in pairwise(values)):
            raise ConformalError(f"{path}.{method}: scores must be sorted ascending")
        by_method[method] = tuple(float(value) for value in values)
    return ConformalScores(by_method)


def _score(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= 1 + 1e-9
    )
