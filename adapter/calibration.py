"""The calibration in force: which temperature and position prior a question is read with.

The calibration comes from the model's manifest (format: `model_build.calibration`, fitted
by `semif-calibrate`). It was fitted on distributions read one way, so it is applied only
where a question is read that way:
- the temperature of a question's kind (the decision API's decisions are "choice") applies
  when the question is scored in the option order the calibration was fitted under; a score
  question is scored in its own order in every mode, so its temperature always applies;
- the position prior for the question's option count is divided out in `canonical` mode
  only: `as_given` is the reference behaviour, `debiased` averages positions out itself,
  and an ordinal score question's positions are its levels, not a bias.
A calibration fitted under another prompt version read other prompts: it is refused at
start (`check_calibration`), because a stale calibration is worse than none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.prompts import PROMPT_VERSION
from model_build.calibration import Calibration, OptionOrder, QuestionKind


class CalibrationMismatchError(RuntimeError):
    """The manifest's calibration was fitted for prompts this adapter does not render."""


@dataclass(frozen=True)
class Correction:
    """How one question's combined distribution is corrected."""

    temperature: float = 1.0
    prior: tuple[float, ...] | None = None  # by rendered position
    applied: bool = False  # whether the calibration's temperature is the one used


NONE = Correction()


def check_calibration(calibration: Calibration | None) -> None:
    """At start: refuse a calibration fitted under another prompt version."""
    if calibration is not None and calibration.prompt_version != PROMPT_VERSION:
        raise CalibrationMismatchError(
            f"the manifest's calibration was fitted under prompt version "
            f"{calibration.prompt_version!r}, but this adapter renders {PROMPT_VERSION!r}; "
            "refit it with semif-calibrate against this adapter and rebuild the model "
            "(model-build --calibration FILE), or build without --calibration"
        )


def correction(
    calibration: Calibration | None,
    kind: QuestionKind,
    mode: OptionOrder,
    option_count: int,
) -> Correction:
    """The temperature and prior for a question of `kind` with `option_count` options read
    in `mode` (see the module docstring for when each applies)."""
    if calibration is None:
        return NONE
    ordinal = kind == "score"
    applies = ordinal or mode == calibration.option_order
    prior = calibration.position_prior.get(option_count)
    return Correction(
        temperature=calibration.temperature(kind) if applies else 1.0,
        prior=prior if mode == "canonical" and not ordinal else None,
        applied=applies,
    )


def describe(calibration: Calibration | None, used: Correction) -> dict[str, Any] | None:
    """What a decision result reports of its calibration: which fit (by its task file's
    hash and the order it was fitted under), whether its temperature was applied, the
    temperature used and whether a position prior was divided out."""
    if calibration is None:
        return None
    return {
        "tasks_sha256": calibration.tasks_sha256,
        "option_order": calibration.option_order,
        "applied": used.applied,
        "temperature": used.temperature,
        "position_prior": used.prior is not None,
    }
