"""From a full-vocabulary logit vector to probabilities over the declared answer slots.

Kept free of llama.cpp so the arithmetic (stable softmax, allowed-token mass, finiteness)
is testable on its own and shared by every API that scores options.
"""

from __future__ import annotations

from collections.abc import Sequence
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


def read_slots(logits: npt.NDArray[np.float32], slot_token_ids: Sequence[int]) -> SlotReadout:
    """Restrict `logits` to `slot_token_ids` and report how much mass the slots held."""
    full = logits.astype(np.float64)
    if not np.isfinite(full).all():
        raise NonFiniteLogitsError("the model returned NaN or infinite logits")
    slots = full[list(slot_token_ids)]
    top = float(full.max())
    log_total = top + float(np.log(np.exp(full - top).sum()))
    slot_mass = float(np.exp(slots - log_total).sum())
    return SlotReadout(
        option_logits=[float(value) for value in slots],
        probabilities=[float(value) for value in softmax(slots)],
        allowed_token_mass=min(1.0, slot_mass),
        top_token_id=int(full.argmax()),
    )
