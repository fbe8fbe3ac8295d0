"""Template priors (bench.batch_prior): the fit recovers a planted contextual bias per
template, and dividing it out helps; a source's records are used as they are, scored again
or left out by whether they are the uncorrected distribution the prior needs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from adapter.readout import corrected
from bench.batch_prior import (
    BatchPriorError,
    Observed,
    fit_priors,
    from_records,
    request_decisions,
)
from bench.tasks import decision_json, load_tasks


def planted(key: str, bias: np.ndarray, inputs: int, seed: int) -> tuple[list[Observed], list[int]]:
    """Inputs whose true distributions (Dirichlet, no option favoured on average) the model
    shows multiplied by `bias` and renormalised; the labels are the true argmaxes."""
    rng = np.random.default_rng(seed)
    truth = rng.dirichlet(np.full(len(bias), 3.0), size=inputs)
    shown = truth * bias
    shown /= shown.sum(axis=1, keepdims=True)
    ids = tuple(f"o{index}" for index in range(len(bias)))
    return [Observed(key, ids, row) for row in shown], [int(np.argmax(row)) for row in truth]


def test_the_fit_recovers_each_templates_planted_bias_and_dividing_it_out_helps() -> None:
    biases = {"a:a": np.array([0.5, 0.3, 0.15, 0.05]), "b:b": np.array([0.2, 0.8])}
    observed, labels = [], []
    for seed, (key, bias) in enumerate(biases.items()):
        rows, right = planted(key, bias, 400, seed)
        observed += rows
        labels += right
    few, _ = planted("c:c", np.array([0.9, 0.1]), 19, 9)
    priors, too_few = fit_priors(observed + few, "canonical", "0" * 64, min_inputs=20)
    assert too_few == {"c:c": 19}  # one short of the minimum: left out, reported
    assert priors.option_order == "canonical"
    for key, bias in biases.items():
        fitted = priors.templates[key]
        assert fitted.inputs == 400
        assert sum(fitted.prior) == pytest.approx(1.0)
        # The mean of renormalised rows, not the bias itself: renormalising pulls the
        # estimate a little toward uniform (by 0.023 for the 0.2/0.8 bias here).
        assert fitted.prior == pytest.approx(list(bias), abs=0.03)
    before = after = 0
    for item, label in zip(observed, labels, strict=True):
        prior = priors.templates[item.key].prior
        before += int(np.argmax(item.probabilities)) == label
        after += int(np.argmax(corrected(np.log(item.probabilities), prior=prior))) == label
    assert after > before + 0.1 * len(labels)


def test_a_prior_never_gives_an_option_less_than_the_floor() -> None:
    rows = [Observed("k:k", ("x", "y"), np.array([1.0, 0.0]))] * 20
    priors, _ = fit_priors(rows, "as_given", "0" * 64)
    assert min(priors.templates["k:k"].prior) == pytest.approx(1e-6, rel=1e-3)


def test_a_template_whose_inputs_name_other_options_is_refused() -> None:
    rows = [
        Observed("k:k", ("x", "y"), np.array([0.5, 0.5])),
        Observed("k:k", ("y", "x"), np.array([0.5, 0.5])),
    ]
    with pytest.raises(BatchPriorError, match="template k:k"):
        fit_priors(rows, "canonical", "0" * 64, min_inputs=1)


DECISION = decision_json(load_tasks()[0].decision)


def record(**changes: Any) -> dict[str, Any]:
    """A digest record of a choice read by letters in canonical, uncorrected."""
    base: dict[str, Any] = {
        "request_id": "r",
        "decision_id": "d",
        "question_sha256": "1" * 64,
        "options_sha256": "2" * 64,
        "prompt_version": "semif-direct-options/1",
        "readout": "letters",
        "option_order": "canonical",
        "calibration": None,
        "option_ids": ["a", "b"],
        "probabilities": [0.6, 0.4],
    }
    return {**base, **changes}


def test_records_are_used_scored_again_or_left_out_by_how_they_were_read() -> None:
    uncorrected = {"temperature": 1.0, "position_prior": False, "template_prior": False}
    full = {"request": {key: DECISION[key] for key in ("state", "question", "options")}}
    gathered = from_records(
        [
            record(),
            record(calibration={**uncorrected, "applied": False}),  # temperature 1: usable
            record(calibration={**uncorrected, "position_prior": True}),
            record(calibration={**uncorrected, "temperature": 2.0}, **full),
            record(option_order="as_given"),
            record(readout="likelihood"),
            record(omitted=["request", "options"]),
            record(kind="multi_label"),
            record(api="systemone"),
            record(question_sha256=None),
        ],
        "canonical",
    )
    assert [item.probabilities.tolist() for item in gathered.observed] == [[0.6, 0.4]] * 2
    assert gathered.observed[0].key == f"{'1' * 64}:{'2' * 64}"
    assert gathered.prompt_versions == {"semif-direct-options/1"}
    [again] = gathered.rescore  # the full record read under a temperature: its text is there
    assert (again.question, again.state) == (DECISION["question"], DECISION["state"])
    assert dict(gathered.left_out) == {
        "corrected by the calibration in force": 1,
        "read in option order as_given": 1,
        "read by likelihood": 1,
        "options left out of the record": 1,
        "not a choice question": 1,
        "not a decision API record": 1,
        "no template hashes": 1,
    }


def test_request_lines_give_their_choice_decisions_and_name_a_bad_line() -> None:
    multi = {**DECISION, "id": "m", "kind": "multi_label"}
    lines = [
        json.dumps({"decision": DECISION, "option_order": "as_given"}),
        "",
        json.dumps({"decisions": [{**DECISION, "id": "x"}, multi]}),
    ]
    gathered = request_decisions(lines, "requests.jsonl")
    assert [decision.id for decision in gathered.rescore] == [DECISION["id"], "x"]
    assert dict(gathered.left_out) == {"not a choice question": 1}
    with pytest.raises(BatchPriorError, match=r"requests.jsonl:2: not a decision request"):
        request_decisions(["", '{"decision": {}}'], "requests.jsonl")
