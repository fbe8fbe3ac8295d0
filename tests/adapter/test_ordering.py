"""Option order: canonical and debiased answers do not depend on the order options are sent
in (exactly, on the real tiny model), debiased averages positions, and its rotations are
branches of one prefill."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter.calibration import Correction
from adapter.decisions import decide
from adapter.ordering import (
    MAX_ROTATIONS,
    arrange,
    canonical_order,
    distribution,
    plan,
    rotations,
    to_caller,
)
from adapter.schema import Decision, Option, Policy
from adapter.service import DecisionService
from adapter.settings import Settings
from model_build.calibration import OptionOrder
from tests.support.models import open_test_model, service_of
from tests.support.serving import serving

STATE = "Customer 4411 reports that the parcel arrived damaged and asks what happens next."
RNG_SEED = 20260601


def options(count: int) -> tuple[Option, ...]:
    return tuple(Option(f"o{i}", f"Route the case to team number {i}.") for i in range(count))


def permutations(count: int, how_many: int) -> Iterator[tuple[Option, ...]]:
    rng = np.random.default_rng(RNG_SEED + count)
    base = options(count)
    for _ in range(how_many):
        yield tuple(base[i] for i in rng.permutation(count))


# -- pure ---------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 3, 7, 16, 260])
def test_canonical_order_depends_on_content_alone(count: int) -> None:
    seen = set()
    for shuffled in permutations(count, 6):
        decision = Decision("d", "s", "q", shuffled)
        seen.add(tuple(o.id for o in arrange(decision, canonical_order(shuffled)).options))
    [ids] = seen
    assert list(ids) != [o.id for o in options(count)]  # a hash order, not the ids' order


def test_canonical_order_ignores_ids_except_to_break_ties() -> None:
    renamed = tuple(Option(f"x{9 - i}", o.description) for i, o in enumerate(options(5)))
    assert canonical_order(renamed) == canonical_order(options(5))
    twins = (Option("b", "Same text."), Option("a", "Same text."))
    assert canonical_order(twins) == (1, 0)


@pytest.mark.parametrize("count", range(2, MAX_ROTATIONS + 1))
def test_debiased_puts_each_option_once_in_each_position(count: int) -> None:
    orders = plan(options(count), "debiased")
    assert len(orders) == count
    for position in range(count):
        assert sorted(order[position] for order in orders) == list(range(count))


def test_debiased_caps_rotations_evenly_above_the_limit() -> None:
    orders = plan(options(20), "debiased")
    canonical = canonical_order(options(20))
    assert orders == rotations(canonical)
    assert len(set(orders)) == MAX_ROTATIONS
    starts = [canonical.index(order[0]) for order in orders]
    assert starts == [0, 2, 5, 7, 10, 12, 15, 17]  # offsets i * 20 // 8


@pytest.mark.parametrize("mode", ["as_given", "canonical", "debiased"])
def test_ordinal_questions_keep_their_order_in_every_mode(mode: Any) -> None:
    assert plan(options(5), mode, ordinal=True) == ((0, 1, 2, 3, 4),)


def test_yes_no_in_debiased_is_scored_with_both_label_orders() -> None:
    assert sorted(plan(options(2), "debiased")) == [(0, 1), (1, 0)]


def test_distribution_averages_by_id_and_divides_the_prior_out() -> None:
    """PriDe's model: what is observed at position j is prior[j] x content[option at j],
    renormalised. Dividing the prior out of one canonical prompt gives the content back."""
    content = np.array([0.5, 0.3, 0.2])
    prior = (0.6, 0.3, 0.1)
    order = (2, 0, 1)
    observed = np.array(prior) * content[list(order)]
    row = np.log(observed / observed.sum())
    fixed = distribution([order], [row], Correction(prior=prior))
    assert fixed == pytest.approx(content, abs=1e-12)
    # Debiased: the mean of each rotation's distribution, by option id.
    cycle = rotations(order)
    rows = []
    for rotation in cycle:
        seen = np.array(prior) * content[list(rotation)]
        rows.append(np.log(seen / seen.sum()))
    by_id = [to_caller(list(np.exp(r)), o) for r, o in zip(rows, cycle, strict=True)]
    assert distribution(cycle, rows, Correction()) == pytest.approx(np.mean(by_id, axis=0))


def test_temperature_acts_on_the_combined_distribution() -> None:
    row = np.log(np.array([0.7, 0.2, 0.1]))
    hot = distribution([(0, 1, 2)], [row], Correction(temperature=2.0))
    weights = np.sqrt([0.7, 0.2, 0.1])
    assert hot == pytest.approx(weights / weights.sum())


# -- the real tiny model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def service(tiny_gguf: Path) -> Iterator[DecisionService]:
    """Prefix reuse on, as served: the engine's exact layout makes a prompt's numbers
    independent of what the cache held, so equal prompts must agree exactly."""
    model = open_test_model(tiny_gguf, max_branches=64)
    try:
        yield service_of(model, max_tokens=2048)
    finally:
        model.engine.close()


def by_id(result: dict[str, Any]) -> dict[str, float]:
    return dict(zip(result["option_ids"], result["probabilities"], strict=True))


@pytest.mark.parametrize("count", [3, 5, 11])
def test_permutations_give_identical_probabilities_by_id(
    service: DecisionService, count: int
) -> None:
    spread: dict[str, float] = {}
    for mode in ("as_given", "canonical", "debiased"):
        answers = []
        for shuffled in permutations(count, 4):
            decision = Decision("d", STATE, "Which team should take it?", shuffled)
            [result] = decide(service, [decision], "single", Policy(option_order=mode))["results"]
            assert result["option_ids"] == [o.id for o in shuffled]  # the caller's order
            assert result["option_order"] == mode
            answers.append(by_id(result))
        spread[mode] = max(abs(a[k] - answers[0][k]) for a in answers for k in a)
    assert spread["canonical"] < 1e-6
    assert spread["debiased"] < 1e-6
    assert spread["as_given"] > 1e-3  # the order does matter when nothing corrects it


def test_systemone_choice_is_order_invariant_and_score_keeps_its_levels(
    tiny_model_dir: Path,
) -> None:
    score = {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["Not urgent.", "Somewhat urgent.", "Very urgent."],
    }

    def ask(client: TestClient, criteria: dict[str, str], mode: str) -> dict[str, Any]:
        body = {
            "state": STATE,
            "option_order": mode,
            "questions": {
                "team": {"type": "choice", "instructions": "Which team?", "criteria": criteria},
                "urgency": score,
            },
        }
        response = client.post(
            "/v1/systemone", content=json.dumps(body), headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        answers: dict[str, Any] = response.json()["answers"]
        return answers

    base = {o.id: o.description for o in options(4)}
    shuffled = {key: base[key] for key in ("o2", "o0", "o3", "o1")}
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)
    with serving(settings) as client:
        for mode in ("canonical", "debiased"):
            first, second = ask(client, base, mode), ask(client, shuffled, mode)
            assert list(second["team"]["probabilities"]) == list(shuffled)  # request order
            for key, value in first["team"]["probabilities"].items():
                assert second["team"]["probabilities"][key] == pytest.approx(value, abs=1e-6)
        levels = [ask(client, base, mode)["urgency"] for mode in ("as_given", "debiased")]
        assert list(levels[0]["probabilities"]) == ["0", "1", "2"]
        assert levels[1]["score"] == pytest.approx(levels[0]["score"], abs=1e-4)


def test_debiased_rotations_share_one_state_prefill(service: DecisionService) -> None:
    def ask(state: str, mode: OptionOrder) -> dict[str, Any]:
        decisions = [
            Decision("team", state, "Which team should take it?", options(4)),
            Decision("next", state, "What should happen next?", options(3)),
        ]
        return decide(service, decisions, "shared", Policy(option_order=mode))

    # Long states, each new to the cache (only the system turn is resident from before).
    canonical = ask(" ".join(["Case A."] + [STATE] * 10), "canonical")
    state = " ".join(["Case B."] + [STATE] * 10)
    state_tokens = len(service.engine.vocab.tokenize(state))
    debiased = ask(state, "debiased")
    results = debiased["results"]
    assert [r["timing"]["prompts"] for r in results] == [4, 3]
    read = sum(r["input_tokens"] for r in results)  # seven prompts, the state in each
    # Evaluated alone, the seven prompts would cost `read`; shared, the state is one prefill.
    assert debiased["timing"]["evaluated_tokens"] < read - 6 * state_tokens
    extra_suffixes = read - sum(r["input_tokens"] for r in canonical["results"])
    assert debiased["timing"]["evaluated_tokens"] <= (
        canonical["timing"]["evaluated_tokens"] + extra_suffixes - 5 * state_tokens
    )
