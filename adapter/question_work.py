"""What one question sends to the engine and how its scores become a readout.

A question is read by letters (adapter.readout: one prompt, the label continuations of its
two-token labels), as a multi-label question (a prompt per option, each read as applies
or not: adapter.multi_label) or by likelihood (adapter.likelihood: one prompt and a branch
per option, plus, for `pmi`, a branch per option after the neutral prompt unless the
service already knows that option's neutral score). The service flattens every question's
entries into one scheduler job and hands each question back the scores of its own entries,
in order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from adapter.likelihood import ReadoutChoice, read_likelihood
from adapter.option_tree import AFTER, OptionTree, Source, option_tree
from adapter.readout import SlotReadout, applies_probabilities, read_labels


class PromptScore(Protocol):
    """What a question reads of an entry's score (adapter.core.engine.PromptScore has it;
    the service hands it over, so this module stays outside the serving core)."""

    @property
    def logits(self) -> npt.NDArray[np.float32]: ...
    @property
    def next_logits(self) -> Mapping[int, npt.NDArray[np.float32]]: ...
    @property
    def reused_tokens(self) -> int: ...
    @property
    def token_logprobs(self) -> tuple[float, ...]: ...
    @property
    def scored_top_token(self) -> int | None: ...
    @property
    def after_logprobs(self) -> Mapping[int, float]: ...


@dataclass(frozen=True)
class Entry:
    """One prompt for the engine: tokens, label continuations, how many of its last tokens
    are scored, where checkpoints may be kept, and the tokens whose log-probability after
    it is read (LlamaEngine.score)."""

    tokens: list[int]
    continuations: list[int]
    scored: int
    boundaries: tuple[int, ...]
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class LetterWork:
    """A letter-read question: its prompt, sent once per group of label continuations that
    fits a pass beside it (a small KV budget); every entry scores the prompt identically."""

    text: str
    entries: list[Entry]
    labels: list[tuple[int, ...]]

    @classmethod
    def of(
        cls,
        text: str,
        tokens: list[int],
        labels: list[tuple[int, ...]],
        boundaries: tuple[int, ...],
        per_pass: int,
    ) -> LetterWork:
        firsts = sorted({label[0] for label in labels if len(label) > 1})
        entries = [
            Entry(tokens, firsts[start : start + per_pass], 0, boundaries)
            for start in range(0, max(len(firsts), 1), per_pass)
        ]
        return cls(text, entries, labels)

    def read(self, scores: Sequence[PromptScore]) -> SlotReadout:
        continued = {token: logits for s in scores for token, logits in s.next_logits.items()}
        return read_labels(scores[0].logits, continued, self.labels)

    def input_tokens(self) -> int:
        return len(self.entries[0].tokens)

    def reused_tokens(self, scores: Sequence[PromptScore]) -> int:
        return scores[0].reused_tokens


@dataclass(frozen=True)
class LikelihoodWork:
    """A likelihood-read question: its options' branches as a tree below the prompt
    (adapter.option_tree: each shared prefix sent once), then for `pmi` the tree of the
    options whose neutral score is unknown below the neutral prompt."""

    text: str
    entries: list[Entry]
    choice: ReadoutChoice
    options: list[list[int]]  # each option's scored tokens (its own and the end of turn)
    neutral: list[float | None]  # known neutral scores (pmi), None where a branch asks
    distinct: list[int]  # one option per answer text (clones share one: answer_clones)
    recipes: list[tuple[Source, ...]]  # per option: where each token's score is read
    neutral_recipes: list[tuple[Source, ...]]  # per unknown neutral score, likewise
    tree_entries: int  # entries of the prompt's tree (the neutral tree's follow)

    @classmethod
    def of(
        cls,
        text: str,
        prompt: list[int],
        options: list[list[int]],
        choice: ReadoutChoice,
        boundaries: tuple[int, ...],
        *,
        whole_streams: bool = False,
        neutral: tuple[list[int], list[float | None]] | None = None,
        clones: Sequence[Sequence[int]] = (),
    ) -> LikelihoodWork:
        """The prompt's tokens and each option's after it; `whole_streams` for memory that
        keeps only whole streams (adapter.option_tree); `neutral` the neutral prompt's
        tokens and each option's known neutral score (pmi only)."""
        tree = option_tree(options, whole_streams=whole_streams)
        entries = _tree_entries(prompt, tree, boundaries)
        known: list[float | None] = [None] * len(options)
        neutral_recipes: tuple[tuple[Source, ...], ...] = ()
        if neutral is not None:
            start, known = neutral
            unknown = [
                option for option, score in zip(options, known, strict=True) if score is None
            ]
            if unknown:
                neutral_tree = option_tree(unknown, whole_streams=whole_streams)
                entries += _tree_entries(start, neutral_tree, ())
                neutral_recipes = neutral_tree.recipes
        repeats = {index for group in clones for index in group[1:]}
        distinct = [index for index in range(len(options)) if index not in repeats]
        return cls(
            text,
            entries,
            choice,
            options,
            known,
            distinct,
            list(tree.recipes),
            list(neutral_recipes),
            len(tree.edges),
        )

    def read(self, scores: Sequence[PromptScore]) -> SlotReadout:
        own = scores[: self.tree_entries]
        return read_likelihood(
            [
                _read_recipe(own, recipe, option)
                for recipe, option in zip(self.recipes, self.options, strict=True)
            ],
            self.choice,
            neutral=self.neutral_scores(scores) if self.choice.normalization == "pmi" else None,
            top_token_id=scores[0].scored_top_token or 0,
            distinct=self.distinct,
        )

    def neutral_scores(self, scores: Sequence[PromptScore]) -> list[float]:
        """Every option's neutral score: the known ones, the rest from the neutral tree."""
        tree = scores[self.tree_entries :]
        fresh = iter(self.neutral_recipes)
        return [
            known if known is not None else sum(_read_recipe(tree, next(fresh), option))
            for known, option in zip(self.neutral, self.options, strict=True)
        ]

    def input_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self.entries)

    def reused_tokens(self, scores: Sequence[PromptScore]) -> int:
        return sum(score.reused_tokens for score in scores)


def _tree_entries(prompt: list[int], tree: OptionTree, boundaries: tuple[int, ...]) -> list[Entry]:
    """The engine prompts of a tree below `prompt` (the root keeps the checkpoints)."""
    return [
        Entry(
            [*prompt, *edge.path], [], edge.scored, boundaries if not edge.path else (), edge.after
        )
        for edge in tree.edges
    ]


def _read_recipe(
    scores: Sequence[PromptScore], recipe: Sequence[Source], option: Sequence[int]
) -> list[float]:
    """One option's tokens' log-probabilities, each from the row the tree read it at."""
    return [
        scores[edge].after_logprobs[token] if at == AFTER else scores[edge].token_logprobs[at]
        for (edge, at), token in zip(recipe, option, strict=True)
    ]


@dataclass(frozen=True)
class MultiLabelWork:
    """A multi-label question: a prompt per option (a branch of the shared state, the option
    alone after it: adapter.prompts.multi_label_messages), each read at its answer slot as
    A (applies) against B (does not). Options with equal descriptions have equal prompts,
    which the engine scores once."""

    text: str  # every option's prompt, in the caller's order, concatenated (its hash names them)
    entries: list[Entry]
    labels: list[tuple[int, ...]]  # A, B: one token each (checked at load)

    def read(self, scores: Sequence[PromptScore]) -> SlotReadout:
        """Per option, in the caller's order: `option_logits` its log-odds of applying,
        `probabilities` their uncalibrated probabilities (they need not sum to 1), the mass
        the mean over its prompts' A and B mass."""
        readouts = [read_labels(score.logits, {}, self.labels) for score in scores]
        log_odds = [readout.option_logits[0] - readout.option_logits[1] for readout in readouts]
        return SlotReadout(
            option_logits=log_odds,
            probabilities=[float(p) for p in applies_probabilities(log_odds)],
            allowed_token_mass=float(np.mean([r.allowed_token_mass for r in readouts])),
            top_token_id=readouts[0].top_token_id,
        )

    def input_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self.entries)

    def reused_tokens(self, scores: Sequence[PromptScore]) -> int:
        return sum(score.reused_tokens for score in scores)


QuestionWork = LetterWork | LikelihoodWork | MultiLabelWork


def in_chunks(entries: Sequence[Entry], chunk: int) -> list[tuple[Entry, bool]]:
    """What to send so that no pass decodes much more than `chunk` rows of one prompt (a
    pass is bounded in time as well as rows, adapter.core.admission): each entry, preceded
    when it is longer than one and a half chunks by its leading chunks as prompts of their
    own (marked True; nothing reads their scores), shortest first. Each chunk is the prefix
    the next one extends, so the next pass decodes only what is new (prefix reuse: on the
    exact path the scores are bit for bit those of the whole prompt decoded at once), and a
    chunk that two entries share (one state's branches) is sent once."""
    sent: list[tuple[Entry, bool]] = []
    chunks: set[tuple[int, ...]] = set()
    for entry in entries:
        for end in range(chunk, len(entry.tokens) - chunk // 2, chunk):
            prefix = tuple(entry.tokens[:end])
            if prefix not in chunks:
                chunks.add(prefix)
                sent.append((Entry(list(prefix), [], 0, ()), True))
        sent.append((entry, False))
    return sent
