"""Render decision prompts with the model's own chat template (SemIf "direct options").

The state comes first in the user turn so that every question about one state shares a
token prefix; the options are labelled with answer letters and the prompt ends where the
assistant's answer would start, so the next-token logits at the last position score them.
"""

from __future__ import annotations

import hashlib
import json
import string
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from adapter.schema import Decision

PROMPT_VERSION = "semif-direct-options/1"
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


class TemplateRenderError(RuntimeError):
    """The GGUF's chat template cannot render a system + user conversation."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Chat templates expect Hugging Face's tojson: no HTML escaping, unicode kept.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now(UTC).strftime(fmt)


class ChatTemplate:
    """A compiled GGUF chat template plus the special-token texts it may reference."""

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
        except TemplateError as error:
            raise TemplateRenderError(f"chat template failed to render: {error}") from None


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


def decision_messages(decision: Decision) -> list[dict[str, str]]:
    """The system and user turns for one decision; the state leads the user turn."""
    labels = answer_labels(len(decision.options))
    option_lines = "\n".join(
        f"{label}. {option.description}"
        for label, option in zip(labels, decision.options, strict=True)
    )
    user = (
        f"Evidence:\n{decision.state_text}\n\n"
        f"Question: {decision.question}\n\n"
        f"Options:\n{option_lines}\n\n"
        f"{_answer_instruction(labels)}"
    )
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]


def render_decision(template: ChatTemplate, decision: Decision) -> str:
    return template.render(decision_messages(decision))


def prompt_sha256(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()
