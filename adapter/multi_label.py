"""Multi-label questions: each option judged on its own as applying or not.

A decision of kind `multi_label` (System One: type `multi`) is asked once per option: the
state and the question, then that option alone, "does this option apply?", read at the
answer slot as A (applies) against B (does not) (adapter.prompts.multi_label_messages;
adapter.question_work.MultiLabelWork). Every option's prompt is a branch of the shared
state, so the state is decoded once; and since no prompt shows another option, adding or
removing an option cannot move any other option's probability (bit for bit on the exact
path: tests/adapter/test_multi_label.py). The probabilities need not sum to 1; the
calibration's `multi_label` temperature divides each option's log-odds.

What an answer says beside the probabilities (pure, no model):
- `thresholds`: each option's, from the request (adapter.schema.DEFAULT_THRESHOLD when it
  sets none), and `applies`: the options at or above theirs, in the caller's order;
- `none_probability`: that no option applies, the product of each one's probability of not
  applying (the options read as independent: an estimate, not a separate question);
- `confidence`: the least decided option's max(p, 1 - p), what `min_confidence` gates on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from adapter.schema import DEFAULT_THRESHOLD, Decision

READOUT_DETAIL = (
    "each option asked alone whether it applies: its prompt's last-position logits "
    "restricted to A (applies) and B (does not); no generated tokens"
)


def thresholds(decision: Decision) -> list[float]:
    """Each option's threshold, the default where the request set none."""
    return [
        DEFAULT_THRESHOLD if option.threshold is None else option.threshold
        for option in decision.options
    ]


def confidence(probabilities: Sequence[float]) -> float:
    """How decided the least decided option is: 1 when every option is surely in or out,
    0.5 when one is a coin toss."""
    return min(max(p, 1.0 - p) for p in probabilities)


def answer_fields(decision: Decision, probabilities: Sequence[float]) -> dict[str, Any]:
    """What a multi-label answer adds to its probabilities."""
    limits = thresholds(decision)
    return {
        "kind": "multi_label",
        "thresholds": limits,
        "applies": [
            option.id
            for option, p, limit in zip(decision.options, probabilities, limits, strict=True)
            if p >= limit
        ],
        "none_probability": math.prod(1.0 - p for p in probabilities),
    }
