"""`semif-bench-tasks`: the invalid-answer rule, and a smoke run against a real `serve`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from bench.metrics import Answer
from bench.runner import (
    Outcome,
    coverage_curve,
    format_table,
    format_threshold,
    run_tasks,
    summarize,
    threshold_for,
)
from bench.tasks import Task, load_tasks
from client.decision_client import EndpointError

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class ScriptedClient:
    """Answers each task id with a scripted response (or raises), like a faulty server."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers

    def invoke(self, body: Mapping[str, Any]) -> Any:
        answer = self.answers[body["decision"]["id"]]
        if isinstance(answer, Exception):
            raise answer
        return answer


def result(option_ids: list[str], probabilities: list[float]) -> dict[str, Any]:
    return {
        "result": {
            "option_ids": option_ids,
            "probabilities": probabilities,
            "input_tokens": 120,
            "timing": {"evaluated_tokens": 100, "reused_tokens": 20},
        }
    }


def policy_tasks(count: int) -> list[Task]:
    return [t for t in load_tasks() if t.question_type == "noul"][:count]


def test_invalid_answers_count_as_wrong_and_keep_the_run_going() -> None:
    tasks = policy_tasks(5)
    right = {t.id: t.expected for t in tasks}
    scripted: dict[str, Any] = {
        # correct and valid
        tasks[0].id: result(["yes", "no"], [1.0, 0.0] if right[tasks[0].id] == "yes" else [0, 1]),
        # argmax right, but the probabilities sum to 1.01: invalid, so wrong
        tasks[1].id: result(
            ["yes", "no"], [0.99, 0.02] if right[tasks[1].id] == "yes" else [0.02, 0.99]
        ),
        # labels do not match the task's
        tasks[2].id: result(["true", "false"], [0.5, 0.5]),
        # no result object at all
        tasks[3].id: {"error": "model is loading"},
        # transport failure
        tasks[4].id: EndpointError(500, "scoring failed", "{}"),
    }
    outcomes = run_tasks(ScriptedClient(scripted), tasks, concurrency=2)
    assert [o.task.id for o in outcomes] == [t.id for t in tasks]  # order kept under concurrency
    assert [o.answer is not None for o in outcomes] == [True, False, False, False, False]
    assert "HTTP 500" in (outcomes[4].error or "")
    summary = summarize(outcomes)
    assert summary["valid"] == 1
    assert summary["accuracy"] == pytest.approx(1 / 5)
    assert summary["brier"] == pytest.approx(0.0)  # over the one valid answer
    assert summary["input_tokens_per_decision"] == pytest.approx(120)
    assert "all" in format_table({"all": summary})


def test_policy_fields_go_into_every_body() -> None:
    tasks = policy_tasks(2)
    seen: list[Mapping[str, Any]] = []

    class Recording:
        def invoke(self, body: Mapping[str, Any]) -> Any:
            seen.append(body)
            return result(["yes", "no"], [0.5, 0.5])

    run_tasks(Recording(), tasks, concurrency=1, policy={"option_order": "debiased"})
    assert [body["option_order"] for body in seen] == ["debiased", "debiased"]
    assert [body["decision"]["id"] for body in seen] == [t.id for t in tasks]


def test_coverage_curve_and_the_threshold_for_a_target_accuracy() -> None:
    tasks = policy_tasks(5)

    def outcome(task: Task, confidence: float | None, right: bool) -> Outcome:
        if confidence is None:
            return Outcome(task, None, 0.0, error="invalid")
        other = "no" if task.expected == "yes" else "yes"
        top = task.expected if right else other
        rest = other if right else task.expected
        return Outcome(task, Answer({top: confidence, rest: 1 - confidence}), 0.0)

    outcomes = [
        outcome(tasks[0], 0.9, True),
        outcome(tasks[1], 0.8, True),
        outcome(tasks[2], 0.8, False),
        outcome(tasks[3], 0.6, True),
        outcome(tasks[4], None, False),  # invalid: never kept, still counts in coverage
    ]
    curve = coverage_curve(outcomes)
    assert curve == [
        {"threshold": 0.9, "coverage": 0.2, "accuracy": 1.0},
        {"threshold": 0.8, "coverage": 0.6, "accuracy": pytest.approx(2 / 3)},
        {"threshold": 0.6, "coverage": 0.8, "accuracy": 0.75},
    ]
    assert threshold_for(curve, 0.75) == curve[2]
    assert threshold_for(curve, 0.9) == curve[0]
    assert threshold_for(curve, 1.0) == curve[0]
    assert "keeps 20% of decisions" in format_threshold(
        {"target_accuracy": 1.0, "threshold": curve[0]}
    )
    assert "no min_confidence reaches" in format_threshold(
        {"target_accuracy": 0.9, "threshold": threshold_for([], 0.9)}
    )


@pytest.mark.slow
def test_smoke_run_against_a_real_server(tmp_path: Path) -> None:
    """Console script, local `serve` on the embedded model, two concurrent clients (the
    server admits one request at a time, so the client's busy retries are exercised)."""
    command = [
        str(Path(sys.executable).parent / "semif-bench-tasks"),
        "--local", "--smoke", "--concurrency", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "bench-tasks.json").read_text())
    assert report["schema"] == "semif-bench-tasks/1"
    assert report["concurrency"] == 2
    overall = report["overall"]
    assert overall["tasks"] == overall["valid"] == 4
    assert 0.0 <= overall["accuracy"] <= 1.0
    assert 0.0 <= overall["brier"] <= 2.0
    assert 0.0 <= overall["ece"] <= 1.0
    latency = overall["latency_seconds"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    assert overall["input_tokens_per_decision"] > 0
    labels = {t.id: set(t.labels) for t in load_tasks()}
    for outcome in report["outcomes"]:
        assert outcome["valid"]
        assert outcome["error"] is None
        assert set(outcome["probabilities"]) == labels[outcome["id"]]
        assert math.isclose(sum(outcome["probabilities"].values()), 1.0, abs_tol=1e-3)
    assert (tmp_path / "bench-tasks-latency.png").read_bytes().startswith(PNG_MAGIC)
    assert "all" in run.stdout
    abstention = report["abstention"]
    assert abstention["curve"][-1]["coverage"] == 1.0
    assert "abstention:" in run.stdout
