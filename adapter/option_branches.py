"""A likelihood question's work: the prompt and a branch per option, each option's own words
scored after it, and pmi's neutral branches with the cache of neutral scores.

How an option's words are read (adapter.likelihood) is the readout's; what the engine is
sent for them is built here, beside the letters' (adapter.question_work), and handed to the
service as a `LikelihoodWork`. The tokenizer comes in as a callable, with the prompt limit
checked where it tokenizes (DecisionService.tokenize_prompt), so this module reaches no
model of its own. Where a prompt may be cut comes in the same way (Vocabulary.prompt_cut):
each option is tokenized after the prompt's tail from there (its last special token on), not
after the whole prompt again, which on a long state cost the request thread a millisecond or
two per option.

Threads: request threads. The neutral scores depend only on an option's tokens, so they are
kept across requests (at most NEUTRAL_CACHE_SIZE, the oldest forgotten), under a lock.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from adapter.errors import RequestError
from adapter.likelihood import Listing, ReadoutChoice, option_tokens
from adapter.prompts import (
    ChatTemplate,
    RenderedPrompt,
    TemplateRenderError,
    answer_clones,
    answer_text,
    render_likelihood_prompt,
    render_neutral_prompt,
    with_answer,
)
from adapter.question_work import LikelihoodWork, PromptScore, QuestionWork
from adapter.schema import Decision

NEUTRAL_CACHE_SIZE = 4096  # options whose neutral score (pmi) is kept
HINT = "; shorten the state, question or options"  # after any prompt over the limit
# (prompt, the field errors name, a hint for the message) -> its tokens, refusing one over
# SEMIF_MAX_TOKENS.
Tokenize = Callable[[RenderedPrompt, str, str], list[int]]
# (prompt, its tokens) -> where whole-stream memory keeps checkpoints (none otherwise).
Boundaries = Callable[[RenderedPrompt, list[int]], tuple[int, ...]]
# (prompt text, its user spans) -> where text appended to it can no longer change its tokens
# before that character, after every user span (Vocabulary.prompt_cut); None: nowhere.
Cut = Callable[[str, Sequence[tuple[int, int]]], int | None]


class OptionBranches:
    """Builds likelihood questions' work for one model (its template, tokenizer, limit)."""

    def __init__(
        self,
        *,
        template: Callable[[], ChatTemplate],
        listing: Callable[[], Listing],
        tokenize: Tokenize,
        cut: Cut,
        boundaries: Boundaries,
        end_of_turn: Callable[[], int],
        max_tokens: int,
        whole_streams: bool,
    ) -> None:
        # The service's template and SEMIF_LIKELIHOOD_PROMPT, read at each use.
        self._template = template
        self._listing = listing
        self._tokenize = tokenize
        self._cut = cut
        self._boundaries = boundaries
        self._end_of_turn = end_of_turn
        self.max_tokens = max_tokens
        # Memory that keeps only whole streams: the option tree sends no one-token edges.
        self._whole_streams = whole_streams
        self._neutral: dict[Listing, tuple[RenderedPrompt, list[int]]] = {}
        self._neutral_scores: OrderedDict[tuple[int, ...], float] = OrderedDict()
        self._lock = threading.Lock()

    def work(self, decision: Decision, path: str, choice: ReadoutChoice) -> LikelihoodWork:
        """The likelihood prompt and a branch per option (its text then the end of the
        turn), each within SEMIF_MAX_TOKENS and tokenized as the model would read it after
        the prompt (adapter.likelihood.option_tokens), sent as a tree of shared prefixes
        (adapter.option_tree); for pmi, the neutral branches the cache does not already
        answer."""
        try:
            prompt = render_likelihood_prompt(self._template(), decision, self._listing())
        except (TemplateRenderError, ValueError) as error:
            raise RequestError(path, str(error)) from None
        tokens = self._tokenize(prompt, path, HINT)
        options = self._answers(prompt, tokens, decision, path)
        neutral = None
        if choice.normalization == "pmi":
            neutral_prompt, start = self._neutral_prompt()
            after = self._answers(neutral_prompt, start, decision, path)
            with self._lock:
                known = [self._neutral_scores.get(tuple(option)) for option in after]
            neutral = (start, known)
            if after != options:  # the same words after either prompt, or pmi is not defined
                raise RequestError(path, "an option tokenizes differently after the neutral prompt")
        return LikelihoodWork.of(
            prompt.text,
            tokens,
            options,
            choice,
            self._boundaries(prompt, tokens),
            whole_streams=self._whole_streams,
            neutral=neutral,
            clones=answer_clones(decision),
        )

    def remember(
        self, works: Sequence[QuestionWork], scores: Sequence[Sequence[PromptScore]]
    ) -> None:
        """Keep the neutral scores a pass computed (pmi), the oldest forgotten past
        NEUTRAL_CACHE_SIZE: they depend only on the option's tokens."""
        with self._lock:
            for work, own in zip(works, scores, strict=True):
                if not isinstance(work, LikelihoodWork) or work.choice.normalization != "pmi":
                    continue
                for option, value in zip(work.options, work.neutral_scores(own), strict=True):
                    self._neutral_scores[tuple(option)] = value
                    self._neutral_scores.move_to_end(tuple(option))
            while len(self._neutral_scores) > NEUTRAL_CACHE_SIZE:
                self._neutral_scores.popitem(last=False)

    def _answers(
        self, prompt: RenderedPrompt, tokens: list[int], decision: Decision, path: str
    ) -> list[list[int]]:
        """Each option's scored tokens after `prompt`: its answer text's (its label, else its
        description), then the end of the assistant's turn (so an option that is another's
        prefix is not favoured)."""
        end = self._end_of_turn()
        if end < 0:
            raise RequestError(
                "readout",
                "this model's vocabulary has no end-of-turn or end-of-sequence token, so a "
                "whole answer cannot be scored; use the letters readout",
            )
        answers = []
        tail, tail_tokens = self._tail(prompt, tokens, path)
        # Options with the same answer text are one answer (clones): the engine scores the
        # branch once, and the reading splits that answer's probability between them.
        for option in decision.options:
            branch = self._tokenize(with_answer(tail, answer_text(option)), path, HINT)
            answer = option_tokens(branch, tail_tokens, f"{path}.options", option.id)
            if len(tokens) + len(answer) + 1 > self.max_tokens:
                raise RequestError(
                    path,
                    f"option {json.dumps(option.id)} makes the prompt "
                    f"{len(tokens) + len(answer) + 1} tokens; the limit is {self.max_tokens} "
                    f"(SEMIF_MAX_TOKENS){HINT}",
                )
            answers.append([*answer, end])
        return answers

    def _tail(
        self, prompt: RenderedPrompt, tokens: list[int], path: str
    ) -> tuple[RenderedPrompt, list[int]]:
        """What each option is tokenized after, and its tokens: the prompt from its cut on
        (after every user span, so the tail has none), else the whole prompt. Text after
        the cut cannot change the tokens before it, so an option's tokens after the tail
        are its tokens after the whole prompt, refused alike where they merge with the
        tail's (adapter.likelihood.option_tokens). The tail alone must be shorter than the
        prompt: the head then keeps a token of its own, so a BOS the model adds is decided
        by the same first token in the prompt and in every branch."""
        cut = self._cut(prompt.text, prompt.user_spans)
        if cut is not None:
            tail = RenderedPrompt(prompt.text[cut:], ())
            tail_tokens = self._tokenize(tail, path, HINT)
            if len(tail_tokens) < len(tokens):
                return tail, tail_tokens
        return prompt, tokens

    def _neutral_prompt(self) -> tuple[RenderedPrompt, list[int]]:
        """The neutral prompt and its tokens (rendered once; no request text in it)."""
        listing = self._listing()
        if listing not in self._neutral:
            try:
                prompt = render_neutral_prompt(self._template(), listing)
            except (TemplateRenderError, ValueError) as error:
                raise RequestError("normalization", str(error)) from None
            self._neutral[listing] = (prompt, self._tokenize(prompt, "normalization", ""))
        return self._neutral[listing]
