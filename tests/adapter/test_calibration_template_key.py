"""A template's key is what audit records carry: priors fitted from records find the
questions they were fitted on (adapter.audit computes its hashes with
adapter.template_key; this keeps the record's key and the served key one)."""

from __future__ import annotations

from dataclasses import replace

from adapter.audit import decision_record
from adapter.schema import Option, parse_decision
from adapter.template_key import record_template_key, template_key
from tests.support.serving import decision


def test_the_key_is_the_audit_records_and_ignores_the_state_and_id() -> None:
    asked = parse_decision(decision(), "decision")
    asked = replace(asked, options=(*asked.options[:2], Option("sales", "Sales é.", "sell")))
    result = {"option_ids": asked.option_ids, "probabilities": [0.5, 0.3, 0.2]}
    record = decision_record(
        "digest", asked, result, api="decision", request_id="r", variant=None, model={}, seconds=0
    )
    assert record_template_key(record) == template_key(asked)
    assert template_key(replace(asked, id="other", state="Other text.")) == template_key(asked)
    reordered = replace(asked, options=asked.options[::-1])
    assert template_key(reordered) != template_key(asked)  # as_given reads it otherwise
    assert record_template_key({"question_sha256": "q"}) is None
