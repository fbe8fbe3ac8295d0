"""The calibration in force: which temperature and position prior a question is read with.

The calibration comes from the model's manifest (format: `model_build.calibration`, fitted
by `semif-calibrate`). It was fitted on distributions read one way, so it is applied only
where a question is read that way:
- the temperature of a question's kind (the decision API's decisions are "choice", or
  "multi_label") applies when the question is scored in the option order the calibration
  was fitted under; a score question is scored in its own order in every mode, and a
  multi-label question's options each alone, so their temperatures always apply;
- the position prior for the question's option count is divided out in `canonical` mode
  only: `as_given` is the reference behaviour, `debiased` averages positions out itself,
  and an ordinal score question's positions are its levels, not a bias.
- a template prior (the calibration's `template_priors`, Batch Calibration fitted from
  unlabelled traffic by `semif-calibrate --unlabelled`) is divided out, by option id, of a
  nominal question (choice, noul) read by letters whose template key (adapter.template_key)
  and option ids are a fitted template's, in the mode the priors were fitted in; it takes
  the position prior's place, because the mean distribution over a template's inputs
  already holds the bias of the positions its options are shown in. The temperature applies
  after it as above. Not to scores (their levels' skew is usually the truth, e.g. most
  messages neutral), multi-label questions (each option read alone) or likelihood readings
  (the priors are letters' distributions).
A question read by likelihood (adapter.likelihood) gets the temperature of the calibration's
`likelihood` section for its normalization and kind, when it has one; no prior (its options
have no positions). A calibration fitted under another prompt version read other prompts:
it is refused at start (`check_calibration`), the likelihood section against the likelihood
prompt this server renders, because a stale calibration is worse than none.
A question asked with a `coverage` gets a conformal prediction set from the calibration's
`conformal` section for its readout and kind (model_build.conformal), fitted in the option
order it is read in; without one the request is refused before it is scored, never answered
with a set that promises nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from adapter.errors import RequestError
from adapter.likelihood import Listing, ReadoutChoice
from adapter.prompts import LIKELIHOOD_PROMPT_VERSIONS, PROMPT_VERSION
from adapter.schema import Decision
from adapter.template_key import template_key
from model_build.calibration import (
    Calibration,
    Normalization,
    OptionOrder,
    QuestionKind,
    TemplatePrior,
)
from model_build.conformal import (
    ConformalMethod,
    ConformalScores,
    fewest_scores,
    set_members,
    threshold,
)

# Kinds read in one order whatever the mode: a score question's levels in their order, a
# multi-label question's options each alone (its temperature acts on each option's log-odds).
ORDER_FREE_KINDS: tuple[QuestionKind, ...] = ("score", "multi_label")
# Kinds a template prior is divided out of (the module docstring says why not the others).
TEMPLATE_PRIOR_KINDS: tuple[QuestionKind, ...] = ("choice", "noul")


class CalibrationMismatchError(RuntimeError):
    """The manifest's calibration was fitted for prompts this adapter does not render."""


@dataclass(frozen=True)
class Correction:
    """How one question's combined distribution is corrected."""

    temperature: float = 1.0
    prior: tuple[float, ...] | None = None  # by rendered position
    applied: bool = False  # whether the calibration's temperature is the one used
    template: bool = False  # whether `prior` is the question's template prior


NONE = Correction()


def check_calibration(calibration: Calibration | None, listing: Listing) -> None:
    """At start: refuse a calibration fitted under another prompt version than this adapter
    renders (its likelihood section: than the likelihood prompt of `listing`)."""
    if calibration is None:
        return
    rendered = LIKELIHOOD_PROMPT_VERSIONS[listing]
    fitted = [(calibration.prompt_version, PROMPT_VERSION, "")]
    if calibration.likelihood is not None:
        fitted.append((calibration.likelihood.prompt_version, rendered, "likelihood "))
    for readout, conformal in calibration.conformal.items():
        expected = PROMPT_VERSION if readout == "letters" else rendered
        fitted.append((conformal.prompt_version, expected, f"{readout} conformal "))
    for version, expected, name in fitted:
        if version != expected:
            raise CalibrationMismatchError(
                f"the manifest's {name}calibration was fitted under prompt version "
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
    own_order = kind in ORDER_FREE_KINDS
    applies = own_order or mode == calibration.option_order
    prior = calibration.position_prior.get(option_count)
    return Correction(
        temperature=calibration.temperature(kind) if applies else 1.0,
        prior=prior if mode == "canonical" and not own_order else None,
        applied=applies,
    )


def template_prior(
    calibration: Calibration | None, decision: Decision, kind: QuestionKind, mode: OptionOrder
) -> TemplatePrior | None:
    """The fitted prior of this question's template, when one applies: a nominal kind, read
    in the mode the priors were fitted in, its key and option ids the template's."""
    priors = calibration.template_priors if calibration is not None else None
    if priors is None or kind not in TEMPLATE_PRIOR_KINDS or mode != priors.option_order:
        return None
    fitted = priors.templates.get(template_key(decision))
    matches = fitted is not None and fitted.option_ids == tuple(decision.option_ids)
    return fitted if matches else None


def letters_correction(
    calibration: Calibration | None,
    decision: Decision,
    kind: QuestionKind,
    mode: OptionOrder,
    order: Sequence[int],
) -> Correction:
    """`correction` for a question read by letters whose first prompt shows its options in
    `order`, with its template prior (placed by that order) instead of the position prior
    where one applies."""
    fix = correction(calibration, kind, mode, len(decision.options))
    fitted = template_prior(calibration, decision, kind, mode)
    if fitted is None:
        return fix
    by_id = dict(zip(fitted.option_ids, fitted.prior, strict=True))
    placed = tuple(by_id[decision.options[index].id] for index in order)
    return replace(fix, prior=placed, template=True)


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
    temperature used, and whether a position prior or the question's template prior was
    divided out (never both)."""
    if calibration is None:
        return None
    return {
        "tasks_sha256": calibration.tasks_sha256,
        "option_order": calibration.option_order,
        "applied": used.applied,
        "temperature": used.temperature,
        "position_prior": used.prior is not None and not used.template,
        "template_prior": used.template,
    }


def readout_key(choice: ReadoutChoice) -> str:
    """How the conformal section names a readout: `letters`, `likelihood:<normalization>`."""
    return f"likelihood:{choice.normalization}" if choice.likelihood else "letters"


def conformal_scores(
    calibration: Calibration | None, choice: ReadoutChoice, kind: QuestionKind, order: OptionOrder
) -> ConformalScores:
    """The held-out scores a set for this readout, kind and option order is drawn from (a
    multi-label question's, in any order: each option is read alone); a 400 naming what is
    missing when the calibration has none (before anything is scored)."""
    key = readout_key(choice)
    section = calibration.conformal.get(key) if calibration is not None else None
    if section is None or kind not in section.scores:
        raise RequestError(
            "coverage",
            f"the model's calibration has no conformal section for readout {key} and {kind} "
            "questions; fit one with semif-calibrate --conformal and build the model with it "
            "(model-build --calibration FILE), or leave coverage out",
        )
    if section.option_order != order and kind not in ORDER_FREE_KINDS:
        raise RequestError(
            "coverage",
            f"the conformal section for readout {key} was fitted in option order "
            f"{section.option_order}; this request is read in {order} (set option_order)",
        )
    return section.scores[kind]


def prediction_set_fields(
    scores: ConformalScores,
    method: ConformalMethod,
    coverage: float,
    option_ids: Sequence[str],
    probabilities: Sequence[float],
    *,
    each_alone: bool = False,
) -> dict[str, Any]:
    """A result's prediction set (option ids in the caller's order) and what it promises:
    `complete` is true when the calibration held too few questions to leave any option out
    at this coverage (the set is then every option). `each_alone` (a multi-label question:
    `probabilities` each an option's own): the options whose "applies" is within the
    threshold (model_build.conformal.applies_set)."""
    held = scores.by_method[method]
    limit = threshold(held, coverage)
    members = set_members(method, probabilities, limit, each_alone=each_alone)
    return {
        "prediction_set": [option_ids[index] for index in members],
        "set_size": len(members),
        "coverage": coverage,
        "coverage_method": method,
        "conformal": {
            "calibration_questions": len(held),
            "complete": limit is None,
            "needed_questions": fewest_scores(coverage),
        },
    }
