"""Option order: the orders a decision's options are shown in, and how the readouts of those
prompts combine into one distribution over the caller's options.

Reading letter logits makes the answer depend on where an option is listed (the model
favours some letters). Three modes (`model_build.calibration.OPTION_ORDERS`):
- `as_given`: the options in the caller's order, one prompt (the reference behaviour);
- `canonical`: one prompt, the options sorted by a key derived from what the model reads of
  them (sha256 of the description, the id only breaking ties between equal descriptions),
  so every permutation of the same options renders the same prompt and gets the same
  probabilities by id, at no extra cost; the calibration's position prior, when it has one
  for this option count, is divided out (`adapter.calibration`; a question template's
  prior takes its place where the calibration has one for this template in this mode);
- `debiased`: the canonical order and its cyclic rotations, each option once in each
  position, averaged by option id. Invariant by construction and the position bias averages
  out; it costs one prompt per rotation, decoded as branches of the shared prefix in the
  same batch (the state is evaluated once). Above MAX_ROTATIONS options, MAX_ROTATIONS
  evenly spaced rotations are used: still invariant, each option in MAX_ROTATIONS positions
  spread over the list.
An ordinal (System One `score`) question keeps its low-to-high order in every mode: its
positions are its levels, and reordering levels would change the question.

Results always come back in the caller's order, under the caller's ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from adapter.calibration import Correction, correction, letters_correction, likelihood_correction
from adapter.likelihood import LETTERS, ReadoutChoice
from adapter.prompts import answer_clones
from adapter.readout import (
    SlotReadout,
    applies_probabilities,
    corrected,
    log_mean,
    log_softmax,
)
from adapter.schema import Decision, Option
from model_build.calibration import Calibration, OptionOrder, QuestionKind

MAX_ROTATIONS = 8
Order = tuple[int, ...]  # rendered position j shows the caller's option order[j]
T = TypeVar("T")


def canonical_order(options: Sequence[Option]) -> Order:
    """Positions sorted by the content the model reads: the description's hash, the id
    breaking ties. A hash, not the text, so the position is uncorrelated with wording:
    sorting the text would put every option worded `Account...` before `Billing...`, and
    whatever goes with such wording would ride on the letter bias."""

    def key(index: int) -> tuple[str, str]:
        option = options[index]
        return hashlib.sha256(option.description.encode()).hexdigest(), option.id

    return tuple(sorted(range(len(options)), key=key))


def rotations(order: Order, limit: int | None = MAX_ROTATIONS) -> tuple[Order, ...]:
    """Cyclic rotations of `order`: all of them, or `limit` evenly spaced ones."""
    count = len(order) if limit is None else min(len(order), limit)
    offsets = [index * len(order) // count for index in range(count)]
    return tuple(order[offset:] + order[:offset] for offset in offsets)


def plan(
    options: Sequence[Option], mode: OptionOrder, *, ordinal: bool = False
) -> tuple[Order, ...]:
    """The orders a decision is scored in: one, or the debiased rotations."""
    if ordinal or mode == "as_given":
        return (tuple(range(len(options))),)
    canonical = canonical_order(options)
    return (canonical,) if mode == "canonical" else rotations(canonical)


def arrange(decision: Decision, order: Order) -> Decision:
    """The decision with its options in `order` (ids unchanged)."""
    return replace(decision, options=tuple(decision.options[index] for index in order))


def to_caller(values: Sequence[T], order: Order) -> list[T]:
    """Values by rendered position -> values in the caller's order."""
    placed: dict[int, T] = {index: value for index, value in zip(order, values, strict=True)}
    return [placed[index] for index in range(len(order))]


def position_log_probabilities(readout: SlotReadout) -> npt.NDArray[np.float64]:
    """The model's log-probabilities of the rendered positions (uncalibrated)."""
    return log_softmax(np.asarray(readout.option_logits, np.float64))


def distribution(
    orders: Sequence[Order], rows: Sequence[npt.NDArray[np.float64]], fix: Correction
) -> npt.NDArray[np.float64]:
    """Probabilities over the caller's options from each order's position log-probabilities:
    one prompt's, or the average probability by option id over the rotations; then the
    correction (its prior is by position of the first order: a position prior's canonical
    prompt, or a template prior placed there by option id). All
    of it is computed in the first order's positions and put in the caller's order last:
    every permutation of the same options then sums in the same order, so in the canonical
    and debiased modes (and by likelihood) permuted options get bit-identical
    probabilities, not only equal ones."""
    first = list(orders[0])
    aligned = [
        np.asarray(to_caller(list(row), order))[first]
        for order, row in zip(orders, rows, strict=True)
    ]
    result = corrected(
        aligned[0] if len(aligned) == 1 else log_mean(aligned),
        temperature=fix.temperature,
        prior=fix.prior,
    )
    return np.asarray(to_caller(list(result), orders[0]))


@dataclass(frozen=True)
class Reading:
    """One decision read over its prompts, in the caller's order."""

    probabilities: list[float]  # combined and corrected
    option_logits: list[float]  # the first prompt's raw letter scores
    allowed_token_mass: float  # mean over the prompts
    top_token_id: int  # the first prompt's full-vocabulary argmax
    prompt: str  # the first prompt (canonical order in canonical and debiased modes)
    input_tokens: int  # summed over the prompts
    prompts: int


class Batch(Protocol):
    """What `read` needs of a scored batch (adapter.service.ScoredBatch has it)."""

    @property
    def prompts(self) -> list[str]: ...
    @property
    def input_tokens(self) -> list[int]: ...
    @property
    def readouts(self) -> list[SlotReadout]: ...


@dataclass(frozen=True)
class Variants:
    """One decision, the orders it is scored in and how its distribution is corrected."""

    decision: Decision
    orders: tuple[Order, ...]
    correction: Correction
    kind: QuestionKind  # what is asked (the metrics count questions by it)
    mode: OptionOrder  # the option-order mode the orders came from
    readout: ReadoutChoice = LETTERS  # letters, or likelihood (adapter.likelihood)

    @classmethod
    def of(
        cls,
        decision: Decision,
        kind: QuestionKind,
        mode: OptionOrder,
        calibration: Calibration | None,
        readout: ReadoutChoice = LETTERS,
    ) -> Variants:
        """A question of `kind` read in `mode` under the model's calibration. Read by
        likelihood, one prompt lists the options in the canonical order whatever `mode`
        says (order-invariant by construction), with the calibration's likelihood
        temperature for its normalization and kind. A multi-label question is read by
        letters, a prompt per option (adapter.multi_label), in the caller's order: each
        option's prompt shows it alone."""
        if decision.kind == "multi_label":  # each option alone: no order to choose
            fix = correction(calibration, "multi_label", mode, len(decision.options))
            identity = tuple(range(len(decision.options)))
            return cls(decision, (identity,), fix, "multi_label", "as_given")
        if readout.likelihood:
            order = canonical_order(decision.options)
            fix = likelihood_correction(calibration, kind, readout.normalization)
            return cls(decision, (order,), fix, kind, "canonical", readout)
        orders = plan(decision.options, mode, ordinal=kind == "score")
        fix = letters_correction(calibration, decision, kind, mode, orders[0])
        return cls(decision, orders, fix, kind, mode, readout)

    def read(
        self, prompts: Sequence[str], tokens: Sequence[int], readouts: Sequence[SlotReadout]
    ) -> Reading:
        """Combine this decision's prompts' readouts, then apply its correction."""
        first, first_order = readouts[0], self.orders[0]
        rows = [position_log_probabilities(readout) for readout in readouts]
        groups = answer_clones(self.decision) if self.readout.likelihood else []
        if self.decision.kind == "multi_label":
            temperature = self.correction.temperature
            probabilities = applies_probabilities(first.option_logits, temperature=temperature)
        elif groups:
            probabilities = split_clones(first.option_logits, first_order, groups, self.correction)
        else:
            probabilities = distribution(self.orders, rows, self.correction)
        return Reading(
            probabilities=[float(p) for p in probabilities],
            option_logits=to_caller(first.option_logits, first_order),
            allowed_token_mass=float(np.mean([r.allowed_token_mass for r in readouts])),
            top_token_id=first.top_token_id,
            prompt=prompts[0],
            input_tokens=sum(tokens),
            prompts=len(readouts),
        )


def split_clones(
    option_logits: Sequence[float],
    order: Order,
    groups: Sequence[Sequence[int]],
    fix: Correction,
) -> npt.NDArray[np.float64]:
    """Probabilities by likelihood when clones share an answer: the distribution over the
    distinct answers (each once, computed exactly as for the question without the other
    clones, so adding or removing a clone moves no other option by a bit), then each
    answer's probability split evenly between its clones."""
    twins = {index: group for group in groups for index in group}
    first = {caller: twins.get(caller, [caller])[0] for caller in order}
    kept = [position for position, caller in enumerate(order) if first[caller] == caller]
    callers = sorted(order[position] for position in kept)
    rank = {caller: reduced for reduced, caller in enumerate(callers)}
    reduced_order = tuple(rank[order[position]] for position in kept)
    row = log_softmax(np.asarray([option_logits[position] for position in kept], np.float64))
    reduced = distribution([reduced_order], [row], fix)
    split = np.empty(len(order), np.float64)
    for caller in range(len(order)):
        split[caller] = reduced[rank[first[caller]]] / len(twins.get(caller, [caller]))
    return split


def expand(
    variants: Sequence[Variants], paths: Sequence[str]
) -> tuple[list[Decision], list[str], list[ReadoutChoice]]:
    """Every prompt of every decision, flattened for one engine call, with how each is
    read; a decision's prompts keep its path, so an error names the decision the caller
    sent."""
    decisions: list[Decision] = []
    expanded: list[str] = []
    readouts: list[ReadoutChoice] = []
    for variant, path in zip(variants, paths, strict=True):
        decisions.extend(arrange(variant.decision, order) for order in variant.orders)
        expanded.extend([path] * len(variant.orders))
        readouts.extend([variant.readout] * len(variant.orders))
    return decisions, expanded, readouts


def read(variants: Sequence[Variants], batch: Batch) -> list[Reading]:
    """Regroup a flattened batch by decision and read each."""
    readings, start = [], 0
    for variant in variants:
        end = start + len(variant.orders)
        readings.append(
            variant.read(
                batch.prompts[start:end], batch.input_tokens[start:end], batch.readouts[start:end]
            )
        )
        start = end
    return readings
