"""Which chat template renders the prompts: its text and where it came from.

Pure: settings read the operator's file into one, the model files the packed one, the
runtime the GGUF's; prompts compile whichever wins.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TemplateText:
    """A chat template's Jinja source and where it came from: the GGUF's own
    (tokenizer.chat_template) or the operator's (SEMIF_CHAT_TEMPLATE, or the file
    model-build packed beside the GGUF). Answers report `source` and the sha256 of the
    text's UTF-8 bytes, so a prompt can be traced to the template that rendered it."""

    text: str
    source: Literal["gguf", "operator"]
    origin: str  # names it in start errors and the log

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def identity(self) -> dict[str, str]:
        """The answers' `model.chat_template`."""
        return {"source": self.source, "sha256": self.sha256}
