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
A question read by likelihood (adapter.likelihood) gets the temperature of the calibration's
`likelihood` section for its normalization and kind, when it has one; no prior (its options
have no positions). A calibration fitted under another prompt version read other prompts:
it is refused at start (`check_calibration`), the likelihood section against the likelihood
prompt this server renders, because a stale calibration is worse than none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adapter.likelihood import Listing
from adapter.prompts import LIKELIHOOD_PROMPT_VERSIONS, PROMPT_VERSION
from model_build.calibration import Calibration, Normalization, OptionOrder, QuestionKind


class CalibrationMismatchError(RuntimeError):
    """The manifest's calibration was fitted for prompts this adapter does not render."""


@dataclass(frozen=True)
class Correction:
    """How one question's combined distribution is corrected."""

    temperature: float = 1.0
    prior: tuple[float, ...] | None = None  # by rendered position
    applied: bool = False  # whether the calibration's temperature is the one used


NONE = Correction()


def check_calibration(calibration: Calibration | None, listing: Listing) -> None:
    """At start: refuse a calibration fitted under another prompt version than this adapter
    renders (its likelihood section: than the likelihood prompt of `listing`)."""
    if calibration is None:
        return
    fitted = [(calibration.prompt_version, PROMPT_VERSION, "")]
    if calibration.likelihood is not None:
        rendered = LIKELIHOOD_PROMPT_VERSIONS[listing]
        fitted.append((calibration.likelihood.prompt_version, rendered, "likelihood "))
    for version, expected, section in fitted:
        if version != expected:
            raise CalibrationMismatchError(
                f"the manifest's {section}calibration was fitted under prompt version "
                f"{version!r}, but this adapter renders {expected!r}; refit it with "
                "semif-calibrate against this adapter and rebuild the model "
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


def likelihood_correction(
    calibration: Calibration | None, kind: QuestionKind, normalization: Normalization
) -> Correction:
    """The temperature a likelihood-read question of `kind` gets under `normalization`."""
    fitted = calibration.likelihood if calibration is not None else None
    temperature = fitted.temperature(normalization, kind) if fitted is not None else None
    return NONE if temperature is None else Correction(temperature=temperature, applied=True)


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
