"""Which answer labels this model can be scored by, found once at load with a probe prompt.

The readout only works when each label appends to a prompt as its own tokens: a letter as
exactly one token that reads back as that letter, a letter-digit pair as one token per
character, and appending never re-tokenizes the prompt. The letters A..P (the decision
API's 16 options) are required, so a model without them is refused at start; the wider
label groups are optional, and a question that needs a missing group is refused with the
reason found here.

A model that tokenizes well can still be broken (flipped bytes, a bad quantization), so
the probe decision is also scored once: NaN or infinite logits, or a letter mass below
`MIN_LETTER_MASS_FACTOR` times what a uniform distribution over the vocabulary would put
on A..P, refuse the model. A random-weight model sits near uniform and passes; a model
with flipped bytes measured 4.6e-9 (1e-5 of uniform) and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from adapter.core.engine import LlamaEngine
from adapter.core.failures import ModelLoadError
from adapter.prompts import (
    ANSWER_LETTERS,
    PAIR_LABELS,
    SINGLE_LABELS,
    ChatTemplate,
    render_decision,
)
from adapter.readout import NonFiniteLogitsError, read_slots
from adapter.schema import Decision, Option

# The probe's letter mass must be at least this share of a uniform distribution's 16/n_vocab.
MIN_LETTER_MASS_FACTOR = 0.01


class LabelError(ValueError):
    """This model cannot use the answer labels a question needs (found at load time)."""


@dataclass(frozen=True)
class LabelSet:
    """The token sequence of every usable label, and why each unusable group was refused."""

    tokens: dict[str, tuple[int, ...]]
    problems: dict[int, str]  # label length -> why that group is unusable

    def token_ids(self, labels: Sequence[str]) -> list[tuple[int, ...]]:
        found: list[tuple[int, ...]] = []
        for label in labels:
            if label not in self.tokens:
                raise LabelError(self.problems.get(len(label), f"unknown answer label {label!r}"))
            found.append(self.tokens[label])
        return found

    @property
    def letter_token_ids(self) -> tuple[int, ...]:
        return tuple(self.tokens[letter][0] for letter in ANSWER_LETTERS)


def probe_labels(engine: LlamaEngine, template: ChatTemplate) -> LabelSet:
    """Check every label group against a rendered probe decision; raises ModelLoadError when
    the required letters A..P do not work."""
    prompt = _probe_prompt(template)
    base = engine.vocab.tokenize(prompt)
    tokens: dict[str, tuple[int, ...]] = {
        letter: (token,)
        for letter, token in zip(ANSWER_LETTERS, _answer_slots(engine, prompt, base), strict=True)
    }
    problems: dict[int, str] = {}
    for group in (SINGLE_LABELS, PAIR_LABELS):
        found, problem = _label_group(engine, group, prompt, base)
        if problem is None:
            tokens.update(found)
        else:
            problems[len(group[0])] = problem
    return LabelSet(tokens=tokens, problems=problems)


# Short, so the forward pass adds little to the load; the mass counts all of A..P.
_SCORED_PROBE = Decision(
    id="probe",
    state="The sky is clear and the sun is up.",
    question="Is it day or night?",
    options=(Option("day", "Day."), Option("night", "Night.")),
)


def _probe_prompt(template: ChatTemplate) -> str:
    probe = Decision(
        id="probe",
        state="Probe evidence.",
        question="Which option applies?",
        options=tuple(Option(letter, f"Option {letter}.") for letter in ANSWER_LETTERS),
    )
    return render_decision(template, probe)


def _answer_slots(engine: LlamaEngine, prompt: str, base: list[int]) -> list[int]:
    """Each answer letter must be one distinct token appended cleanly after a prompt."""
    slots: list[int] = []
    for letter in ANSWER_LETTERS:
        extended = engine.vocab.tokenize(prompt + letter)
        added = extended[len(base) :]
        if extended[: len(base)] != base or len(added) != 1:
            raise ModelLoadError(
                f"answer letter {letter!r} does not append as exactly one token after the "
                f"prompt (got {len(added)} new tokens, prefix kept: "
                f"{extended[: len(base)] == base}); this model cannot be scored by letters"
            )
        if engine.vocab.piece(added[0]) != letter:
            raise ModelLoadError(
                f"answer letter {letter!r} token {added[0]} reads back as "
                f"{engine.vocab.piece(added[0])!r}"
            )
        slots.append(added[0])
    if len(set(slots)) != len(slots):
        raise ModelLoadError("answer letters A..P do not map to distinct tokens")
    return slots


def _label_group(
    engine: LlamaEngine, group: Sequence[str], prompt: str, base: list[int]
) -> tuple[dict[str, tuple[int, ...]], str | None]:
    """Accept a label group only if every label appends as one token per character.

    A failing group (say, a vocabulary with "A0" as one token) is not fatal: questions
    that need it are refused with the returned reason, and the letters A..P keep working.
    """
    found: dict[str, tuple[int, ...]] = {}
    for label in group:
        extended = engine.vocab.tokenize(prompt + label)
        added = tuple(extended[len(base) :])
        pieces = [engine.vocab.piece(token) for token in added]
        if extended[: len(base)] != base or pieces != list(label):
            return {}, (
                f"this model cannot use the answer labels {group[0]}..{group[-1]}: "
                f"{label!r} appends as tokens {pieces} instead of {list(label)}"
            )
        found[label] = added
    return found, None


def letter_mass_floor(n_vocab: int) -> float:
    """The lowest letter mass the probe decision may have on a vocabulary of `n_vocab`."""
    return MIN_LETTER_MASS_FACTOR * len(ANSWER_LETTERS) / n_vocab


def probe_decision(engine: LlamaEngine, template: ChatTemplate, labels: LabelSet) -> float:
    """Score the probe decision once; refuse a model whose logits are not finite or whose
    answer letters get an implausibly small share of the probability. Returns that share.

    The KV cache is cleared afterwards, so the first request starts as cold as before."""
    # A server configured with a tiny KV cache scores the prompt's tail: still a real
    # forward pass that ends where an answer letter is due.
    tokens = engine.vocab.tokenize(render_decision(template, _SCORED_PROBE))[-engine.stream_cells :]
    try:
        scores, _ = engine.score([tokens])
        readout = read_slots(scores[0].logits, labels.letter_token_ids)
    except NonFiniteLogitsError:
        raise ModelLoadError(
            "the probe decision gave NaN or infinite logits; the model file is broken"
        ) from None
    finally:
        engine.reset()
    mass = readout.allowed_token_mass
    floor = letter_mass_floor(engine.vocab.n_vocab)
    if not math.isfinite(mass) or mass < floor:
        raise ModelLoadError(
            f"the probe decision put {mass:.3g} of the probability on the answer letters, "
            f"below the floor {floor:.3g} (1/100 of uniform over {engine.vocab.n_vocab} tokens); "
            "the model file is broken or not an instruction model"
        )
    return mass
