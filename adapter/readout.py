"""From a full-vocabulary logit vector to probabilities over the declared answer slots.

Kept free of llama.cpp so the arithmetic (stable softmax, allowed-token mass, finiteness)
is testable on its own and shared by every API that scores options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


class NonFiniteLogitsError(ArithmeticError):
    """The model produced NaN or infinite logits, which no probability can be read from."""


@dataclass(frozen=True)
class SlotReadout:
    """Scores of one prompt's answer slots, in the order the options were declared."""

    option_logits: list[float]
    probabilities: list[float]
    allowed_token_mass: float
    top_token_id: int


def softmax(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Softmax with the maximum subtracted, so large logits cannot overflow."""
    shifted = np.exp(values - values.max())
    result: npt.NDArray[np.float64] = shifted / shifted.sum()
    return result


def log_softmax(scores: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Normalised log-probabilities of scores (logits or joint log-probabilities), computed
    in log space so a distribution with underflowing entries keeps them finite."""
    top = scores.max()
    result: npt.NDArray[np.float64] = scores - (top + np.log(np.exp(scores - top).sum()))
    return result


def log_mean(rows: Sequence[npt.NDArray[np.float64]]) -> npt.NDArray[np.float64]:
    """log of the mean of several distributions given as log-probabilities: the arithmetic
    average of the probabilities, without leaving log space."""
    stacked = np.stack(list(rows))
    top = stacked.max(axis=0)
    result: npt.NDArray[np.float64] = (
        top + np.log(np.exp(stacked - top).sum(axis=0)) - np.log(len(stacked))
    )
    return result


def corrected(
    log_probs: npt.NDArray[np.float64],
    *,
    temperature: float = 1.0,
    prior: Sequence[float] | None = None,
) -> npt.NDArray[np.float64]:
    """Probabilities after calibration: the position `prior` divided out (PriDe: what the
    model observed is prior x content, renormalised), then the temperature applied to the
    log of what is left. Both act on a distribution, not on raw logits, so the same
    temperature is defined in every option-order mode, and a temperature fitted on served
    probabilities is the temperature to serve."""
    scores = log_probs if prior is None else log_probs - np.log(np.asarray(prior, np.float64))
    return softmax(scores / temperature)


def applies_probabilities(
    log_odds: npt.ArrayLike, *, temperature: float = 1.0
) -> npt.NDArray[np.float64]:
    """Each option's own probability of applying, from its log-odds (applies against not),
    the temperature dividing them: option by option, so no option moves another's. The
    same as `corrected` over the two answers of one option's prompt."""
    scaled = np.asarray(log_odds, np.float64) / temperature
    tail = np.exp(-np.abs(scaled))  # the logistic function, never overflowing
    result: npt.NDArray[np.float64] = np.where(scaled >= 0, 1 / (1 + tail), tail / (1 + tail))
    return result


def log_probabilities(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Full-vocabulary log-softmax, refusing NaN or infinite logits."""
    full = logits.astype(np.float64)
    if not np.isfinite(full).all():
        raise NonFiniteLogitsError("the model returned NaN or infinite logits")
    return log_softmax(full)


def read_labels(
    logits: npt.NDArray[np.float32],
    next_logits: Mapping[int, npt.NDArray[np.float32]],
    labels: Sequence[tuple[int, ...]],
) -> SlotReadout:
    """Probabilities of whole labels of one or two tokens, restricted to the declared ones.

    A one-token label scores like a letter (`read_slots`). A two-token label (a, b) has the
    exact model probability P(a) * P(b | a), with P(b | a) from the logits after `a`
    (`next_logits[a]`); the declared labels' probabilities are then renormalised, and
    `option_logits` holds their joint log-probabilities. Uncalibrated: the calibration acts
    on the distribution combined over an option order's prompts (`corrected`).
    """
    if all(len(label) == 1 for label in labels):
        return read_slots(logits, [label[0] for label in labels])
    if any(len(label) > 2 for label in labels):
        raise ValueError("labels of more than two tokens cannot be scored")
    first = log_probabilities(logits)
    firsts = {label[0] for label in labels if len(label) == 2}
    second = {token: log_probabilities(next_logits[token]) for token in firsts}
    joint = np.array(
        [
            first[label[0]] + (second[label[0]][label[1]] if len(label) == 2 else 0.0)
            for label in labels
        ]
    )
    return SlotReadout(
        option_logits=[float(value) for value in joint],
        probabilities=[float(value) for value in softmax(joint)],
        allowed_token_mass=min(1.0, float(np.exp(joint).sum())),
        top_token_id=int(first.argmax()),
    )


def read_slots(logits: npt.NDArray[np.float32], slot_token_ids: Sequence[int]) -> SlotReadout:
    """Restrict `logits` to `slot_token_ids` and report how much mass the slots held."""
    log_p = log_probabilities(logits)
    ids = list(slot_token_ids)
    slots = logits[ids].astype(np.float64)
    return SlotReadout(
        option_logits=[float(value) for value in slots],
        probabilities=[float(value) for value in softmax(slots)],
        allowed_token_mass=min(1.0, float(np.exp(log_p[ids]).sum())),
        top_token_id=int(log_p.argmax()),
    )
