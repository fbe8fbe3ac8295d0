"""The order-invariance benchmark: its counting by hand, and a run against a real tiny
`serve`, where canonical and debiased must not move at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from adapter.app import create_app
from adapter.settings import Settings
from bench.metrics import Answer
from bench.quality import (
    ORDERINGS,
    _invariance,
    format_quality,
    labelled,
    reorder,
    run_listing,
    run_quality,
)
from bench.runner import open_client
from bench.tasks import load_tasks
from tests.support.live_server import live_server


def test_flips_and_tv_count_against_the_original_order() -> None:
    a = Answer({"x": 0.7, "y": 0.3})
    b = Answer({"x": 0.4, "y": 0.6})
    answers = {"original": [a, a], "reversed": [a, b], "shuffled": [b, b]}
    row = _invariance(answers, ["x", "y"])
    assert row["argmax_flips"] == {"reversed": 1, "shuffled": 2}
    assert row["mean_tv"]["reversed"] == pytest.approx(0.15)
    assert row["mean_tv"]["shuffled"] == pytest.approx(0.3)
    assert row["accuracy"] == pytest.approx(4 / 6)  # pooled over the three orderings


def test_reorderings_keep_every_option() -> None:
    decision = load_tasks()[0].decision
    rng = np.random.default_rng(1)
    for ordering in ORDERINGS:
        moved = reorder(decision, ordering, rng)
        assert sorted(moved.options, key=lambda o: o.id) == sorted(
            decision.options, key=lambda o: o.id
        )
    assert reorder(decision, "reversed", rng).options == decision.options[::-1]


def test_a_run_shows_canonical_and_debiased_invariant(tiny_model_dir: Path) -> None:
    tasks = [t for t in load_tasks() if t.question_type != "score"][:8:2] + load_tasks()[-2:]
    settings = Settings(model_dir=tiny_model_dir, max_tokens=2048, threads=2)
    with live_server(create_app(settings)) as url:
        client = open_client(url=url, endpoint=None, region=None, timeout_s=60)
        report = run_quality(
            client, tasks, folds=2, cost_repeats=1, cost_states=(30,), likelihood_state=30
        )
    invariance = report["invariance"]
    for mode in ("canonical", "debiased"):
        assert invariance[mode]["argmax_flips"] == {"reversed": 0, "shuffled": 0}
        assert max(invariance[mode]["mean_tv"].values()) < 1e-6, mode
    assert invariance["as_given"]["mean_tv"]["reversed"] > 1e-3
    assert [(row["state_tokens"], row["options"]) for row in report["cost"]] == [
        (30, 3),
        (30, 5),
        (30, 8),
    ]
    for row in report["cost"]:
        given, debiased = row["as_given"], row["debiased"]
        assert debiased["prompts"] == row["options"]
        # The state and system turn are evaluated once, not once per rotation.
        assert 1 < row["token_ratio"] < row["options"]
        assert debiased["evaluated_tokens"] < row["options"] * given["evaluated_tokens"]
    assert set(report["prior"]["prior_recovers"]) == {"accuracy", "nll", "brier"}
    text = format_quality(report)
    assert "canonical + prior" in text
    assert "likelihood pmi" in text
    likelihood = report["likelihood"]
    for normalization, row in likelihood["invariance"].items():  # by construction
        assert row["argmax_flips"] == {"reversed": 0, "shuffled": 0}, normalization
        assert max(row["mean_tv"].values()) == 0.0, normalization
        assert row["nll"] > 0
    assert [row["options"] for row in likelihood["cost"]] == [3, 5, 8, 32]
    small, large = likelihood["cost"][0], likelihood["cost"][-1]
    assert small["tokens_vs_canonical"] > 0
    assert small["tokens_vs_debiased"] > 0
    assert large["canonical"] is None
    assert large["tokens_vs_debiased"] is None
    assert large["likelihood"]["evaluated_tokens"] > small["likelihood"]["evaluated_tokens"]
    # one-word labels score fewer tokens than the options' words
    assert large["label_tokens_vs_words"] < 1
    assert set(likelihood["answer_texts"]) == {
        f"{text} {n}" for text in ("description", "id", "name") for n in ("sum", "mean", "pmi")
    }
    for name, row in likelihood["answer_texts"].items():
        assert row["nll"] > 0, name
    assert likelihood["prompt_version"] == "semif-option-likelihood-unlisted/1"
    # the listed prompt, on a second server
    listed_settings = Settings(
        model_dir=tiny_model_dir, max_tokens=2048, threads=2, likelihood_prompt="listed"
    )
    with live_server(create_app(listed_settings)) as url:
        client = open_client(url=url, endpoint=None, region=None, timeout_s=60)
        report["likelihood"]["listed"] = run_listing(
            client, tasks[:2], cost_repeats=1, likelihood_state=30
        )
    listed = report["likelihood"]["listed"]
    assert listed["prompt_version"] == "semif-option-likelihood/1"
    assert len(listed["answer_texts"]) == 9
    assert listed["cost"][0]["canonical"] is None  # the letters are the first server's
    # the unlisted prompt does not grow with the options: 32 options cost less than listed
    assert (
        large["likelihood"]["evaluated_tokens"]
        < listed["cost"][-1]["likelihood"]["evaluated_tokens"]
    )
    text = format_quality(report)
    assert "unlisted name mean" in text
    assert "listed description sum" in text
    # --likelihood-only: no letters tables, the likelihood's all there
    likelihood_only = {k: v for k, v in report.items() if k not in ("invariance", "cost")}
    likelihood_only["likelihood"] = {k: v for k, v in likelihood.items() if k != "invariance"}
    short = format_quality(likelihood_only)
    assert "flips rev" not in short
    assert "unlisted name mean" in short
    calibrated = report["likelihood_calibration"]["likelihood mean"]
    assert set(calibrated) == {"uncalibrated", "calibrated"}
    # Prediction sets for the letters, every normalization and the choice tasks read as
    # multi-label questions, each coverage and method.
    assert set(report["conformal"]) == {
        "letters",
        "likelihood:sum",
        "likelihood:mean",
        "likelihood:pmi",
        "multi_label",
    }
    assert set(report["conformal"]["letters"]["0.9"]) == {"lac", "aps"}
    assert "prediction sets (held out" in text


def test_answer_texts_label_options_by_id_or_by_its_words() -> None:
    task = next(t for t in load_tasks() if "_" in t.decision.options[0].id)
    assert labelled(task, "description") == task
    by_id = labelled(task, "id").decision.options[0]
    by_name = labelled(task, "name").decision.options[0]
    assert by_id.label == task.decision.options[0].id
    assert by_name.label == task.decision.options[0].id.replace("_", " ")
    assert by_name.description == task.decision.options[0].description
