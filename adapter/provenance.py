"""How a question was read, as every answer that reports it says it: the option order, the
calibration applied, the prompt and its version, the readout and the tokens.

One definition for the decision API's results (adapter.decisions) and the audit records of
System One's answers (adapter.systemone), whose wire format has no room for it: a record
of either API then reads alike, and a shadow report compares them field by field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from adapter.calibration import describe
from adapter.multi_label import READOUT_DETAIL
from adapter.ordering import Reading, Variants
from adapter.prompts import PROMPT_VERSION, prompt_sha256

if TYPE_CHECKING:  # System One's parser, which the JSON Lines planner uses, loads no model
    from adapter.service import DecisionService, ScoredBatch


def reused_per_reading(readings: Sequence[Reading], batch: ScoredBatch) -> list[int]:
    """Per reading: the tokens its prompts took from resident prefixes (rows shared with
    other prompts count for each; the request's timing counts them once)."""
    reused, offset = [], 0
    for reading in readings:
        reused.append(sum(batch.reused_tokens[offset : offset + reading.prompts]))
        offset += reading.prompts
    return reused


def reading_fields(
    service: DecisionService, variant: Variants, reading: Reading, reused: int
) -> dict[str, Any]:
    """How `variant` was read into `reading`, in the decision API's result fields."""
    read = variant.readout
    multi = variant.kind == "multi_label"
    version = service.likelihood_prompt_version if read.likelihood else PROMPT_VERSION
    return {
        "option_order": variant.mode,
        "calibration": describe(service.calibration, variant.correction),
        "input_tokens": reading.input_tokens,
        "prompt_sha256": prompt_sha256(reading.prompt),
        "prompt_version": version,
        "readout": read.method,
        "normalization": read.normalization if read.likelihood else None,
        "readout_detail": READOUT_DETAIL if multi else read.describe(),
        "timing": {
            "prompts": reading.prompts,
            "evaluated_tokens": reading.input_tokens - reused,
            "reused_tokens": reused,
        },
    }
