"""`semif-calibrate`'s multi-label data: the labelled tasks read as multi-label questions.

The labelled tasks have one right option each, so each choice task is also a multi-label
question whose right option applies and whose others do not (one-hot labels: the model is
asked of every option alone whether it applies, adapter.multi_label). Every (task, option)
pair is a yes/no judgement: `pairs` gives them as the two-answer rows [z, 0] (z the
log-odds) that bench.calibrate's temperature search reads, so the `multi_label`
temperature is fitted by the same bounded NLL search as the other kinds'.

The conformal scores are label-conditional (Mondrian on "applies"): the right option's
"applies" score (model_build.conformal.applies_score) under a temperature fitted on the
other folds (`rows`, then bench.conformal_fit with `each_alone`). A set at coverage c then
holds each applicable option with probability at least c, whatever share of the options
apply. A real multi-label task file would fit the same way, pair by pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from adapter.readout import applies_probabilities
from bench.conformal_fit import Row

Vector = npt.NDArray[np.float64]


@dataclass(frozen=True)
class AppliesTask:
    """One task read as multi-label: each option's log-odds and the option that applies."""

    log_odds: Vector
    applies: int


def pairs(tasks: Sequence[AppliesTask]) -> tuple[list[Vector], list[int]]:
    """Every (task, option) judgement as the row [z, 0] and its label (0: the option
    applies; 1: it does not)."""
    rows: list[Vector] = []
    labels: list[int] = []
    for task in tasks:
        for index, value in enumerate(task.log_odds):
            rows.append(np.array([value, 0.0]))
            labels.append(0 if index == task.applies else 1)
    return rows, labels


def rows(tasks: Sequence[AppliesTask], temperatures: Sequence[float]) -> list[Row]:
    """Each task's served probabilities under its own temperature (one fitted without it),
    with the index of the option that applies: bench.conformal_fit's rows."""
    return [
        (
            [float(p) for p in applies_probabilities(task.log_odds, temperature=temperature)],
            task.applies,
        )
        for task, temperature in zip(tasks, temperatures, strict=True)
    ]
