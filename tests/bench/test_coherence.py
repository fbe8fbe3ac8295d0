"""The coherence benchmark: each relation's checker on made-up answers (one that keeps it,
one that breaks it), the runner against scripted servers whose answers are coherent or not
by construction, and a run on a real tiny `serve`, where what the likelihood readout keeps
by construction must hold exactly."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from adapter.app import create_app
from adapter.settings import Settings
from bench import coherence, quality
from bench.coherence import (
    RELATIONS,
    YES_NO_ROLES,
    Case,
    CoherenceError,
    clone_gap,
    complement_gap,
    conjunction_gap,
    disjunction_gap,
    format_coherence,
    independent_clone_gap,
    load_cases,
    paraphrase_gap,
    parse_case,
    probability_gap,
    ratio_gap,
    run_coherence,
)
from bench.metrics import Answer
from bench.tasks import TaskFormatError, parse_lines
from tests.support.live_server import live_server

# P(yes) per role that keeps every logical relation, and one that breaks each of them.
COHERENT = {"a": 0.7, "not_a": 0.3, "a_paraphrase": 0.72, "b": 0.6, "a_and_b": 0.5, "a_or_b": 0.8}
INCOHERENT = {
    "a": 0.7,
    "not_a": 0.7,
    "a_paraphrase": 0.4,
    "b": 0.6,
    "a_and_b": 0.65,
    "a_or_b": 0.65,
}


def case_line(**overrides: Any) -> dict[str, Any]:
    line: dict[str, Any] = {
        "id": "late-parcel",
        "state": "My parcel is two weeks late and I want my money back.",
        "choice": {
            "question": "Which queue should handle this ticket?",
            "options": {
                "billing": "Billing and refunds.",
                "shipping": "Shipping and delivery.",
                "technical": "Technical faults.",
            },
            "extra": {"returns": "Returns and exchanges."},
        },
        "yes_no": {role: f"Question {role}?" for role in YES_NO_ROLES},
    }
    return line | overrides


def test_exact_relations_compare_probabilities_by_id() -> None:
    permutation = RELATIONS["permutation"]
    same = probability_gap(Answer({"x": 0.6, "y": 0.4}), Answer({"y": 0.4, "x": 0.6}))
    moved = probability_gap(Answer({"x": 0.6, "y": 0.4}), Answer({"y": 0.5, "x": 0.5}))
    assert permutation.holds(same)
    assert not permutation.holds(moved)
    assert moved == pytest.approx(0.1)
    assert not RELATIONS["batch"].holds(1e-8)


def test_choice_set_keeps_ratios_when_an_option_goes_or_comes() -> None:
    relation = RELATIONS["choice set"]
    base = Answer({"a": 0.5, "b": 0.3, "c": 0.2})
    assert relation.holds(ratio_gap(base, Answer({"a": 0.625, "b": 0.375})))
    assert relation.holds(ratio_gap(base, Answer({"a": 0.25, "b": 0.15, "c": 0.1, "d": 0.5})))
    squeezed = ratio_gap(base, Answer({"a": 0.6, "b": 0.4}))  # a:b was 5:3, now 3:2
    assert not relation.holds(squeezed)


def test_clones_split_the_mass_one_copy_carried() -> None:
    relation = RELATIONS["clones"]
    base = Answer({"a": 0.5, "b": 0.3, "c": 0.2})
    split = Answer({"a": 0.25, "b": 0.3, "c": 0.2, "a2": 0.25})
    assert relation.holds(clone_gap(base, split, "a", "a2"))
    by_position = Answer({"a": 0.3, "b": 0.2, "c": 0.15, "a2": 0.35})  # unequal, and more mass
    assert not relation.holds(clone_gap(base, by_position, "a", "a2"))
    others_moved = Answer({"a": 0.2, "b": 0.4, "c": 0.2, "a2": 0.2})  # equal, but b took mass
    assert not relation.holds(clone_gap(base, others_moved, "a", "a2"))


def test_multi_label_clones_are_options_like_any_other() -> None:
    """Each option judged alone: the clone equals the original, nothing is split, and no
    other option moves."""
    relation = RELATIONS["clones"]
    base = Answer({"a": 0.7, "b": 0.1, "c": 0.4})
    same = Answer({"a": 0.7, "b": 0.1, "c": 0.4, "a2": 0.7})
    assert relation.holds(independent_clone_gap(base, same, "a", "a2"))
    split = Answer({"a": 0.35, "b": 0.1, "c": 0.4, "a2": 0.35})
    assert not relation.holds(independent_clone_gap(base, split, "a", "a2"))
    moved = Answer({"a": 0.7, "b": 0.2, "c": 0.4, "a2": 0.7})
    assert not relation.holds(independent_clone_gap(base, moved, "a", "a2"))


def test_logical_relations_within_their_tolerances() -> None:
    assert RELATIONS["complement"].holds(complement_gap(0.7, 0.35))
    assert not RELATIONS["complement"].holds(complement_gap(0.6, 0.6))
    assert RELATIONS["conjunction"].holds(conjunction_gap(0.6, 0.5, 0.4))
    assert RELATIONS["conjunction"].holds(conjunction_gap(0.5, 0.5, 0.5))  # the bound itself
    assert not RELATIONS["conjunction"].holds(conjunction_gap(0.6, 0.5, 0.55))
    assert RELATIONS["disjunction"].holds(disjunction_gap(0.6, 0.5, 0.7))
    assert not RELATIONS["disjunction"].holds(disjunction_gap(0.6, 0.5, 0.55))
    assert RELATIONS["paraphrase"].holds(paraphrase_gap(0.6, 0.65))
    assert not RELATIONS["paraphrase"].holds(paraphrase_gap(0.6, 0.8))


class ScriptedServer:
    """Answers decision bodies without a model. Each option's weight comes from its text
    (clones share theirs, split evenly), a yes/no question's P(yes) from `p_yes` by role,
    and "unsure" weighs as much as yes and no together; so every exact relation holds,
    unless `recency`, which doubles the weight of whichever option is listed last, as a
    letter readout's position bias favours a position whatever is there."""

    def __init__(self, p_yes: Mapping[str, float], recency: bool = False) -> None:
        self.p_yes = p_yes
        self.recency = recency

    def invoke(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if "decisions" in body:
            return {"results": [self.result(d) for d in body["decisions"]]}
        return {"result": self.result(body["decision"])}

    def result(self, decision: Mapping[str, Any]) -> dict[str, Any]:
        texts = [option["description"] for option in decision["options"]]
        role = decision["question"].removeprefix("Question ").removesuffix("?")
        yes = self.p_yes.get(role, 0.5)
        fixed = {"Yes": yes, "No": 1 - yes, coherence.UNSURE.description: 1.0}
        weights = [fixed.get(text, 1 + len(text) % 5) / texts.count(text) for text in texts]
        if self.recency:
            weights[-1] *= 2
        return {
            "id": decision["id"],
            "option_ids": [option["id"] for option in decision["options"]],
            "probabilities": [weight / sum(weights) for weight in weights],
        }


def shares(report: Mapping[str, Any]) -> dict[tuple[str, str], float]:
    (reading,) = report["readings"].values()
    return {
        (name, kind): row["share"]
        for name, kinds in reading["relations"].items()
        for kind, row in kinds.items()
    }


def test_a_coherent_server_keeps_every_relation() -> None:
    case = parse_case(case_line())
    report = run_coherence(ScriptedServer(COHERENT), [case], {"scripted": {}}, command="cmd")
    assert set(shares(report).values()) == {100.0}
    detail = report["readings"]["scripted"]["per_case"]["late-parcel"]
    assert detail["p_yes"] == pytest.approx(COHERENT)
    clones = detail["clones"]
    assert clones["original"] == clones["clone"] == pytest.approx(clones["alone"] / 2)
    text = "\n".join(format_coherence(report))
    assert "clones       choice" in text
    assert text.endswith("reproduce: cmd")


def test_an_incoherent_server_breaks_what_it_should() -> None:
    case = parse_case(case_line())
    logic = shares(run_coherence(ScriptedServer(INCOHERENT), [case], {"scripted": {}}))
    for name in ("complement", "conjunction", "disjunction", "paraphrase"):
        assert logic[name, "noul"] == 0.0, name
    assert logic["permutation", "choice"] == 100.0
    biased = shares(run_coherence(ScriptedServer(COHERENT, True), [case], {"scripted": {}}))
    assert biased["permutation", "choice"] == biased["permutation", "noul"] == 0.0
    assert biased["choice set", "choice"] == biased["clones", "choice"] == 0.0
    assert biased["batch", "choice"] == 100.0  # the same order alone and in the batch


def test_a_missing_answer_stops_the_run() -> None:
    class Forgetful(ScriptedServer):
        def invoke(self, body: Mapping[str, Any]) -> dict[str, Any]:
            answer = super().invoke(body)
            return {"results": answer["results"][:-1]} if "results" in answer else answer

    with pytest.raises(CoherenceError, match="did not answer every question"):
        run_coherence(Forgetful(COHERENT), [parse_case(case_line())], {"scripted": {}})


def test_case_variants_are_what_the_relations_compare() -> None:
    case = parse_case(case_line())
    variants = case.variants()
    assert len({decision.id for decision in variants.values()}) == len(variants)
    assert [o.id for o in variants["choice reversed"].options] == [
        "technical",
        "shipping",
        "billing",
    ]
    assert [o.id for o in variants["choice removed"].options] == ["billing", "shipping"]
    assert variants["choice added"].options[-1].id == "returns"
    clone = variants["choice cloned"].options[-1]
    assert (clone.id, clone.description) == ("billing (clone)", "Billing and refunds.")
    assert [o.description for o in variants["a"].options] == ["Yes", "No"]
    assert [o.id for o in variants["a unsure"].options] == ["yes", "no", "unsure"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"yes_no": {"a": "A?"}}, "yes_no must have exactly"),
        ({"choice": {"question": "Q?", "options": {"x": "X.", "y": "Y."}, "extra": {}}}, "3"),
        ({"id": ""}, "id"),
        ({"state": ""}, "state"),
    ],
)
def test_bad_cases_are_refused_with_file_and_line(overrides: dict[str, Any], message: str) -> None:
    lines = [json.dumps(case_line()), json.dumps(case_line(**overrides))]
    with pytest.raises(TaskFormatError, match=rf"^cases\.jsonl:2: .*{message}"):
        parse_lines(lines, "cases.jsonl", parse_case, "case")


def test_the_shipped_cases_parse() -> None:
    cases = load_cases()
    assert len(cases) == 20
    assert all(isinstance(case, Case) for case in cases)


def test_a_run_on_a_real_server_keeps_what_likelihood_keeps_by_construction(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cases_file = tmp_path / "cases.jsonl"
    cases_file.write_text(json.dumps(case_line()) + "\n", encoding="utf-8")
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)
    with live_server(create_app(settings)) as url:
        target = ["--url", url, "--cases", str(cases_file)]
        quality.main([*target, "--only", "coherence", "--out", str(tmp_path / "quality")])
        coherence.main([*target, "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "reproduce: semif-bench-quality --url" in printed
    assert "reproduce: python -m bench.coherence --url" in printed
    written = json.loads((tmp_path / "quality" / "bench-quality.json").read_text("utf-8"))
    assert written["schema"] == quality.SCHEMA
    assert set(written) == {"schema", "coherence"}
    report = json.loads((tmp_path / "bench-coherence.json").read_text(encoding="utf-8"))
    assert report["schema"] == coherence.SCHEMA
    assert set(report["readings"]) == {
        "letters",
        "likelihood sum",
        "likelihood mean",
        "likelihood pmi",
        "multi-label",
    }
    # Multi-label questions: only the choice relations, each option judged alone.
    assert set(report["readings"]["multi-label"]["relations"]["choice set"]) == {"choice"}
    assert report["readings"]["multi-label"]["relations"]["complement"] == {}
    assert "-" in printed.split("complement")[1].splitlines()[0]
    for name, reading in report["readings"].items():
        relations = reading["relations"]
        exact = ["permutation", "batch"]
        if name != "letters":  # one prompt, each option's branch scored on its own
            exact += ["choice set", "clones"]
        for relation in exact:
            for kind, row in relations[relation].items():
                assert row["share"] == 100.0, (name, relation, kind, row["gaps"])
