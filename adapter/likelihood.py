"""The likelihood readout: an option scored by the probability of its own words as the answer.

The letter readout (adapter.readout) reads one position: the label that names an option. This
one scores each option's text, followed by the model's end-of-turn token, as the assistant's
whole answer after a prompt that lists the options without labels, in the content-derived
order (adapter.ordering.canonical_order): every permutation renders the same prompt and the
same branches, so the answer is order-invariant by construction, no label alphabet caps the
options, and an option is judged by what it says. The prompt is decoded once; each option is
a branch of it decoded in the same pass (adapter.core.layout, `scored` rows).

Normalizations of the joint log-probability log P(option, end | prompt):
- `sum`: the joint log-probability itself (longer answers pay for every token);
- `mean`: per scored token (length-neutral);
- `pmi`: minus the same option's joint log-probability after a fixed neutral prompt (what
  the model would answer without the question), which depends only on the option's tokens
  and is cached by the service.
The normalized scores are softmaxed over the options. Kept free of llama.cpp and of the
request schema, like adapter.readout.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from adapter.errors import RequestError
from adapter.readout import NonFiniteLogitsError, SlotReadout, softmax
from model_build.calibration import Normalization

Readout = Literal["letters", "likelihood"]
READOUTS: tuple[Readout, ...] = ("letters", "likelihood")
# Whether the likelihood prompt lists the options (adapter.prompts.likelihood_messages).
Listing = Literal["listed", "unlisted"]
LISTINGS: tuple[Listing, ...] = ("listed", "unlisted")
# Options one likelihood question may declare: each is a branch (a KV stream for a pass), so
# the request token budget binds long before this; the cap keeps a request's plan small.
MAX_LIKELIHOOD_OPTIONS = 1024


@dataclass(frozen=True)
class ReadoutChoice:
    """How a question's options are read: letters, or likelihood under a normalization."""

    method: Readout = "letters"
    normalization: Normalization = "mean"

    @property
    def likelihood(self) -> bool:
        return self.method == "likelihood"

    def describe(self) -> str:
        """The sentence a result's `readout_detail` carries."""
        if not self.likelihood:
            return (
                "last-position logits restricted to the declared answer letters; "
                "no generated tokens"
            )
        return (
            "each option's own tokens and the end of the turn scored as the answer after the "
            f"prompt ({self.normalization} of their log-probabilities); no generated tokens"
        )


LETTERS = ReadoutChoice()  # the default readout


def option_tokens(
    branch: Sequence[int], prompt: Sequence[int], path: str, option_id: str
) -> list[int]:
    """The option's tokens where it follows the prompt: the prompt's text plus the option's
    must tokenize as the prompt's tokens, then the option's. A tokenizer that merges across
    that boundary would score tokens the model never sees after this prompt: refused."""
    if list(branch[: len(prompt)]) != list(prompt) or len(branch) == len(prompt):
        raise RequestError(
            path,
            f"option {json.dumps(option_id)} cannot be scored by likelihood: its text does not "
            "tokenize on its own after the prompt (or is empty); reword its start",
        )
    return list(branch[len(prompt) :])


def read_likelihood(
    option_logprobs: Sequence[Sequence[float]],
    choice: ReadoutChoice,
    *,
    neutral: Sequence[float] | None = None,
    top_token_id: int,
    distinct: Sequence[int] | None = None,
) -> SlotReadout:
    """Probabilities over the options from each option's scored tokens' log-probabilities
    (`neutral`: each option's joint log-probability after the neutral prompt, for `pmi`).
    `option_logits` are the normalized scores; `allowed_token_mass` is the probability the
    model gives to answering exactly one of the options (the sum of their joint
    probabilities, each answer once: `distinct` indexes one option per answer text when
    clones share one), the likelihood analogue of the letters' mass."""
    joint = np.array([sum(values) for values in option_logprobs], np.float64)
    if not np.isfinite(joint).all() or (neutral is not None and not np.isfinite(neutral).all()):
        raise NonFiniteLogitsError("the model returned NaN or infinite logits")
    if choice.normalization == "mean":
        scores = joint / np.array([len(values) for values in option_logprobs], np.float64)
    elif choice.normalization == "pmi":
        if neutral is None:
            raise ValueError("pmi needs each option's neutral log-probability")
        scores = joint - np.asarray(neutral, np.float64)
    else:
        scores = joint
    return SlotReadout(
        option_logits=[float(value) for value in scores],
        probabilities=[float(value) for value in softmax(scores)],
        allowed_token_mass=min(
            1.0, float(np.exp(joint if distinct is None else joint[list(distinct)]).sum())
        ),
        top_token_id=top_token_id,
    )
