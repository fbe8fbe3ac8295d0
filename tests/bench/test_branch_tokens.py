"""`python -m bench.branch_tokens` on the tiny model: every normalization and option count
built both ways, the works identical, the after time judged against the limit (the figures
themselves are the benchmark's, on the embedded model)."""

from __future__ import annotations

from pathlib import Path

from bench.branch_tokens import (
    LIMIT_SECONDS,
    TREE_BRANCHES,
    TREE_LIMIT,
    TREE_STATE_TOKENS,
    measure,
    measure_tree,
    open_service,
    options,
    verdict,
)


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


def test_an_option_tree_decodes_about_one_row_per_node(tiny_gguf: Path) -> None:
    """Rows, not time: on an empty cache, a question's likelihood branches decode each node
    of their prefix tree once (plus the state), however many options share it."""
    service = open_service(tiny_gguf, TREE_STATE_TOKENS, threads=2, branches=TREE_BRANCHES)
    try:
        rows = measure_tree(service, counts=(3, 60))
    finally:
        service.close(5)
    assert [row.options for row in rows] == [3, 60]
    for row in rows:
        assert row.nodes > TREE_STATE_TOKENS
        assert 0 < row.rows <= TREE_LIMIT * row.nodes, row
