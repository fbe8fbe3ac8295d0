"""The exact-layout planner (adapter.kv_layout) alone: pure bookkeeping, no llama.cpp."""

from __future__ import annotations

from collections.abc import Sequence

from adapter.kv_layout import JUNK_SEQUENCE, PAD_SEQUENCE, UBATCH_ROWS, PassPlan, PrefixCache

Prompt = tuple[Sequence[int], Sequence[int]]


def _run(cache: PrefixCache, prompts: list[Prompt]) -> PassPlan:
    plan = cache.plan(prompts)
    cache.commit(plan, prompts)
    return plan


def _cells(plan: PassPlan, top: int) -> list[int]:
    return list(range(0 if plan.wipe else top, (0 if plan.wipe else top) + len(plan.rows)))


def test_rows_sit_at_cells_congruent_to_their_positions() -> None:
    cache = PrefixCache(4096, alignment=16, max_entries=8)
    _run(cache, [(list(range(1, 40)), [])])
    top = cache.top
    plan = _run(cache, [(list(range(1, 30)) + [99] * 20, [7, 8]), (list(range(50, 75)), [])])
    temporary = set(plan.temporary)
    checked = 0
    for cell, row in zip(_cells(plan, top), plan.rows, strict=True):
        if set(row.sequences) - temporary:  # rows of segments that stay resident
            assert cell % 16 == row.position % 16
            checked += 1
    assert checked == len(range(1, 30)) + 20 - 16 + 25  # the follow-up reuses one block


def test_kept_rows_precede_temporary_rows_and_set_kept_top() -> None:
    cache = PrefixCache(4096, alignment=16, max_entries=8)
    plan = _run(cache, [(list(range(1, 21)), [5, 6]), (list(range(1, 11)) + [77] * 9, [])])
    temporary = set(plan.temporary) - {PAD_SEQUENCE}
    real = [(index, row) for index, row in enumerate(plan.rows) if row.sequences != (PAD_SEQUENCE,)]
    kinds = [not set(row.sequences) - temporary for _, row in real]
    kept = kinds.index(True)
    assert not any(kinds[:kept])
    assert all(kinds[kept:])
    last_kept = real[kept - 1][0]
    first_temporary = real[kept][0]
    assert last_kept < plan.kept_top <= first_temporary  # from an empty arena
    assert cache.top == plan.kept_top
    assert plan.kept_pads <= plan.pad_rows


def test_reuse_is_whole_blocks_of_the_common_prefix() -> None:
    cache = PrefixCache(4096, alignment=16, max_entries=8)
    first = list(range(1, 60))
    _run(cache, [(first, [])])
    follow = [*first[:37], 500, 501, 502]
    plan = _run(cache, [(follow, [])])
    assert plan.prompts[0].reused == 32  # floor(37 / 16) * 16
    assert plan.copies
    assert plan.copies[0][2] == 32
    evaluated = len(plan.rows) - plan.pad_rows
    assert evaluated == len(follow) - 32
    short = [*first[:10], 9]
    assert _run(cache, [(short, [])]).prompts[0].reused == 0


def test_least_recently_used_entries_become_junk_past_max_entries() -> None:
    cache = PrefixCache(8192, alignment=16, max_entries=2)
    _run(cache, [([1] * 20, [])])
    _run(cache, [([2] * 20, [])])
    oldest = min(cache.entries.values(), key=lambda entry: entry.last_used).seq
    plan = _run(cache, [([3] * 20, [])])
    assert plan.junk == (oldest,)
    assert sorted(int(entry.tokens[0]) for entry in cache.entries.values()) == [2, 3]
    assert JUNK_SEQUENCE not in cache.entries


def test_a_pass_that_does_not_fit_above_top_wipes_the_arena() -> None:
    cache = PrefixCache(256, alignment=16, max_entries=8)
    _run(cache, [(list(range(1, 150)), [])])
    assert cache.top >= 149
    plan = _run(cache, [(list(range(300, 450)), [])])
    assert plan.wipe
    assert next(iter(cache.entries.values())).tokens[0] == 300
    assert len(cache.entries) == 1


def test_a_pass_never_ends_with_a_one_row_ubatch() -> None:
    for length in range(UBATCH_ROWS - 40, UBATCH_ROWS + 40):
        cache = PrefixCache(4096, alignment=16, max_entries=8)
        plan = cache.plan([(list(range(1, length + 1)), [])])
        assert len(plan.rows) % UBATCH_ROWS != 1


def test_no_micro_batch_has_a_single_output_row() -> None:
    """A lone output row takes the matrix-vector kernel in llama.cpp's last layer; each
    micro-batch carries none or at least two, and a spare is never a prompt's output."""
    for prompts, spares in (
        ([(list(range(1, 60)), [])], 1),  # one prompt alone
        ([(list(range(1, 400)), []), (list(range(1000, 1300)), [])], 2),  # one per ubatch
        ([(list(range(1, 30)), [5, 6, 7])], 0),  # the continuations are outputs already
    ):
        plan = PrefixCache(4096, alignment=16, max_entries=8).plan(prompts)
        for start in range(0, len(plan.rows), UBATCH_ROWS):
            outputs = sum(row.logits for row in plan.rows[start : start + UBATCH_ROWS])
            assert outputs != 1, (len(prompts), start)
        named = set(plan.output_rows)
        marked = {index for index, row in enumerate(plan.rows) if row.logits}
        assert named <= marked
        assert len(marked - named) == spares


def test_the_arena_is_wiped_when_attending_over_it_costs_more_than_redecoding() -> None:
    cache = PrefixCache(8192, alignment=16, max_entries=64, break_even_cells=3000.0)
    template = list(range(1, 49))
    for state in range(3):  # ~250-token decisions about new states: kept, 3 resident
        plan = _run(cache, [(template + [1000 + 300 * state + i for i in range(200)], [])])
        assert not plan.wipe
    assert cache.top > 600
    follow_up = [*next(iter(cache.entries.values())).tokens.tolist()[:240], 7, 8, 9]
    kept = _run(cache, [(follow_up, [])])
    assert not kept.wipe  # it reuses 240 tokens: re-decoding them costs more than the arena
    fresh = _run(cache, [(template + [5000 + i for i in range(200)], [])])
    assert fresh.wipe  # only the template to reuse: attending over ~900 cells costs more
    assert fresh.prompts[0].reused == 0


def test_without_a_break_even_the_arena_is_wiped_only_when_full() -> None:
    cache = PrefixCache(8192, alignment=16, max_entries=64)
    for state in range(20):
        plan = _run(cache, [([1000 + 300 * state + i for i in range(250)], [])])
        assert not plan.wipe


def test_a_running_chat_context_counts_in_the_price_of_a_wipe() -> None:
    cache = PrefixCache(8192, alignment=16, max_entries=64, break_even_cells=3000.0)
    for state in range(3):
        _run(cache, [([1000 + 300 * state + i for i in range(250)], [])])
    new_state: list[Prompt] = [([5000 + i for i in range(250)], [])]
    assert cache.plan(new_state).wipe  # nothing held: re-decoding nothing is cheap
    assert not cache.plan(new_state, held_tokens=400).wipe  # a chat would re-read 400
