"""`python -m bench.branch_tokens` on the tiny model: every normalization and option count
built both ways, the works identical, the after time judged against the limit (the figures
themselves are the benchmark's, on the embedded model)."""

from __future__ import annotations

from pathlib import Path

from bench.branch_tokens import LIMIT_SECONDS, measure, open_service, options, verdict


def test_each_question_is_built_both_ways_with_identical_work(tiny_gguf: Path) -> None:
    service = open_service(tiny_gguf, state_tokens=200, threads=2)
    try:
        rows = measure(service, 200, counts=(3, 40), repeats=1)
    finally:
        service.close(5)
    assert [(row.normalization, row.options) for row in rows] == [
        ("mean", 3),
        ("mean", 40),
        ("pmi", 3),
        ("pmi", 40),
    ]
    for row in rows:
        assert row.identical
        assert row.prompt_tokens >= 200
        assert row.before > 0
        assert row.after > 0


def test_options_are_distinct_phrases_sharing_leading_words() -> None:
    made = options(1024)
    descriptions = [option.description for option in made]
    assert len(set(descriptions)) == len({option.id for option in made}) == 1024
    assert descriptions[0] == "billing: refund for order 1"


def test_the_verdict_names_the_limit_the_time_and_the_ratio() -> None:
    assert verdict(LIMIT_SECONDS / 4) == "limit 0.2 s: 0.050 s, ratio 0.250, PASS"
    assert verdict(LIMIT_SECONDS * 2).endswith("ratio 2.000, FAIL")
