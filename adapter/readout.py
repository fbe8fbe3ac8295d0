"""From a full-vocabulary logit vector to probabilities over the declared answer slots.

Kept free of llama.cpp so the arithmetic (stable softmax, allowed-token mass, finiteness)
is testable on its own and shared by every API that scores options.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

READOUT = "last-position logits restricted to the declared answer letters; no generated tokens"


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


def log_probabilities(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    """Full-vocabulary log-softmax, refusing NaN or infinite logits."""
    full = logits.astype(np.float64)
    if not np.isfinite(full).all():
        raise NonFiniteLogitsError("the model returned NaN or infinite logits")
    top = full.max()
    result: npt.NDArray[np.float64] = full - (top + np.log(np.exp(full - top).sum()))
    return result


def read_labels(
    logits: npt.NDArray[np.float32],
    next_logits: Mapping[int, npt.NDArray[np.float32]],
    labels: Sequence[tuple[int, ...]],
    temperature: float = 1.0,
) -> SlotReadout:
    """Probabilities of whole labels of one or two tokens, restricted to the declared ones.

    A one-token label scores like a letter (`read_slots`). A two-token label (a, b) has the
    exact model probability P(a) * P(b | a), with P(b | a) from the logits after `a`
    (`next_logits[a]`); the declared labels' probabilities are then renormalised, and
    `option_logits` holds their joint log-probabilities. `temperature` is the model's
    calibration (from its manifest): probabilities are softmax(scores / temperature).
    """
    if all(len(label) == 1 for label in labels):
        return read_slots(logits, [label[0] for label in labels], temperature)
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
        probabilities=[float(value) for value in softmax(joint / temperature)],
        allowed_token_mass=min(1.0, float(np.exp(joint).sum())),
        top_token_id=int(first.argmax()),
    )


def read_slots(
    logits: npt.NDArray[np.float32], slot_token_ids: Sequence[int], temperature: float = 1.0
) -> SlotReadout:
    """Restrict `logits` to `slot_token_ids` and report how much mass the slots held.

    The mass is the uncalibrated model's; only the probabilities use `temperature`."""
    log_p = log_probabilities(logits)
    ids = list(slot_token_ids)
    slots = logits[ids].astype(np.float64)
    return SlotReadout(
        option_logits=[float(value) for value in slots],
        probabilities=[float(value) for value in softmax(slots / temperature)],
        allowed_token_mass=min(1.0, float(np.exp(log_p[ids]).sum())),
        top_token_id=int(log_p.argmax()),
    )
