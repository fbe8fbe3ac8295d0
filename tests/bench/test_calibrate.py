"""`semif-calibrate`: the fits recover what was planted, and a run against a real tiny
`serve` writes a calibration the adapter accepts (the likelihood readout's section too),
fitted on what the adapter serves; `--unlabelled` fits template priors from request lines
and from audit records (a file, S3) that the adapter then serves."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import boto3
import numpy as np
import pytest
from moto import mock_aws

from adapter.app import create_app
from adapter.calibration import check_calibration
from adapter.ordering import canonical_order, rotations
from adapter.prompts import LIKELIHOOD_PROMPT_VERSIONS, PROMPT_VERSION
from adapter.readout import log_softmax
from adapter.settings import Settings
from adapter.template_key import template_key
from bench.calibrate import (
    TEMPERATURE_BOUNDS,
    Scored,
    calibrate,
    estimate_prior,
    fit_temperature,
    main,
    score_all,
    summarize,
)
from bench.metrics import Answer
from bench.multi_label_fit import rows
from bench.runner import open_client
from bench.tasks import SMOKE_TASKS, Task, decision_json, load_tasks, single_body
from model_build.calibration import OptionOrder, load_calibration
from tests.support.live_server import live_server
from tests.support.manifests import write_manifest
from tests.support.serving import post_ok, serving

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_fit_temperature_recovers_a_planted_temperature() -> None:
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 3.0, size=(2000, 4))
    truth = 2.5  # labels drawn from softmax(logits / 2.5): the logits are overconfident
    labels = [int(rng.choice(4, p=np.exp(log_softmax(row / truth)))) for row in logits]
    fitted = fit_temperature([log_softmax(row) for row in logits], labels)
    assert fitted == pytest.approx(truth, rel=0.1)


def test_fit_temperature_stays_within_its_bounds() -> None:
    rows = [log_softmax(np.array([5.0, 0.0, 0.0]))] * 20  # always right, never sure enough
    assert fit_temperature(rows, [0] * 20) == pytest.approx(TEMPERATURE_BOUNDS[0], rel=1e-3)


def _choice_tasks() -> list[Task]:
    return [t for t in load_tasks() if t.question_type == "choice"][:6]


def test_estimate_prior_recovers_a_planted_position_prior() -> None:
    """PriDe: observed(position j) = prior[j] x content[option at j], renormalised, in each
    rotation; the estimate is the prior whatever each task's content is."""
    prior = np.array([0.4, 0.3, 0.2, 0.1])
    rng = np.random.default_rng(3)
    scored = []
    for task in _choice_tasks():
        content = rng.dirichlet(np.ones(4))
        rows = {}
        for order in rotations(canonical_order(task.decision.options), limit=None):
            observed = prior * content[list(order)]
            rows[order] = np.log(observed / observed.sum())
        scored.append(Scored(task, rows))
    [(count, estimate)] = estimate_prior(scored).items()
    assert count == 4
    assert estimate == pytest.approx(list(prior), abs=1e-9)


def test_the_prior_recovers_a_share_of_debiaseds_gain_only_when_there_is_one() -> None:
    right, unsure, wrong = (
        Answer({"x": 0.9, "y": 0.1}),
        Answer({"x": 0.6, "y": 0.4}),
        Answer({"x": 0.2, "y": 0.8}),
    )
    stages: dict[OptionOrder, dict[str, list[Answer]]] = {
        "as_given": {"uncalibrated": [wrong], "prior": [wrong], "calibrated": [wrong]},
        "canonical": {"uncalibrated": [wrong], "prior": [unsure], "calibrated": [unsure]},
        "debiased": {"uncalibrated": [right], "prior": [right], "calibrated": [right]},
    }
    shares = summarize(stages, ["x"])["prior_recovers"]
    assert shares["accuracy"] == pytest.approx(1.0)  # wrong -> right, and the prior got it
    assert 0 < shares["nll"] < 1
    stages["debiased"] = stages["as_given"]  # debiased no better than canonical
    assert summarize(stages, ["x"])["prior_recovers"]["accuracy"] is None


def _mixed_tasks(path: Path) -> list[Task]:
    """Four of each kind, written as a task file."""
    lines = SMOKE_TASKS.read_text().splitlines()
    chosen = []
    for kind in ("choice", "noul", "score"):
        chosen += [line for line in lines if f'"type": "{kind}"' in line][:4]
    path.write_text("\n".join(chosen) + "\n")
    return load_tasks(path)


@pytest.fixture
def tiny_url(tiny_model_dir: Path) -> Iterator[str]:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=2048, threads=2, prefix_reuse=False)
    with live_server(create_app(settings)) as url:
        yield url


def test_a_run_writes_a_calibration_the_adapter_reads(tiny_url: str, tmp_path: Path) -> None:
    tasks_file = tmp_path / "tasks.jsonl"
    tasks = _mixed_tasks(tasks_file)
    out = tmp_path / "out"
    main([str(tasks_file), "--url", tiny_url, "--folds", "2", "--out", str(out)])
    calibration = load_calibration(out / "calibration.json")
    assert calibration.prompt_version == PROMPT_VERSION
    assert calibration.option_order == "canonical"
    # The choice tasks read as multi-label questions too (bench.multi_label_fit).
    assert set(calibration.temperatures) == {"choice", "noul", "score", "multi_label"}
    assert calibration.counts == {"choice": 4, "noul": 4, "score": 4, "multi_label": 4}
    assert sorted(calibration.position_prior) == [2, 4]  # nominal counts only; score has 5
    assert len(tasks) == 12
    report = json.loads((out / "calibrate-report.json").read_text())
    for mode in ("as_given", "canonical", "debiased"):
        assert set(report["held_out"][mode]["uncalibrated"]) == {"accuracy", "nll", "brier", "ece"}
    assert calibration.metrics["held_out"] == report["held_out"]["canonical"]
    assert (out / "reliability.png").read_bytes().startswith(PNG_MAGIC)
    # The likelihood readout: a temperature per normalization for the nominal kinds only
    # (score questions are read by letters), held out like the letters'.
    assert calibration.likelihood is not None
    assert calibration.likelihood.prompt_version == LIKELIHOOD_PROMPT_VERSIONS["unlisted"]
    assert {n: set(kinds) for n, kinds in calibration.likelihood.temperatures.items()} == {
        n: {"choice", "noul"} for n in ("sum", "mean", "pmi")
    }
    for name in ("likelihood sum", "likelihood mean", "likelihood pmi"):
        assert set(report["likelihood_held_out"][name]) == {"uncalibrated", "calibrated"}


def test_without_likelihood_the_file_has_no_likelihood_section(
    tiny_url: str, tmp_path: Path
) -> None:
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("\n".join(SMOKE_TASKS.read_text().splitlines()[:4]) + "\n")
    out = tmp_path / "out"
    main([str(tasks_file), "--url", tiny_url, "--folds", "2", "--out", str(out), "--no-likelihood"])
    calibration = load_calibration(out / "calibration.json")
    assert calibration.likelihood is None
    assert "likelihood" not in json.loads((out / "calibration.json").read_text())


def test_what_is_fitted_is_what_is_served(tiny_url: str) -> None:
    """The client-side distributions (from the as_given batch of every order) are the
    server's own answers. Debiased decodes the same branches of the same prefix, so it
    agrees to float noise; canonical's one prompt is decoded in other chunks (prefill then
    its last token), llama.cpp's batch-shape numerics: measured up to 1.3e-3 on the tiny
    model. A mapping by the wrong order is off by tenths."""
    client = open_client(url=tiny_url, endpoint=None, region=None, timeout_s=60)
    tasks = _choice_tasks()[:2]
    read = score_all(client, tasks)
    assert read.prompt_version == PROMPT_VERSION
    assert read.likelihood_version == LIKELIHOOD_PROMPT_VERSIONS["unlisted"]
    for item in read.scored:
        modes: tuple[tuple[OptionOrder, float], ...] = (("canonical", 5e-3), ("debiased", 1e-5))
        for mode, tolerance in modes:
            served = client.invoke({**single_body(item.task.decision), "option_order": mode})
            ours = item.probabilities(mode, None)
            assert served["result"]["probabilities"] == pytest.approx(list(ours), abs=tolerance)
        # Read by likelihood, the same request is the same arithmetic.
        for normalization in ("sum", "mean", "pmi"):
            body = {**single_body(item.task.decision), "readout": "likelihood"}
            served = client.invoke(body | {"normalization": normalization})
            ours = item.likely(normalization, None)
            assert served["result"]["probabilities"] == pytest.approx(list(ours), abs=1e-9)
        # Read as multi-label: the fit's rows at temperature 1 are the server's answer.
        assert item.applies is not None
        multi = replace(item.task.decision, kind="multi_label")
        served = client.invoke(single_body(multi))["result"]["probabilities"]
        ((applies, right),) = rows([item.applies], [1.0])
        assert served == applies
        assert right == item.task.labels.index(item.task.expected)


def test_conformal_writes_sets_the_adapter_serves_and_reports_their_coverage(
    tiny_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tasks_file = tmp_path / "tasks.jsonl"
    _mixed_tasks(tasks_file)
    out = tmp_path / "out"
    main([str(tasks_file), "--url", tiny_url, "--folds", "2", "--out", str(out), "--conformal"])
    calibration = load_calibration(out / "calibration.json")
    check_calibration(calibration, "unlisted")  # fitted under the prompts this adapter renders
    letters = calibration.conformal["letters"]
    assert (letters.prompt_version, letters.option_order) == (PROMPT_VERSION, "canonical")
    assert {kind: s.count for kind, s in letters.scores.items()} == {
        "choice": 4,
        "noul": 4,
        "score": 4,
        "multi_label": 4,  # one applicable option per choice task read as multi-label
    }
    for normalization in ("sum", "mean", "pmi"):
        section = calibration.conformal[f"likelihood:{normalization}"]
        assert section.prompt_version == LIKELIHOOD_PROMPT_VERSIONS["unlisted"]
        assert set(section.scores) == {"choice", "noul"}  # score tasks are read by letters
    report = json.loads((out / "calibrate-report.json").read_text())
    row = report["conformal"]["letters"]["0.8"]["lac"]
    assert 0 <= row["coverage"] <= 1
    assert row["calibration_questions"] == 6  # half of the 12 held-out answers
    multi = report["conformal"]["multi_label"]["0.8"]["lac"]
    assert multi["calibration_questions"] == 2  # half of the 4 choice tasks
    # Two held-out scores cannot back 0.8 (it needs 4): every set is every option.
    assert (multi["coverage"], multi["singletons"]) == (1.0, 0.0)
    assert "conformal prediction sets" in capsys.readouterr().out


def _routing_and_priority() -> tuple[list[Task], list[Task]]:
    """Six inputs of one template (the routing question) and two of another."""
    choices = [t for t in load_tasks() if t.question_type == "choice"]
    routing = [t for t in choices if t.family == "routing"][:6]
    priority = [t for t in choices if t.family != "routing"][:2]
    return routing, priority


def test_unlabelled_requests_fit_template_priors_the_adapter_serves(
    tiny_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    routing, priority = _routing_and_priority()
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        "".join(
            json.dumps({"decision": decision_json(t.decision), "option_order": "as_given"}) + "\n"
            for t in routing + priority
        )
    )
    out = tmp_path / "out"
    main(["--unlabelled", str(requests), "--url", tiny_url, "--min-inputs", "5", "--out", str(out)])
    calibration = load_calibration(out / "calibration.json")
    check_calibration(calibration, "unlisted")
    priors = calibration.template_priors
    assert priors is not None
    assert priors.option_order == "canonical"
    key = template_key(routing[0].decision)
    assert list(priors.templates) == [key]
    report = json.loads((out / "template-priors-report.json").read_text())
    assert report["too_few"] == {template_key(priority[0].decision): 2}
    assert (report["inputs"], report["scored_again"]) == (8, 8)
    # The prior is the mean of what the server serves in canonical, uncorrected (the
    # request lines' own option_order is not what it is for).
    client = open_client(url=tiny_url, endpoint=None, region=None, timeout_s=60)
    served = [
        client.invoke({**single_body(t.decision), "option_order": "canonical"})["result"]
        for t in routing
    ]
    mean = np.mean([answer["probabilities"] for answer in served], axis=0)
    fitted = priors.templates[key]
    assert (fitted.option_ids, fitted.inputs) == (routing[0].labels, 6)
    assert fitted.prior == pytest.approx(list(mean), abs=5e-3)
    # Served: divided out by option id, on this template only, and said so.
    write_manifest(tiny_model_dir, calibration)
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=2048, threads=2)) as adapter:
        corrected = post_ok(adapter, single_body(routing[0].decision))["result"]
        other = post_ok(adapter, single_body(priority[0].decision))["result"]
    expected = np.asarray(served[0]["probabilities"]) / np.asarray(fitted.prior)
    assert corrected["probabilities"] == pytest.approx(list(expected / expected.sum()), abs=5e-3)
    assert corrected["calibration"]["template_prior"] is True
    assert other["calibration"]["template_prior"] is False


def _audit_log(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> tuple[str, str]:
    """The routing inputs asked of a server keeping full records, in canonical (the records'
    probabilities are what the prior needs) and in as_given (they must be scored again):
    the canonical records' log text, and all of it."""
    routing, _ = _routing_and_priority()
    capsys.readouterr()
    settings = Settings(model_dir=model_dir, max_tokens=2048, threads=2, audit="full")
    logs = []
    with serving(settings) as client:
        for order in ("canonical", "as_given"):
            for task in routing:
                post_ok(client, {**single_body(task.decision), "option_order": order})
            logs.append(capsys.readouterr().out)
    return logs[0], "".join(logs)


def test_unlabelled_audit_records_are_used_as_they_are_or_scored_again(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    canonical, both = _audit_log(tiny_model_dir, capsys)
    (tmp_path / "canonical.log").write_text(canonical)
    (tmp_path / "both.log").write_text(both)
    with mock_aws():  # records that need no scoring need no target
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="audit")
        s3.put_object(Bucket="audit", Key="records.log", Body=canonical.encode())
        main(
            [
                "--unlabelled", "s3://audit/records.log", "--region", "us-east-1",
                "--min-inputs", "6", "--out", str(tmp_path / "s3"),
            ]
        )  # fmt: skip
    from_s3 = load_calibration(tmp_path / "s3" / "calibration.json")
    assert from_s3.template_priors is not None
    [(key, fitted)] = from_s3.template_priors.templates.items()
    recorded = [
        json.loads(line)["audit"]["probabilities"] for line in canonical.splitlines() if line
    ]
    assert fitted.prior == pytest.approx(list(np.mean(recorded, axis=0)), abs=1e-12)
    with pytest.raises(SystemExit, match="6 decisions must be scored"):
        main(["--unlabelled", str(tmp_path / "both.log"), "--out", str(tmp_path / "x")])
    settings = Settings(model_dir=tiny_model_dir, max_tokens=2048, threads=2)
    with live_server(create_app(settings)) as url:
        out = tmp_path / "out"
        main(["--unlabelled", str(tmp_path / "both.log"), "--url", url, "--out", str(out)])
    report = json.loads((out / "template-priors-report.json").read_text())
    assert (report["inputs"], report["scored_again"]) == (12, 6)
    assert report["too_few"] == {key: 12}  # under the default minimum of 20: no prior
    none = load_calibration(out / "calibration.json").template_priors
    assert none is not None
    assert none.templates == {}


def test_the_template_priors_report_is_held_out_beside_the_tasks_own_report() -> None:
    """`calibrate(template_inputs=...)` on planted distributions: its held-out uncalibrated
    and position-prior answers over every task are the cross-validation's own (the same
    folds, the same tasks), the covered tasks are a subset, and the fit keeps the templates
    with enough tasks."""
    rng = np.random.default_rng(11)
    scored = []
    for task in [t for t in load_tasks() if t.question_type == "choice"]:
        content = rng.dirichlet(np.ones(len(task.decision.options)))
        identity = tuple(range(len(task.decision.options)))
        rows = {}
        for order in {identity, *rotations(canonical_order(task.decision.options), limit=None)}:
            picked = content[list(order)]
            rows[order] = np.log(picked / picked.sum())
        scored.append(Scored(task, rows))
    _, report = calibrate(
        scored,
        mode="canonical",
        folds=3,
        seed=0,
        prompt_version=PROMPT_VERSION,
        tasks_sha256="0" * 64,
        template_inputs=3,
    )
    priors = report["template_priors"]
    held = priors["held_out"]
    assert held["all"]["tasks"] == len(scored)
    assert 0 < held["covered"]["tasks"] <= len(scored)
    own = report["held_out"]["canonical"]
    assert held["all"]["uncalibrated"] == own["uncalibrated"]
    assert held["all"]["position prior"] == own["prior"]
    assert priors["templates"]
    assert all(inputs >= 3 for inputs in priors["templates"].values())
