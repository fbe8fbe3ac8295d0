"""A question template's key: what the server can compute for any request, and what audit
records carry, so priors fitted from recorded traffic find the questions they were fitted on.

A template is a question asked with one list of options, whatever the state:
`<question_sha256>:<options_sha256>`, the sha256 of the question text and of the options as
`[[id, description, label], ...]` in the caller's order (JSON, non-ASCII kept). The order is
part of the key: in `as_given` mode the same options listed otherwise are read otherwise.
audit.decision_record's `question_sha256` and `options_sha256` are these hashes, computed
here: one definition, so a key fitted from records is the key served.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from adapter.schema import Decision, Option


def text_sha256(text: str) -> str:
    """A text's sha256 as audit records and template keys carry it (hex, UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()


def options_sha256(options: Sequence[Option]) -> str:
    """The options' hash: ids, descriptions and labels in the caller's order."""
    listed = [[option.id, option.description, option.label] for option in options]
    return text_sha256(json.dumps(listed, ensure_ascii=False))


def template_key(decision: Decision) -> str:
    """The key a template prior is looked up by (the module docstring)."""
    return f"{text_sha256(decision.question)}:{options_sha256(decision.options)}"


def record_template_key(record: Mapping[str, Any]) -> str | None:
    """An audit record's template key, from the hashes it carries (None without them)."""
    question, options = record.get("question_sha256"), record.get("options_sha256")
    if not isinstance(question, str) or not isinstance(options, str):
        return None
    return f"{question}:{options}"
