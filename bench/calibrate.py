"""`semif-calibrate`: fit the calibration a model is served with, from labelled decisions.

Scores JevBench-format tasks (the file semif-bench-tasks reads; or, with --from-audit and
--labels, the adapter's full audit records joined with labels: bench.audit_tasks) on a
running server, a SageMaker endpoint or a local `serve`, then:
- estimates the position prior for each option count (PriDe): every nominal decision scored
  in each cyclic rotation of its canonical order; the prior is the softmax of the mean
  position log-probability over the rotations, averaged over decisions (no labels used);
- fits one softmax temperature per question kind, minimising NLL over a bounded range
  (golden-section search on log T), for the option order the file is written for, and
  (unless --no-likelihood) one per normalization and nominal kind for the likelihood
  readout, from each task read by likelihood under sum, mean and pmi;
- reports, on k held-out folds (prior and temperatures fitted on the other folds), accuracy,
  NLL, Brier and top-label ECE (10 bins) before and after, for every option order, how much
  of debiased's gain the prior recovers in canonical mode at one prompt per decision, and a
  reliability diagram PNG.
With --conformal, the file also gets a conformal section (bench.conformal_fit): the held-out
scores prediction sets are drawn from, per readout and kind, and the report says the
coverage and mean set size they reach on random halves of the tasks.
With --template-priors, it also gets template priors (Batch Calibration, bench.batch_prior:
each question template's mean uncorrected distribution, labels unused) and the report says
what they do held out. `--unlabelled SOURCE` fits template priors alone, from audit records
or JSON Lines of decision API bodies, no labels needed: the records' own probabilities where
they are the uncorrected distribution in --option-order, else the decisions scored again
here; --calibration FILE adds them to an existing calibration.
The calibration file (format: model_build.calibration) is fitted on all tasks; give it to
`model-build --calibration FILE`.

Every distribution is computed with the adapter's own code (adapter.ordering,
adapter.calibration) from the letter scores of the exact prompts the adapter renders, so
what is fitted here is what the adapter serves. The scores come from one shared request per
task, read `as_given`, whose decisions are the task in every order needed (they share the
state prefix); `option_logits` are raw, so a calibration already in force changes nothing.
The likelihood readout's scores come from one request per task and normalization.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from adapter.calibration import (
    NONE,
    TEMPLATE_PRIOR_KINDS,
    letters_correction,
    likelihood_correction,
    template_prior,
)
from adapter.ordering import Order, arrange, canonical_order, distribution, plan, rotations
from adapter.readout import log_softmax, softmax
from adapter.schema import Decision
from bench.audit_tasks import AuditTasksError, audit_tasks, read_labels, read_source, records
from bench.batch_prior import (
    MIN_INPUTS,
    BatchPriorError,
    Gathered,
    Observed,
    fit_priors,
    from_records,
    request_decisions,
)
from bench.conformal_fit import (
    Row,
    conformal_section,
    coverage_report,
    format_coverage,
    held_scores,
    labelled,
)
from bench.metrics import ECE_BINS, Answer, accuracy, brier_score, top_label_ece
from bench.multi_label_fit import AppliesTask, pairs, rows
from bench.runner import Invoker, save_figure, target_client
from bench.tasks import TASK_KINDS, Task, load_tasks, shared_body, single_body
from model_build.calibration import (
    NORMALIZATIONS,
    OPTION_ORDERS,
    Calibration,
    CalibrationError,
    LikelihoodCalibration,
    Normalization,
    OptionOrder,
    QuestionKind,
    TemplatePriors,
    load_calibration,
)
from model_build.conformal import ConformalSection

SCHEMA = "semif-calibrate/1"
TEMPERATURE_BOUNDS = (0.05, 20.0)
SEARCH_STEPS = 80  # golden-section steps: the bracket shrinks by 0.618 each, far below 1e-6
DEFAULT_FOLDS = 5
LOG_FLOOR = 1e-300  # log(0) guard for probabilities that underflowed
Vector = npt.NDArray[np.float64]


class CalibrateError(RuntimeError):
    """The tasks or the server's answers cannot give a calibration; the message says why."""


@dataclass(frozen=True)
class Scored:
    """One task's position log-probabilities in every order the modes and the prior need."""

    task: Task
    rows: Mapping[Order, Vector]
    # Read by likelihood: the options' log-probabilities in the task's order, per
    # normalization (none for score tasks, which are read by letters, or with --no-likelihood).
    likelihood: Mapping[Normalization, Vector] = field(default_factory=dict)
    # A choice task read as multi-label (bench.multi_label_fit): each option's log-odds.
    applies: AppliesTask | None = None

    @property
    def kind(self) -> QuestionKind:
        return self.task.question_type

    @property
    def label(self) -> int:
        return self.task.labels.index(self.task.expected)

    def probabilities(self, mode: OptionOrder, calibration: Calibration | None) -> Vector:
        """What the adapter serves for this task in `mode` under `calibration`."""
        decision = self.task.decision
        orders = plan(decision.options, mode, ordinal=self.kind == "score")
        fix = letters_correction(calibration, decision, self.kind, mode, orders[0])
        return distribution(orders, [self.rows[order] for order in orders], fix)

    def answer(self, mode: OptionOrder, calibration: Calibration | None) -> Answer:
        return self._answer(self.probabilities(mode, calibration))

    def likely(self, normalization: Normalization, calibration: Calibration | None) -> Vector:
        """What the adapter serves for this task read by likelihood under `normalization`."""
        fix = likelihood_correction(calibration, self.kind, normalization)
        identity = tuple(range(len(self.task.labels)))
        return distribution([identity], [self.likelihood[normalization]], fix)

    def likely_answer(
        self, normalization: Normalization, calibration: Calibration | None
    ) -> Answer:
        return self._answer(self.likely(normalization, calibration))

    def _answer(self, values: Vector) -> Answer:
        return Answer(dict(zip(self.task.labels, (float(v) for v in values), strict=True)))


def needed_orders(task: Task) -> list[Order]:
    """The caller's order, and for a nominal task every rotation of its canonical order
    (debiased uses all of them up to 8 options, evenly spaced ones above; the prior needs
    the full cycle)."""
    options = task.decision.options
    orders = [tuple(range(len(options)))]
    if task.question_type != "score":
        orders += [o for o in rotations(canonical_order(options), limit=None) if o != orders[0]]
    return orders


def score_orders(
    client: Invoker, decision: Decision, orders: Sequence[Order], name: str
) -> tuple[dict[Order, Vector], set[str]]:
    """`decision` read by letters in each of `orders`, in one shared `as_given` request:
    each order's position log-probabilities from the raw `option_logits` (so a calibration
    in force changes nothing), and the prompt versions the server reported."""
    decisions = [
        replace(arrange(decision, order), id=f"{decision.id}#{index}")
        for index, order in enumerate(orders)
    ]
    response = client.invoke({**shared_body(decisions), "option_order": "as_given"})
    results = response.get("results") if isinstance(response, Mapping) else None
    if not isinstance(results, list) or len(results) != len(orders):
        raise CalibrateError(f"{name}: the server did not answer every order")
    rows: dict[Order, Vector] = {}
    for order, result in zip(orders, results, strict=True):
        rows[order] = log_softmax(np.asarray(result["option_logits"], np.float64))
    return rows, {str(result.get("prompt_version")) for result in results}


def score_task(
    client: Invoker, task: Task, likelihood: bool = True
) -> tuple[Scored, set[str], set[str]]:
    """Score one task in every needed order in one shared request, and a nominal task by
    likelihood under each normalization (`likelihood`); returns the rows and the prompt
    versions the server reported (the likelihood prompt's beside the letters')."""
    rows, versions = score_orders(client, task.decision, needed_orders(task), f"task {task.id}")
    likely_versions: set[str] = set()
    likely: dict[Normalization, Vector] = {}
    for normalization in NORMALIZATIONS if likelihood and task.question_type != "score" else ():
        body = {**single_body(task.decision), "readout": "likelihood"}
        answer = client.invoke(body | {"normalization": normalization})
        result = answer.get("result") if isinstance(answer, Mapping) else None
        if not isinstance(result, Mapping) or result.get("readout") != "likelihood":
            raise CalibrateError(f"task {task.id}: the server did not read it by likelihood")
        likely[normalization] = log_softmax(np.asarray(result["option_logits"], np.float64))
        likely_versions.add(str(result.get("prompt_version")))
    return Scored(task, rows, likely, _applies(client, task)), versions, likely_versions


def _applies(client: Invoker, task: Task) -> AppliesTask | None:
    """A choice task read as a multi-label question: each option's log-odds of applying."""
    if task.question_type != "choice":
        return None
    answer = client.invoke(single_body(replace(task.decision, kind="multi_label")))
    result = answer.get("result") if isinstance(answer, Mapping) else None
    if not isinstance(result, Mapping) or result.get("kind") != "multi_label":
        raise CalibrateError(f"task {task.id}: the server did not read it as multi-label")
    log_odds = np.asarray(result["option_logits"], np.float64)
    return AppliesTask(log_odds, task.labels.index(task.expected))


def estimate_prior(scored: Sequence[Scored]) -> dict[int, tuple[float, ...]]:
    """PriDe's prior over answer positions for each option count, from nominal tasks."""
    priors: dict[int, list[Vector]] = {}
    for item in scored:
        if item.kind == "score":
            continue  # ordinal positions are levels, not a bias
        cycle = rotations(canonical_order(item.task.decision.options), limit=None)
        mean_log = np.mean([item.rows[order] for order in cycle], axis=0)
        priors.setdefault(len(cycle), []).append(softmax(mean_log))
    return {count: tuple(float(v) for v in np.mean(rows, axis=0)) for count, rows in priors.items()}


def nll_at(log_probs: Sequence[Vector], labels: Sequence[int], temperature: float) -> float:
    """Mean negative log-likelihood of the labels after softmax(log p / temperature)."""
    total = 0.0
    for row, label in zip(log_probs, labels, strict=True):
        total -= float(log_softmax(row / temperature)[label])
    return total / len(labels)


def fit_temperature(log_probs: Sequence[Vector], labels: Sequence[int]) -> float:
    """The temperature minimising NLL within TEMPERATURE_BOUNDS. NLL is convex in 1/T, so
    it is unimodal in log T and a golden-section search finds its minimum."""
    low, high = (math.log(bound) for bound in TEMPERATURE_BOUNDS)
    ratio = (math.sqrt(5) - 1) / 2

    def cost(log_t: float) -> float:
        return nll_at(log_probs, labels, math.exp(log_t))

    left, right = high - ratio * (high - low), low + ratio * (high - low)
    cost_left, cost_right = cost(left), cost(right)
    for _ in range(SEARCH_STEPS):
        if cost_left <= cost_right:
            high, right, cost_right = right, left, cost_left
            left = high - ratio * (high - low)
            cost_left = cost(left)
        else:
            low, left, cost_left = left, right, cost_right
            right = low + ratio * (high - low)
            cost_right = cost(right)
    return round(math.exp((low + high) / 2), 6)


def _log(values: Vector) -> Vector:
    result: Vector = np.log(np.maximum(values, LOG_FLOOR))
    return result


def fit(
    scored: Sequence[Scored],
    mode: OptionOrder,
    *,
    prompt_version: str,
    tasks_sha256: str,
    likelihood_version: str | None = None,
) -> Calibration:
    """The prior (from these tasks, labels unused) and one temperature per kind present,
    fitted on the distributions `mode` serves with that prior; with `likelihood_version`,
    one per normalization and kind read by likelihood."""
    base = Calibration(
        prompt_version=prompt_version,
        option_order=mode,
        temperatures={},
        tasks_sha256=tasks_sha256,
        position_prior=estimate_prior(scored),
    )
    temperatures: dict[QuestionKind, float] = {}
    counts: dict[QuestionKind, int] = {}
    for kind in TASK_KINDS:
        group = [item for item in scored if item.kind == kind]
        counts[kind] = len(group)
        if group:
            rows = [_log(item.probabilities(mode, base)) for item in group]
            temperatures[kind] = fit_temperature(rows, [item.label for item in group])
    applies = [item.applies for item in scored if item.applies is not None]
    counts["multi_label"] = len(applies)
    if applies:
        temperatures["multi_label"] = fit_temperature(*pairs(applies))
    likelihood = None
    if likelihood_version is not None:
        likelihood = LikelihoodCalibration(likelihood_version, fit_likelihood(scored))
    return replace(base, temperatures=temperatures, counts=counts, likelihood=likelihood)


def fit_likelihood(
    scored: Sequence[Scored],
) -> dict[Normalization, dict[QuestionKind, float]]:
    """One temperature per normalization and kind, on the tasks read by likelihood."""
    fitted: dict[Normalization, dict[QuestionKind, float]] = {}
    for normalization in NORMALIZATIONS:
        fitted[normalization] = {}
        for kind in TASK_KINDS:
            group = [item for item in scored if item.kind == kind and item.likelihood]
            if group:
                rows = [item.likelihood[normalization] for item in group]
                fitted[normalization][kind] = fit_temperature(rows, [i.label for i in group])
    return fitted


def nll(answers: Sequence[Answer], expected: Sequence[str]) -> float:
    """Mean negative log-likelihood of the expected labels."""
    return -math.fsum(
        math.log(max(answer.probabilities[label], LOG_FLOOR))
        for answer, label in zip(answers, expected, strict=True)
    ) / len(expected)


def quality(answers: Sequence[Answer], expected: Sequence[str]) -> dict[str, float]:
    return {
        "accuracy": accuracy(answers, expected),
        "nll": nll(answers, expected),
        "brier": brier_score(answers, expected),
        "ece": top_label_ece(answers, expected),
    }


def folds_of(count: int, folds: int, seed: int) -> list[list[int]]:
    """Task indexes split into `folds` held-out sets by a seeded shuffle."""
    order = np.random.default_rng(seed).permutation(count)
    return [sorted(int(i) for i in order[fold::folds]) for fold in range(folds)]


def cross_validate(
    scored: Sequence[Scored], folds: int, seed: int, *, prompt_version: str
) -> tuple[dict[OptionOrder, dict[str, list[Answer]]], dict[str, dict[str, list[Answer]]]]:
    """Held-out answers per mode: uncalibrated, prior only (canonical), calibrated; and per
    likelihood normalization (`likelihood <name>`, the tasks read by likelihood only):
    uncalibrated and calibrated. The prior and temperatures of each fold come from the
    other folds."""
    held: dict[OptionOrder, dict[str, list[Answer]]] = {
        mode: {"uncalibrated": [], "prior": [], "calibrated": []} for mode in OPTION_ORDERS
    }
    likely: dict[str, dict[str, list[Answer]]] = {}
    for test in folds_of(len(scored), folds, seed):
        held_back = set(test)
        train = [item for index, item in enumerate(scored) if index not in held_back]
        for mode in OPTION_ORDERS:
            fitted = fit(train, mode, prompt_version=prompt_version, tasks_sha256="0" * 64)
            prior_only = replace(fitted, temperatures={})
            for index in test:
                item = scored[index]
                held[mode]["uncalibrated"].append(item.answer(mode, None))
                held[mode]["prior"].append(item.answer(mode, prior_only))
                held[mode]["calibrated"].append(item.answer(mode, fitted))
        fitted_likely = Calibration(
            prompt_version=prompt_version,
            option_order="canonical",
            temperatures={},
            tasks_sha256="0" * 64,
            likelihood=LikelihoodCalibration(prompt_version, fit_likelihood(train)),
        )
        for normalization in NORMALIZATIONS:
            stages = likely.setdefault(
                f"likelihood {normalization}", {"uncalibrated": [], "calibrated": []}
            )
            for item in (scored[index] for index in test if scored[index].likelihood):
                stages["uncalibrated"].append(item.likely_answer(normalization, None))
                stages["calibrated"].append(item.likely_answer(normalization, fitted_likely))
    return held, likely


def held_out_applies(scored: Sequence[Scored], folds: int, seed: int) -> list[Row]:
    """The choice tasks read as multi-label, in the order cross_validate visits them, each
    under the `multi_label` temperature fitted on the other folds."""
    tasks: list[AppliesTask] = []
    temperatures: list[float] = []
    for test in folds_of(len(scored), folds, seed):
        held_back = set(test)
        train = [
            item.applies
            for index, item in enumerate(scored)
            if index not in held_back and item.applies is not None
        ]
        temperature = fit_temperature(*pairs(train)) if train else 1.0
        for item in (scored[index] for index in test):
            if item.applies is not None:
                tasks.append(item.applies)
                temperatures.append(temperature)
    return rows(tasks, temperatures)


def held_out_order(scored: Sequence[Scored], folds: int, seed: int) -> list[Scored]:
    """The tasks in the order cross_validate visits them (fold by fold)."""
    return [scored[index] for test in folds_of(len(scored), folds, seed) for index in test]


def fit_template_priors(
    scored: Sequence[Scored], mode: OptionOrder, source_sha256: str, min_inputs: int
) -> tuple[TemplatePriors, dict[str, int]]:
    """Template priors (bench.batch_prior) from the nominal tasks' uncorrected distributions
    in `mode`, labels unused, and the templates with too few inputs."""
    observed = [
        Observed.of(item.task.decision, item.probabilities(mode, None))
        for item in scored
        if item.kind in TEMPLATE_PRIOR_KINDS
    ]
    return fit_priors(observed, mode, source_sha256, min_inputs)


TEMPLATE_STAGES = ("uncalibrated", "position prior", "template prior")


def held_out_template_priors(
    scored: Sequence[Scored],
    mode: OptionOrder,
    folds: int,
    seed: int,
    *,
    held: Mapping[str, Sequence[Answer]],
    prompt_version: str,
    min_inputs: int,
) -> dict[str, Any]:
    """Held-out metrics in `mode`: uncalibrated; with the position prior of the other folds;
    and with the template priors of the other folds beside it (a question a template prior
    covers gets it instead, as served). Over every held-out task, and over those a template
    prior covered (the only ones it can move). `held` is the cross-validation's answers in
    `mode` (cross_validate: the same folds, visited in the same order), whose uncalibrated
    and position-prior answers are these; only the template priors are fitted here, each
    task's uncorrected distribution read once."""
    uncorrected = {
        index: Observed.of(item.task.decision, item.probabilities(mode, None))
        for index, item in enumerate(scored)
        if item.kind in TEMPLATE_PRIOR_KINDS
    }
    answers: dict[str, dict[str, list[Answer]]] = {
        subset: {stage: [] for stage in TEMPLATE_STAGES} for subset in ("all", "covered")
    }
    expected: dict[str, list[str]] = {"all": [], "covered": []}
    visited = 0  # the place of the next held-out task in `held`
    for test in folds_of(len(scored), folds, seed):
        held_back = set(test)
        train = [seen for index, seen in uncorrected.items() if index not in held_back]
        priors, _ = fit_priors(train, mode, "0" * 64, min_inputs)
        templates = Calibration(prompt_version, mode, {}, "0" * 64, template_priors=priors)
        for item in (scored[index] for index in test):
            plain, position = held["uncalibrated"][visited], held["prior"][visited]
            visited += 1
            covered = template_prior(templates, item.task.decision, item.kind, mode) is not None
            fitted = item.answer(mode, templates) if covered else position
            for subset in ("all", "covered") if covered else ("all",):
                expected[subset].append(item.task.expected)
                for stage, answer in zip(TEMPLATE_STAGES, (plain, position, fitted), strict=True):
                    answers[subset][stage].append(answer)
    return {
        subset: {"tasks": len(expected[subset])}
        | {
            stage: quality(stage_answers, expected[subset])
            for stage, stage_answers in answers[subset].items()
            if expected[subset]
        }
        for subset in answers
    }


HIGHER_IS_BETTER = {"accuracy": True, "nll": False, "brier": False}


def _share(prior: float, debiased: float, canonical: float, higher_is_better: bool) -> float | None:
    """The prior's improvement over canonical as a share of debiased's; None when debiased
    did not improve (there is no gain to recover, and a ratio of losses would mislead)."""
    sign = 1.0 if higher_is_better else -1.0
    possible = sign * (debiased - canonical)
    return sign * (prior - canonical) / possible if possible > 0 else None


def summarize(
    held: Mapping[OptionOrder, Mapping[str, Sequence[Answer]]], expected: Sequence[str]
) -> dict[str, Any]:
    """Metrics per mode and stage, and the share of debiased's gain over canonical that the
    prior alone recovers (1.0: all of it at canonical's cost; None: debiased gained nothing)."""
    metrics = {
        mode: {stage: quality(answers, expected) for stage, answers in stages.items()}
        for mode, stages in held.items()
    }
    canonical, debiased = metrics["canonical"], metrics["debiased"]
    recovers = {
        name: _share(
            canonical["prior"][name],
            debiased["uncalibrated"][name],
            canonical["uncalibrated"][name],
            higher,
        )
        for name, higher in HIGHER_IS_BETTER.items()
    }
    return {"held_out": metrics, "prior_recovers": recovers}


def reliability(answers: Sequence[Answer], expected: Sequence[str]) -> list[dict[str, float]]:
    """Top-label reliability per occupied confidence bin (the ECE's bins)."""
    bins: dict[int, list[tuple[float, bool]]] = {}
    for answer, label in zip(answers, expected, strict=True):
        top, confidence = answer.top
        bins.setdefault(min(int(confidence * ECE_BINS), ECE_BINS - 1), []).append(
            (confidence, top == label)
        )
    return [
        {
            "bin": index,
            "count": len(rows),
            "confidence": sum(c for c, _ in rows) / len(rows),
            "accuracy": sum(ok for _, ok in rows) / len(rows),
        }
        for index, rows in sorted(bins.items())
    ]


def write_reliability(
    curves: Mapping[str, Sequence[Mapping[str, float]]], path: Path, title: str
) -> Path:
    """A reliability diagram (accuracy against confidence per bin) as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(5.5, 5))
    axes.plot([0, 1], [0, 1], color="grey", linestyle="--", label="perfect")
    for label, points in curves.items():
        axes.plot(
            [p["confidence"] for p in points],
            [p["accuracy"] for p in points],
            marker="o",
            label=label,
        )
    axes.set_xlim(0, 1)
    axes.set_ylim(0, 1)
    axes.set_xlabel("top-label confidence")
    axes.set_ylabel("accuracy")
    axes.set_title(title)
    axes.legend()
    return save_figure(figure, path)


@dataclass(frozen=True)
class ScoredTasks:
    """Every task scored, and the prompt versions the server read them under."""

    scored: list[Scored]
    prompt_version: str
    likelihood_version: str | None  # None: no task was read by likelihood


def score_all(client: Invoker, tasks: Sequence[Task], likelihood: bool = True) -> ScoredTasks:
    """Every task scored (by likelihood too, unless not `likelihood`); refuses answers from
    more than one prompt version per readout."""
    scored: list[Scored] = []
    versions: set[str] = set()
    likely_versions: set[str] = set()
    for task in tasks:
        item, seen, seen_likely = score_task(client, task, likelihood)
        scored.append(item)
        versions |= seen
        likely_versions |= seen_likely
    if len(versions) != 1 or len(likely_versions) > 1:  # likelihood: none with --no-likelihood
        raise CalibrateError(
            f"the server reported prompt versions {sorted(versions | likely_versions)}; "
            "expected one per readout"
        )
    return ScoredTasks(scored, versions.pop(), likely_versions.pop() if likely_versions else None)


def calibrate(
    scored: Sequence[Scored],
    *,
    mode: OptionOrder,
    folds: int,
    seed: int,
    prompt_version: str,
    tasks_sha256: str,
    likelihood_version: str | None = None,
    conformal: bool = False,
    template_inputs: int | None = None,
) -> tuple[Calibration, dict[str, Any]]:
    """The calibration for `mode` fitted on every task (its likelihood section too when
    the tasks were read by likelihood under `likelihood_version`; with `conformal`, the
    prediction sets' section from the held-out answers; with `template_inputs`, template
    priors of templates with at least that many tasks, labels unused), and the held-out
    report."""
    if folds < 2 or len(scored) < folds:
        raise CalibrateError(f"{len(scored)} tasks cannot be split into {folds} folds (>= 2)")
    held, likely = cross_validate(scored, folds, seed, prompt_version=prompt_version)
    visited = held_out_order(scored, folds, seed)
    expected = [item.task.expected for item in visited]
    report = summarize(held, expected)
    read_likely = [item.task.expected for item in visited if item.likelihood]
    report["likelihood_held_out"] = {
        name: {stage: quality(answers, read_likely) for stage, answers in stages.items()}
        for name, stages in likely.items()
        if read_likely
    }
    report["reliability"] = {
        stage: reliability(held[mode][stage], expected) for stage in ("uncalibrated", "calibrated")
    }
    final = fit(
        scored,
        mode,
        prompt_version=prompt_version,
        tasks_sha256=tasks_sha256,
        likelihood_version=likelihood_version if read_likely else None,
    )
    if conformal:
        sections, report["conformal"] = _conformal(
            held[mode]["calibrated"],
            likely,
            visited,
            mode=mode,
            prompt_version=prompt_version,
            likelihood_version=likelihood_version if read_likely else None,
        )
        applies = held_out_applies(scored, folds, seed)
        if applies:  # a multi-label question's sets, beside the letters' kinds
            letters = sections["letters"]
            fitted = letters.scores | {"multi_label": held_scores(applies, each_alone=True)}
            sections["letters"] = replace(letters, scores=fitted)
            report["conformal"]["multi_label"] = coverage_report(applies, each_alone=True)
        final = replace(final, conformal=sections)
    if template_inputs is not None:
        priors, too_few = fit_template_priors(scored, mode, tasks_sha256, template_inputs)
        report["template_priors"] = {
            "min_inputs": template_inputs,
            "templates": {key: fitted.inputs for key, fitted in priors.templates.items()},
            "too_few": too_few,
            "held_out": held_out_template_priors(
                scored,
                mode,
                folds,
                seed,
                held=held[mode],
                prompt_version=prompt_version,
                min_inputs=template_inputs,
            ),
        }
        final = replace(final, template_priors=priors)
    metrics = {
        "folds": folds,
        "seed": seed,
        "held_out": report["held_out"][mode],
        "prior_recovers": report["prior_recovers"],
        "likelihood_held_out": report["likelihood_held_out"],
    }
    return replace(final, metrics=metrics), report


def _conformal(
    letters: Sequence[Answer],
    likely: Mapping[str, Mapping[str, Sequence[Answer]]],
    visited: Sequence[Scored],
    *,
    mode: OptionOrder,
    prompt_version: str,
    likelihood_version: str | None,
) -> tuple[dict[str, ConformalSection], dict[str, Any]]:
    """The conformal sections (letters in `mode`, likelihood per normalization) from the
    held-out calibrated answers, and their coverage report."""
    expected = [item.task.expected for item in visited]
    kinds = [item.kind for item in visited]
    readouts = [("letters", letters, expected, kinds, prompt_version, mode)]
    if likelihood_version is not None:
        read = [item for item in visited if item.likelihood]
        for normalization in NORMALIZATIONS:
            readouts.append(
                (
                    f"likelihood:{normalization}",
                    likely[f"likelihood {normalization}"]["calibrated"],
                    [item.task.expected for item in read],
                    [item.kind for item in read],
                    likelihood_version,
                    "canonical",  # options read by likelihood are listed canonically
                )
            )
    sections: dict[str, ConformalSection] = {}
    report: dict[str, Any] = {}
    for readout, answers, labels, own_kinds, version, order in readouts:
        sections[readout] = conformal_section(
            answers, labels, own_kinds, prompt_version=version, option_order=order
        )
        report[readout] = coverage_report(labelled(answers, labels))
    return sections, report


def format_report(report: Mapping[str, Any]) -> str:
    header = f"{'mode':<17}{'stage':<14}{'acc':>7}{'nll':>8}{'brier':>8}{'ece':>7}"
    lines = [header, "-" * len(header)]
    for mode, stages in (report["held_out"] | report["likelihood_held_out"]).items():
        for stage, row in stages.items():
            if stage == "prior" and mode != "canonical":
                continue  # the prior is divided out in canonical mode only
            lines.append(
                f"{mode:<17}{stage:<14}{row['accuracy']:>7.3f}{row['nll']:>8.3f}"
                f"{row['brier']:>8.3f}{row['ece']:>7.3f}"
            )
    shares = ", ".join(
        f"{name} {'-' if share is None else f'{share:.0%}'}"
        for name, share in report["prior_recovers"].items()
    )
    lines.append(f"canonical + prior recovers of debiased's gain: {shares}")
    if "conformal" in report:
        lines.append("conformal prediction sets, random halves of the held-out answers:")
        lines += format_coverage(report["conformal"])
    if "template_priors" in report:
        lines += format_template_priors(report["template_priors"])
    return "\n".join(lines)


def format_template_priors(section: Mapping[str, Any]) -> list[str]:
    """The template priors' held-out lines (all tasks, and those a prior covered)."""
    lines = [
        f"template priors (>= {section['min_inputs']} inputs): {len(section['templates'])} "
        f"templates, {len(section['too_few'])} with too few inputs; held out:"
    ]
    for subset, stages in section["held_out"].items():
        for stage in TEMPLATE_STAGES:
            if stage in stages:
                row = stages[stage]
                lines.append(
                    f"  {subset} ({stages['tasks']}) {stage:<15}{row['accuracy']:>7.3f}"
                    f"{row['nll']:>8.3f}{row['brier']:>8.3f}{row['ece']:>7.3f}"
                )
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="semif-calibrate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "tasks", type=Path, nargs="?", help="JevBench JSONL file of labelled decisions"
    )
    parser.add_argument(
        "--from-audit",
        metavar="RECORDS",
        help="instead of TASKS: the adapter's full audit records (a file or s3://), joined "
        "with --labels (bench.audit_tasks)",
    )
    parser.add_argument("--labels", help="with --from-audit: JSON Lines of decision_id, label")
    parser.add_argument(
        "--unlabelled",
        metavar="SOURCE",
        help="instead of TASKS: fit template priors only (Batch Calibration, no labels) from "
        "audit records or JSON Lines of decision API bodies (a file or s3://; "
        "bench.batch_prior)",
    )
    parser.add_argument(
        "--template-priors",
        action="store_true",
        help="with TASKS or --from-audit: also fit template priors from the tasks (labels "
        "unused) and report them held out",
    )
    parser.add_argument(
        "--min-inputs",
        type=int,
        default=MIN_INPUTS,
        help="inputs a template needs for a prior (fewer: left out and reported)",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        help="with --unlabelled: add the priors to this calibration file (else a file holding "
        "only them)",
    )
    # Required but for --unlabelled, whose records may need no scoring (checked below).
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8080")
    target.add_argument("--endpoint-name", dest="endpoint", help="SageMaker endpoint name")
    target.add_argument("--local", action="store_true", help="start `serve` on the embedded model")
    parser.add_argument("--region", help="AWS region of --endpoint-name")
    parser.add_argument(
        "--option-order",
        choices=OPTION_ORDERS,
        default="canonical",
        help="the order the temperatures (and template priors) are fitted for (the server's "
        "SEMIF_OPTION_ORDER)",
    )
    parser.add_argument(
        "--no-likelihood",
        dest="likelihood",
        action="store_false",
        help="fit the letters only (no likelihood section; three fewer requests per task)",
    )
    parser.add_argument(
        "--conformal",
        action="store_true",
        help="add the conformal section (prediction sets at any coverage) and report it",
    )
    parser.add_argument("--folds", type=int, default=DEFAULT_FOLDS, help="held-out folds")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fold split")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=Path(".cache/calibrate"), help="output folder")
    parser.add_argument("--gguf", type=Path, help="with --local: serve this GGUF instead")
    parser.add_argument("--threads", type=int, default=2, help="with --local: llama.cpp threads")
    args = parser.parse_args(argv)
    sources = [args.tasks, args.from_audit, args.unlabelled]
    if sum(source is not None for source in sources) != 1:
        parser.error("give one of TASKS, --from-audit RECORDS (with --labels) or --unlabelled")
    if (args.from_audit is None) != (args.labels is None):
        parser.error("--from-audit and --labels go together")
    if args.unlabelled is None and not has_target(args):
        parser.error("one of the arguments --url --endpoint-name --local is required")
    if args.min_inputs < 1:
        parser.error("--min-inputs must be at least 1")
    return args


def has_target(args: argparse.Namespace) -> bool:
    return bool(args.url or args.endpoint or args.local)


def labelled_tasks(args: argparse.Namespace) -> tuple[list[Task], str, str]:
    """The tasks, where they came from, and the sha256 of what they were read from."""
    if args.tasks is not None:
        return load_tasks(args.tasks), str(args.tasks), _sha256(args.tasks.read_bytes())
    served, known = (read_source(source, args.region) for source in (args.from_audit, args.labels))
    try:
        joined = audit_tasks(
            records(served.decode().splitlines()),
            read_labels(known.decode().splitlines(), args.labels),
        )
    except AuditTasksError as error:
        sys.exit(f"semif-calibrate: {error}")
    print(f"{len(joined.tasks)} labelled records ({joined.unlabelled} without a label)")
    return joined.tasks, f"{args.from_audit} + {args.labels}", _sha256(served + known)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rescore(client: Invoker, decision: Decision, mode: OptionOrder) -> tuple[Observed, set[str]]:
    """A decision's uncorrected distribution in `mode`, computed here from the raw scores of
    the orders `mode` reads (what the server serves before any correction)."""
    orders = plan(decision.options, mode)
    rows, versions = score_orders(client, decision, orders, f"decision {decision.id}")
    probabilities = distribution(orders, [rows[order] for order in orders], NONE)
    return Observed.of(decision, probabilities), versions


def gather(args: argparse.Namespace, data: bytes) -> tuple[Gathered, str]:
    """What --unlabelled SOURCE gives, the decisions that needed it scored by the target;
    and the target (`none` when nothing needed scoring)."""
    lines = data.decode().splitlines()
    found = records(lines)
    try:
        gathered = (
            from_records(found, args.option_order)
            if found
            else request_decisions(lines, args.unlabelled)
        )
    except BatchPriorError as error:
        sys.exit(f"semif-calibrate: {error}")
    if not gathered.rescore:
        return gathered, "none"
    if not has_target(args):
        sys.exit(
            f"semif-calibrate: {len(gathered.rescore)} decisions must be scored (read another "
            "way than the prior needs, or never read): give --url, --endpoint-name or --local"
        )
    with target_client(args) as (target, client):
        for decision in gathered.rescore:
            observed, versions = rescore(client, decision, args.option_order)
            gathered.observed.append(observed)
            gathered.prompt_versions |= versions
    return gathered, target


def fit_unlabelled(args: argparse.Namespace) -> None:
    """`--unlabelled SOURCE`: template priors, alone or added to --calibration FILE."""
    data = read_source(args.unlabelled, args.region)
    gathered, target = gather(args, data)
    if len(gathered.prompt_versions) != 1:
        sys.exit(
            f"semif-calibrate: the inputs were read under prompt versions "
            f"{sorted(gathered.prompt_versions)}; expected one"
        )
    version = gathered.prompt_versions.pop()
    source_sha256 = _sha256(data)
    mode = args.option_order
    priors, too_few = fit_priors(gathered.observed, mode, source_sha256, args.min_inputs)
    try:
        base = (
            load_calibration(args.calibration)
            if args.calibration is not None
            else Calibration(version, args.option_order, {}, source_sha256)
        )
    except CalibrationError as error:
        sys.exit(f"semif-calibrate: {error}")
    if base.prompt_version != version:
        sys.exit(
            f"semif-calibrate: {args.calibration} was fitted under prompt version "
            f"{base.prompt_version!r}, the inputs read under {version!r}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    calibration_path = args.out / "calibration.json"
    calibration_path.write_text(replace(base, template_priors=priors).to_json(), "utf-8")
    report = unlabelled_report(gathered, priors, too_few)
    report_path = args.out / "template-priors-report.json"
    document = {"schema": SCHEMA, "target": target, "source": args.unlabelled, **report}
    report_path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", "utf-8")
    print(
        f"{target}: {len(gathered.observed)} inputs from {args.unlabelled} "
        f"({len(gathered.rescore)} scored again, {sum(gathered.left_out.values())} left out: "
        f"{dict(gathered.left_out)}); {len(priors.templates)} template priors in "
        f"{args.option_order}, {len(too_few)} templates with fewer than {args.min_inputs} inputs"
    )
    print(f"calibration: {calibration_path}\nreport: {report_path}")


def unlabelled_report(
    gathered: Gathered, priors: TemplatePriors, too_few: Mapping[str, int]
) -> dict[str, Any]:
    return {
        "option_order": priors.option_order,
        "inputs": len(gathered.observed),
        "scored_again": len(gathered.rescore),
        "left_out": dict(gathered.left_out),
        "templates": {key: fitted.inputs for key, fitted in priors.templates.items()},
        "too_few": dict(too_few),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.unlabelled is not None:
        fit_unlabelled(args)
        return
    tasks, source, source_sha256 = labelled_tasks(args)
    with target_client(args) as (target, client):
        read = score_all(client, tasks, args.likelihood)
    try:
        fitted, report = calibrate(
            read.scored,
            mode=args.option_order,
            folds=args.folds,
            seed=args.seed,
            prompt_version=read.prompt_version,
            tasks_sha256=source_sha256,
            likelihood_version=read.likelihood_version,
            conformal=args.conformal,
            template_inputs=args.min_inputs if args.template_priors else None,
        )
    except CalibrateError as error:
        sys.exit(f"semif-calibrate: {error}")
    args.out.mkdir(parents=True, exist_ok=True)
    calibration_path = args.out / "calibration.json"
    calibration_path.write_text(fitted.to_json(), encoding="utf-8")
    report_path = args.out / "calibrate-report.json"
    document = {"schema": SCHEMA, "target": target, "tasks_file": source, **report}
    report_path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n", "utf-8")
    png = write_reliability(
        report["reliability"],
        args.out / "reliability.png",
        f"{args.option_order}, {len(tasks)} tasks, {args.folds}-fold held out",
    )
    print(f"{target}: {len(tasks)} tasks from {source}, {args.folds}-fold held out")
    print(format_report(report))
    print(f"temperatures ({args.option_order}): {fitted.temperatures}")
    if fitted.likelihood is not None:
        print(f"likelihood temperatures: {fitted.likelihood.temperatures}")
    print(f"calibration: {calibration_path}\nreport: {report_path}\nreliability: {png}")


if __name__ == "__main__":
    main()
