"""Audit records (adapter.audit): what each level keeps and never keeps, the size bound, a
writer that can never hold up a decision, and records from real requests (the decision API
and JSON Lines) on the tiny model."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest

from adapter.audit import KEPT_OPTIONS, MAX_RECORD_BYTES, AuditLog, decision_record
from adapter.schema import Decision, Option
from adapter.settings import Settings, SettingsError, load_settings
from tests.support.serving import decision, post_ok, serving

SECRET_STATE = "Customer 4411 (jane@example.com) says the parcel never came."
DECISION = Decision(
    "route",
    SECRET_STATE,
    "Which queue handles it?",
    (Option("shipping", "Shipping questions."), Option("billing", "Billing questions.")),
)
RESULT = {
    "option_ids": ["shipping", "billing"],
    "probabilities": [0.7, 0.3],
    "prompt_sha256": "ab" * 32,
    "prompt_version": "semif-direct-options/1",
    "readout": "letters",
    "option_order": "canonical",
    "abstained": False,
    "abstain_reason": None,
    "timing": {"prompts": 1, "evaluated_tokens": 90, "reused_tokens": 10},
}
MODEL = {"file": "m.gguf", "sha256": "cd" * 32, "calibration": None, "backends": ["CPU"]}


def _record(level: Any, decision: Decision = DECISION, result: Any = RESULT) -> dict[str, Any]:
    return decision_record(
        level,
        decision,
        result,
        api="decision",
        request_id="r1",
        variant=None,
        model=MODEL,
        seconds=0.25,
    )


def test_a_digest_says_what_was_decided_and_never_the_request_text() -> None:
    record = _record("digest")
    text = json.dumps(record)
    for secret in (SECRET_STATE, "Which queue", "Shipping questions."):
        assert secret not in text
    assert (record["request_id"], record["decision_id"]) == ("r1", "route")  # the join key
    assert record["probabilities"] == [0.7, 0.3]
    assert record["model"] == {
        "file": "m.gguf",
        "sha256": "cd" * 32,
        "calibration": None,
        "backends": ["CPU"],
        "chat_template": None,
    }
    assert len(record["state_sha256"]) == len(record["options_sha256"]) == 64
    assert record["timing"]["evaluated_tokens"] == 90
    assert "omitted" not in record
    assert "audit_id" not in record
    assert "variant" not in record
    moved = Decision("route", SECRET_STATE + " ", DECISION.question, DECISION.options)
    assert _record("digest", moved)["state_sha256"] != record["state_sha256"]


def test_full_keeps_the_request_and_needs_the_environment_to_opt_in() -> None:
    record = _record("full")
    assert record["request"]["state"] == SECRET_STATE
    assert record["request"]["options"][1] == {
        "id": "billing",
        "description": "Billing questions.",
        "label": None,
    }
    with pytest.raises(SettingsError, match="SEMIF_AUDIT_ALLOW_FULL"):
        load_settings({"SEMIF_AUDIT": "full"})
    assert load_settings({"SEMIF_AUDIT": "full", "SEMIF_AUDIT_ALLOW_FULL": "true"}).audit == "full"
    assert load_settings({}).audit == "none"
    with pytest.raises(SettingsError, match="SEMIF_AUDIT"):
        load_settings({"SEMIF_AUDIT": "everything"})


def test_a_record_stays_within_its_bound_and_says_what_it_left_out() -> None:
    huge = Decision("route", "x" * (2 * MAX_RECORD_BYTES), "q", DECISION.options)
    record = _record("full", huge)
    assert record["omitted"] == ["request"]
    assert len(json.dumps(record).encode()) <= MAX_RECORD_BYTES
    options = tuple(Option(f"option-{i:04d}-" + "y" * 200, "d") for i in range(1024))
    many = Decision("route", "s", "q", options)
    probabilities = [i / 1024 for i in range(1024)]
    result = {**RESULT, "option_ids": [o.id for o in options], "probabilities": probabilities}
    record = _record("digest", many, result)
    assert record["omitted"] == ["options"]
    assert record["probabilities"] == sorted(probabilities, reverse=True)[:KEPT_OPTIONS]
    assert len(json.dumps(record).encode()) <= MAX_RECORD_BYTES


def test_a_blocked_log_never_holds_up_a_decision() -> None:
    """The writer is stuck on its first record: the next ones fill the queue and the rest
    are dropped and counted, each call returning at once; once the log moves, what was
    queued is written."""
    release, written, dropped = threading.Event(), [], []

    def write(line: str) -> None:
        release.wait(10)
        written.append(line)

    log = AuditLog(
        "digest",
        write=write,
        on_dropped=lambda: dropped.append(1),
        capacity=2,
    )
    for _ in range(6):
        log.decisions(
            [DECISION], [RESULT], api="decision", request_id="r", model=MODEL, seconds=0.1
        )
    assert 3 <= len(dropped) <= 4  # one in the writer's hands (maybe), two queued
    release.set()
    log.close()
    assert len(written) + len(dropped) == 6
    assert all(json.loads(line)["audit"]["decision_id"] == "route" for line in written)


def test_requests_and_json_lines_leave_one_record_per_decision(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, audit="digest")
    with serving(settings) as client:
        single = post_ok(client, {"decision": decision("one")})
        post_ok(client, {"decisions": [decision("a"), decision("b", question="Who?")]})
        lines = "\n".join(json.dumps({"decision": decision(f"l{i}")}) for i in range(2))
        answered = client.post(
            "/invocations", content=lines, headers={"content-type": "application/jsonlines"}
        )
        assert answered.status_code == 200
        metrics = client.get("/metrics").text
    records = [json.loads(line)["audit"] for line in capsys.readouterr().out.splitlines()]
    assert [record["decision_id"] for record in records] == ["one", "a", "b", "l0", "l1"]
    first = records[0]
    assert first["request_id"] == single["request_id"]
    assert first["probabilities"] == single["result"]["probabilities"]
    assert first["prompt_sha256"] == single["result"]["prompt_sha256"]
    # No manifest beside the tiny GGUF: the identity has its file name, no sha256.
    assert (first["model"]["file"], first["model"]["sha256"]) == (single["model"]["file"], None)
    assert all(record["level"] == "digest" and "request" not in record for record in records)
    assert records[3]["request_id"].endswith(":0")  # a JSON Lines line: the body's id and line
    assert "semif_audit_records_total" in metrics


def test_the_callers_audit_id_and_the_variant_go_into_every_record(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The body's audit_id on each of its decisions' records (JSON Lines: each line's own,
    also when lines about one state are merged into one batch), System One's questions
    recorded under their keys, and SEMIF_VARIANT naming the side of a shadow test."""
    settings = Settings(
        model_dir=tiny_model_dir,
        max_tokens=1024,
        threads=2,
        audit="digest",
        variant="candidate-1",
    )
    questions = {
        "refund": {"type": "noul", "instructions": "Is a refund asked for?"},
        "queue": {
            "type": "choice",
            "instructions": "Which queue handles it?",
            "criteria": {"billing": "Billing.", "shipping": "Shipping."},
        },
    }
    with serving(settings) as client:
        post_ok(client, {"decision": decision("one"), "audit_id": "case-7/2026"})
        lines = "\n".join(
            json.dumps({"decision": decision(f"l{i}"), "audit_id": f"line-{i}"}) for i in range(2)
        )
        answered = client.post(
            "/invocations", content=lines, headers={"content-type": "application/jsonlines"}
        )
        assert answered.status_code == 200
        system_one = post_ok(
            client,
            {"state": "I was charged twice.", "questions": questions, "audit_id": "s1"},
            "/v1/systemone",
        )
        refused = client.post(
            "/invocations",
            content=json.dumps({"decision": decision("x"), "audit_id": "no spaces"}),
            headers={"content-type": "application/json"},
        )
    assert refused.status_code == 400
    assert refused.json()["field"] == "audit_id"
    records = [json.loads(line)["audit"] for line in capsys.readouterr().out.splitlines()]
    keys = [(r["api"], r["decision_id"], r.get("audit_id")) for r in records]
    assert keys == [
        ("decision", "one", "case-7/2026"),
        ("decision", "l0", "line-0"),
        ("decision", "l1", "line-1"),
        ("systemone", "refund", "s1"),
        ("systemone", "queue", "s1"),
    ]
    assert {record["variant"] for record in records} == {"candidate-1"}
    refund, queue = records[3:]
    assert refund["option_ids"] == ["true", "false"]
    assert refund["probabilities"][0] == system_one["answers"]["refund"]["noul"]
    assert (refund["kind"], queue["kind"]) == ("noul", "choice")
    keyed = dict(zip(queue["option_ids"], queue["probabilities"], strict=True))
    assert keyed == system_one["answers"]["queue"]["probabilities"]
    assert queue["timing"]["reused_tokens"] > 0  # the state was decoded for "refund" first
    assert len(queue["prompt_sha256"]) == 64
    assert queue["readout"] == "letters"


def test_the_variant_must_be_a_sagemaker_variant_name() -> None:
    assert load_settings({"SEMIF_VARIANT": "AllTraffic"}).variant == "AllTraffic"
    assert load_settings({}).variant is None
    for wrong in ("-lead", "has space", "x" * 64):
        with pytest.raises(SettingsError, match="SEMIF_VARIANT"):
            load_settings({"SEMIF_VARIANT": wrong})
