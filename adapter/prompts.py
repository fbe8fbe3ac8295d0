"""Render decision prompts with the model's own chat template (SemIf "direct options").

The state comes first in the user turn so that every question about one state shares a
token prefix; the options are labelled with answer letters and the prompt ends where the
assistant's answer would start, so the next-token logits at the last position score them.

Text from a request never becomes control tokens. Every request string is rendered wrapped
in sentinels no request can contain (lone surrogates, refused as invalid Unicode at parse
time), the rendered text is split into template-owned and request-owned spans and the
sentinels are stripped: the prompt text (and so `prompt_sha256`) is the plain rendering,
and the engine tokenizes the request-owned spans as plain text. Leading and trailing
whitespace stays outside the sentinels, so templates that `trim` content still trim it.
A template that rewrites the sentinels is refused at load (`check_marks_survive`), and a
render whose marked and plain forms disagree is refused (`MarkedTextError`).
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from adapter.likelihood import Listing
from adapter.schema import Decision, Option

PROMPT_VERSION = "semif-direct-options/1"
# The likelihood readout's prompts (adapter.likelihood), one per listing: the options listed
# without position labels (each as its answer text, then its description where a `label`
# names it), or not listed at all; either way each option is scored as the whole answer.
LIKELIHOOD_PROMPT_VERSIONS: dict[Listing, str] = {
    "listed": "semif-option-likelihood/1",
    "unlisted": "semif-option-likelihood-unlisted/1",
}
# Option labels. Up to 52 options each gets one letter, A..Z then a..z (one token each);
# above 52 every option gets a capital letter plus a digit, A0..Z9 (two tokens each), so the
# labels of one prompt are never token prefixes of each other. The decision API's 16
# options use A..P, which every served model must support.
SINGLE_LABELS = tuple(string.ascii_uppercase + string.ascii_lowercase)
PAIR_LABELS = tuple(letter + digit for letter in string.ascii_uppercase for digit in string.digits)
ANSWER_LETTERS = SINGLE_LABELS[:16]
# Engine sequences one question with pair labels can need: its branch plus one per letter.
PAIR_LABEL_SEQUENCES = 1 + len(string.ascii_uppercase)
SYSTEM_PROMPT = (
    "You are a decision model. Apply the criterion in the question to the evidence and "
    "choose the one option that fits best. Reply with the option's letter only."
)
LIKELIHOOD_SYSTEM_PROMPT = (
    "You are a decision model. Apply the criterion in the question to the evidence and "
    "choose the one option that fits best. Reply with that option's text exactly as written."
)
LIKELIHOOD_INSTRUCTION = "Reply with one option's text, exactly as written."
UNLISTED_SYSTEM_PROMPT = (
    "You are a decision model. Apply the criterion in the question to the evidence and "
    "reply with the answer only, in as few words as possible."
)
UNLISTED_INSTRUCTION = "Reply with the answer only."
# A multi-label question (adapter.multi_label): one prompt per option, the option judged on
# its own, answered A (it applies) or B (it does not). PROMPT_VERSION names both letter
# prompts (a choice's and a multi-label option's): a change to either bumps it, so a
# calibration fitted on either is refused when stale.
MULTI_LABEL_SYSTEM_PROMPT = (
    "You are a decision model. Apply the criterion in the question to the evidence and "
    "decide whether the one option shown applies. Reply with the letter only."
)
APPLIES_LABELS = ("A", "B")  # A: the option applies; B: it does not


# Lone surrogates: valid requests cannot contain them (adapter.http refuses them).
USER_OPEN, USER_CLOSE = "\ud800", "\udbff"
_SENTINELS = (USER_OPEN, USER_CLOSE)


class TemplateRenderError(RuntimeError):
    """The chat template cannot render a system + user conversation."""


class MarkedTextError(TemplateRenderError):
    """The template treated request text differently once it was marked, or dropped a
    marker, so request text cannot be told from template text: refused, never guessed."""


@dataclass(frozen=True)
class RenderedPrompt:
    """The plain rendered prompt and the character spans of it that came from a request."""

    text: str
    user_spans: tuple[tuple[int, int], ...]


def mark_user_text(text: str) -> str:
    """Wrap request text in sentinels, whitespace ends outside (so `trim` still trims)."""
    if any(sentinel in text for sentinel in _SENTINELS):
        raise ValueError("text contains a lone surrogate; it must be valid Unicode")
    core = text.strip()
    if not core:
        return text  # whitespace cannot spell a control token; keeps `if content` tests
    start = text.index(core)
    return f"{text[:start]}{USER_OPEN}{core}{USER_CLOSE}{text[start + len(core) :]}"


def unmark(marked: str) -> RenderedPrompt:
    """Strip the sentinels, returning the plain text and the spans they enclosed."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    length = 0
    open_at: int | None = None
    position = 0
    while True:
        found = [
            (index, char) for char in _SENTINELS if (index := marked.find(char, position)) >= 0
        ]
        if not found:
            break
        index, char = min(found)
        parts.append(marked[position:index])
        length += index - position
        position = index + 1
        if (char == USER_OPEN) != (open_at is None):
            raise MarkedTextError("the chat template reordered or dropped request-text markers")
        if char == USER_OPEN:
            open_at = length
        else:
            assert open_at is not None
            spans.append((open_at, length))
            open_at = None
    if open_at is not None:
        raise MarkedTextError("the chat template dropped a request-text marker")
    parts.append(marked[position:])
    return RenderedPrompt("".join(parts), tuple(spans))


def _plain(messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    return [
        {key: value.replace(USER_OPEN, "").replace(USER_CLOSE, "") for key, value in m.items()}
        for m in messages
    ]


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Chat templates expect Hugging Face's tojson: no HTML escaping, unicode kept.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now(UTC).strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token texts it may reference."""

    def __init__(self, source: str, bos_token: str, eos_token: str) -> None:
        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = _strftime_now
        try:
            self._template = environment.from_string(source)
        except TemplateError as error:
            raise TemplateRenderError(f"chat template does not compile: {error}") from None
        self._bos_token = bos_token
        self._eos_token = eos_token

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        """Render `messages` followed by the assistant's generation prompt."""
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=True,
                enable_thinking=False,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                tools=None,
            )
        # A template is foreign code: whatever it raises (a TemplateError, or a TypeError
        # from `content + 1`) means it cannot render these messages.
        except Exception as error:
            raise TemplateRenderError(
                f"chat template failed to render: {type(error).__name__}: {error}"
            ) from None


def answer_labels(count: int) -> tuple[str, ...]:
    """The labels of `count` options: single letters up to 52, letter-digit pairs above."""
    if count <= len(SINGLE_LABELS):
        return SINGLE_LABELS[:count]
    if count <= len(PAIR_LABELS):
        return PAIR_LABELS[:count]
    raise ValueError(f"{count} options; at most {len(PAIR_LABELS)} can be labelled")


def _answer_instruction(labels: Sequence[str]) -> str:
    first, last = labels[0], labels[-1]
    if len(last) == 2:
        return f"Answer with one label from {first} to {last}: a capital letter and a digit."
    if len(labels) > len(string.ascii_uppercase):
        return f"Answer with one letter from A to Z or from a to {last}."
    return f"Answer with one letter from {first} to {last}."


def decision_messages(decision: Decision, *, marked: bool = False) -> list[dict[str, str]]:
    """The system and user turns for one decision; the state leads the user turn. With
    `marked`, every string from the request is wrapped by `mark_user_text`."""

    def user(text: str) -> str:
        return mark_user_text(text) if marked else text

    labels = answer_labels(len(decision.options))
    option_lines = "\n".join(
        f"{label}. {user(option.description)}"
        for label, option in zip(labels, decision.options, strict=True)
    )
    content = (
        f"Evidence:\n{user(decision.state_text)}\n\n"
        f"Question: {user(decision.question)}\n\n"
        f"Options:\n{option_lines}\n\n"
        f"{_answer_instruction(labels)}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": content}]


def multi_label_messages(
    decision: Decision, option: Option, *, marked: bool = False
) -> list[dict[str, str]]:
    """The turns that ask whether one option of a multi-label question applies: the
    evidence and the question lead, as in every prompt about the state, then this option
    alone, so no other option can move its answer (the prompt is a branch of the shared
    state at the option's start)."""

    def user(text: str) -> str:
        return mark_user_text(text) if marked else text

    yes, no = APPLIES_LABELS
    content = (
        f"Evidence:\n{user(decision.state_text)}\n\n"
        f"Question: {user(decision.question)}\n\n"
        f"Option: {user(option.description)}\n\n"
        f"Does this option apply?\n{yes}. Yes\n{no}. No\n\n"
        f"{_answer_instruction(APPLIES_LABELS)}"
    )
    return [
        {"role": "system", "content": MULTI_LABEL_SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]


def answer_text(option: Option) -> str:
    """The words the likelihood readout scores as an option's answer: its `label` when it
    has one (a short name: fewer rows per branch), else its description."""
    return (option.label or option.description).strip()


def answer_clones(decision: Decision) -> list[list[int]]:
    """Options the likelihood readout cannot tell apart (the same answer text), as groups of
    option indexes, first first; only groups of two or more. The one definition of a clone:
    the branches score them once, the reading splits their answer's probability."""
    groups: dict[str, list[int]] = {}
    for index, option in enumerate(decision.options):
        groups.setdefault(answer_text(option), []).append(index)
    return [group for group in groups.values() if len(group) > 1]


def likelihood_messages(
    decision: Decision, listing: Listing, *, marked: bool = False
) -> list[dict[str, str]]:
    """The likelihood readout's turns. `listed`: as `decision_messages`, the options listed
    without position labels in the order given (the caller passes the content-derived
    order), each as its answer text, then ": description" where a label names it;
    `unlisted`: only the evidence and the question, so the model answers in its own words
    and the prompt does not grow with the options."""

    def user(text: str) -> str:
        return mark_user_text(text) if marked else text

    evidence = f"Evidence:\n{user(decision.state_text)}\n\nQuestion: {user(decision.question)}"
    if listing == "unlisted":
        content = f"{evidence}\n\n{UNLISTED_INSTRUCTION}"
        return [
            {"role": "system", "content": UNLISTED_SYSTEM_PROMPT},
            {"role": "user", "content": content},
        ]
    option_lines = "\n".join(_listed(option, user) for option in decision.options)
    content = f"{evidence}\n\nOptions:\n{option_lines}\n\n{LIKELIHOOD_INSTRUCTION}"
    return [
        {"role": "system", "content": LIKELIHOOD_SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]


def _listed(option: Option, user: Callable[[str], str]) -> str:
    """One option's line in the listed prompt: the answer text first, as it is scored."""
    if option.label is None:
        return f"- {user(option.description)}"
    return f"- {user(option.label)}: {user(option.description)}"


def neutral_messages(listing: Listing) -> list[dict[str, str]]:
    """The fixed prompt `pmi` divides out: the listing's turns with no evidence, question or
    options, so an option's probability after it is its prior as an answer."""
    if listing == "unlisted":
        return [
            {"role": "system", "content": UNLISTED_SYSTEM_PROMPT},
            {"role": "user", "content": UNLISTED_INSTRUCTION},
        ]
    return [
        {"role": "system", "content": LIKELIHOOD_SYSTEM_PROMPT},
        {"role": "user", "content": LIKELIHOOD_INSTRUCTION},
    ]


def with_answer(prompt: RenderedPrompt, answer: str) -> RenderedPrompt:
    """The prompt followed by `answer` as request text: the assistant's answer to score."""
    end = len(prompt.text) + len(answer)
    return RenderedPrompt(prompt.text + answer, (*prompt.user_spans, (len(prompt.text), end)))


def render_marked(template: ChatTemplate, messages: Sequence[dict[str, str]]) -> RenderedPrompt:
    """Render messages whose request text is marked: the plain prompt plus its request spans.

    The plain messages are rendered too and must give exactly the unmarked text, so a
    template that branches on content (`startswith`, `length`, ...) cannot be fooled."""
    rendered = unmark(template.render(messages))
    if rendered.text != template.render(_plain(messages)):
        raise MarkedTextError(
            "the chat template renders this request text differently once it is marked "
            "as request text; it cannot be told apart from template text"
        )
    return rendered


def render_decision_prompt(template: ChatTemplate, decision: Decision) -> RenderedPrompt:
    return render_marked(template, decision_messages(decision, marked=True))


def render_likelihood_prompt(
    template: ChatTemplate, decision: Decision, listing: Listing
) -> RenderedPrompt:
    return render_marked(template, likelihood_messages(decision, listing, marked=True))


def render_multi_label_prompt(
    template: ChatTemplate, decision: Decision, option: Option
) -> RenderedPrompt:
    return render_marked(template, multi_label_messages(decision, option, marked=True))


def render_neutral_prompt(template: ChatTemplate, listing: Listing) -> RenderedPrompt:
    return render_marked(template, neutral_messages(listing))


def render_chat_prompt(
    template: ChatTemplate, messages: Sequence[dict[str, str]]
) -> RenderedPrompt:
    """A chat conversation: every message's content is request text."""
    marked = [{**message, "content": mark_user_text(message["content"])} for message in messages]
    return render_marked(template, marked)


def render_decision(template: ChatTemplate, decision: Decision) -> str:
    return render_decision_prompt(template, decision).text


def check_marks_survive(template: ChatTemplate) -> None:
    """At load: the template must keep request-text markers intact, else the adapter could
    not keep request text plain. Probes a decision and a chat with padded contents."""
    probe = Decision(
        id="probe",
        state=" Probe evidence.\n",
        question="Which option applies?",
        options=(Option("a", "First."), Option("b", "Second.")),
    )
    chat = [
        {"role": "system", "content": "Probe system."},
        {"role": "user", "content": "  Probe question?\n"},
        {"role": "assistant", "content": "Probe answer."},
        {"role": "user", "content": "Probe follow-up."},
    ]
    try:
        decision = render_decision_prompt(template, probe)
        conversation = render_chat_prompt(template, chat)
    except MarkedTextError as error:
        raise TemplateRenderError(f"chat template cannot mark request text: {error}") from None
    if len(decision.user_spans) != 4 or not conversation.user_spans:
        raise TemplateRenderError(
            "chat template drops request text it was given (a decision kept "
            f"{len(decision.user_spans)} of 4 marked strings); it cannot be served safely"
        )


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()
