"""`semif-calibrate --from-audit RECORDS --labels LABELS` (bench.audit_tasks): records that a
real server wrote at `SEMIF_AUDIT=full`, joined with labels, fitted as a task file is; from
a local file (with CloudWatch-export prefixes and other log lines) and from S3 (moto)."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest
from moto import mock_aws

from adapter.app import create_app
from adapter.settings import Settings
from bench.audit_tasks import AuditTasksError, audit_tasks, read_labels, records
from bench.calibrate import main
from bench.tasks import decision_json, load_tasks
from model_build.calibration import load_calibration
from tests.support.live_server import live_server
from tests.support.serving import post_ok, serving


def _served_records(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """Six smoke choice tasks asked of a server keeping full records: the log text (each
    record behind a timestamp, a log line between) and their labels."""
    tasks = [t for t in load_tasks() if t.question_type == "choice"][:6]
    settings = Settings(model_dir=model_dir, max_tokens=2048, threads=2, audit="full")
    with serving(settings) as client:
        answered = [post_ok(client, {"decision": decision_json(t.decision)}) for t in tasks]
    lines = capsys.readouterr().out.splitlines()
    log = "\n".join(
        f"2026-12-05T22:00:0{i}Z {line}\nINFO other log" for i, line in enumerate(lines)
    )
    labels = "\n".join(
        json.dumps(
            {"request_id": a["request_id"], "decision_id": t.decision.id, "label": t.expected}
        )
        for a, t in zip(answered, tasks, strict=True)
    )
    return log, labels


def test_records_joined_with_labels_fit_a_calibration(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log, labels = _served_records(tiny_model_dir, capsys)
    served = records(log.splitlines())
    assert len(served) == 6
    assert all("request" in record for record in served)
    joined = audit_tasks(served, read_labels(labels.splitlines(), "labels"))
    assert (len(joined.tasks), joined.unlabelled) == (6, 0)
    assert joined.tasks[0].decision.state == served[0]["request"]["state"]
    (tmp_path / "records.log").write_text(log)
    (tmp_path / "labels.jsonl").write_text(labels)
    settings = Settings(model_dir=tiny_model_dir, max_tokens=2048, threads=2)
    with live_server(create_app(settings)) as url:
        main(
            [
                "--from-audit", str(tmp_path / "records.log"),
                "--labels", str(tmp_path / "labels.jsonl"),
                "--url", url, "--folds", "2", "--no-likelihood", "--out", str(tmp_path / "out"),
            ]
        )  # fmt: skip
        with mock_aws():
            s3 = boto3.client("s3", region_name="us-east-1")
            s3.create_bucket(Bucket="audit")
            s3.put_object(Bucket="audit", Key="records.log", Body=log.encode())
            s3.put_object(Bucket="audit", Key="labels.jsonl", Body=labels.encode())
            main(
                [
                    "--from-audit", "s3://audit/records.log",
                    "--labels", "s3://audit/labels.jsonl", "--region", "us-east-1",
                    "--url", url, "--folds", "2", "--no-likelihood", "--out", str(tmp_path / "s3"),
                ]
            )  # fmt: skip
    printed = capsys.readouterr().out
    assert "6 labelled records (0 without a label)" in printed
    local = load_calibration(tmp_path / "out" / "calibration.json")
    assert local.counts["choice"] == 6
    assert load_calibration(tmp_path / "s3" / "calibration.json") == local


def test_what_cannot_become_a_task_is_named() -> None:
    digest = {"request_id": "r", "decision_id": "d", "level": "digest"}
    with pytest.raises(AuditTasksError, match="record r/d: a labelled record must be a full"):
        audit_tasks([digest], {("r", "d"): "a"})
    full = {
        **digest,
        "level": "full",
        "request": {"state": "s", "question": "q", "options": [
            {"id": "a", "description": "A."}, {"id": "b", "description": "B."}
        ]},
    }  # fmt: skip
    with pytest.raises(AuditTasksError, match="label 'c' is not one of its options"):
        audit_tasks([full], {(None, "d"): "c"})
    assert audit_tasks([full], {}).unlabelled == 1
    with pytest.raises(AuditTasksError, match="labels:2: needs string decision_id and label"):
        read_labels(['{"decision_id": "d", "label": "a"}', '{"label": "a"}'], "labels")
