"""The stream planner (adapter.core.layout) alone: pure bookkeeping, no llama.cpp."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import pytest

from adapter.core.layout import (
    MIN_ROWS,
    UBATCH_ROWS,
    PassPlan,
    StreamCache,
    Work,
    price,
)
from adapter.option_tree import option_tree

Prompt = tuple[Sequence[int], Sequence[int]]
TEMPLATE = list(range(1000, 1040))


def _run(cache: StreamCache, prompts: list[Prompt]) -> PassPlan:
    plan = cache.plan(prompts)
    cache.commit(plan)
    return plan


def _prompt(state: int, question: int, length: int = 60) -> list[int]:
    return [*TEMPLATE, *([state] * length), *range(question, question + 20)]


def _held(cache: StreamCache) -> dict[int, list[int]]:
    return {seq: tokens.tolist() for seq, tokens in enumerate(cache.held) if len(tokens)}


def test_a_new_prompt_copies_its_prefix_into_an_empty_stream_and_the_source_stays() -> None:
    cache = StreamCache(8, 512, exact=True)
    first = _prompt(1, 100)
    _run(cache, [(first, [])])
    (source,) = _held(cache)
    follow = _prompt(1, 200)
    plan = _run(cache, [(follow, [])])
    (step,) = plan.steps
    (copy,) = step.copies
    common = len(TEMPLATE) + 60
    assert copy.source == source
    assert copy.keep == common
    assert plan.prompts[0].reused == common
    assert len(plan.rows) == len(follow) - common
    assert [row.position for row in plan.rows] == list(range(common, len(follow)))
    assert _held(cache) == {source: first, copy.target: follow}


def test_reuse_stops_min_rows_short_of_the_end_on_the_exact_path() -> None:
    exact, loose = StreamCache(4, 512, exact=True), StreamCache(4, 512, exact=False)
    prompt = _prompt(1, 100)
    for cache, tail in ((exact, MIN_ROWS), (loose, 1)):
        _run(cache, [(prompt, [])])
        repeat = _run(cache, [(prompt, [])])
        assert repeat.prompts[0].reused == len(prompt) - tail
        assert [row.position for row in repeat.rows] == list(range(len(prompt) - tail, len(prompt)))
        assert repeat.redecoded == tail - 1


def test_a_state_shared_by_a_pass_is_decoded_once_and_copied() -> None:
    cache = StreamCache(8, 512, exact=True)
    prompts: list[Prompt] = [(_prompt(7, 100 * q), []) for q in range(1, 4)]
    plan = _run(cache, prompts)
    first, second = plan.steps
    stem = len(TEMPLATE) + 60
    assert len(first.micro_batches) == 1
    assert [row.position for row in first.micro_batches[0]] == list(range(stem))
    leader = first.micro_batches[0][0].seq
    copies = {copy.target: copy for copy in second.copies}
    assert all(copy.keep == stem for copy in copies.values())
    assert sorted(c.source for c in copies.values() if c.source is not None) == [leader] * 2
    assert len(plan.rows) == stem + 3 * 20
    for prompt_plan in plan.prompts:  # each path: the shared stem, then its own question
        assert len(prompt_plan.new_rows) == stem + 20
        assert prompt_plan.reused == 0


def test_continuations_ride_as_sequences_of_their_own_and_are_released() -> None:
    cache = StreamCache(8, 512, exact=True)
    prompt = _prompt(3, 100)
    plan = _run(cache, [(prompt, [11, 12])])
    rows = plan.rows
    main = plan.prompts[0]
    last = rows[main.last_row]
    assert (last.token, last.position) == (prompt[-1], len(prompt) - 1)
    for token, row_id in zip([11, 12], main.continuation_rows, strict=True):
        row = rows[row_id]
        assert (row.token, row.position, row.logits) == (token, len(prompt), True)
        assert row.seq in plan.released
    assert _held(cache) == {last.seq: prompt}


def test_empty_streams_fill_first_then_the_least_recently_used_is_overwritten() -> None:
    cache = StreamCache(4, 512, exact=True)
    for state in (1, 2, 3):
        _run(cache, [(_prompt(state, 100), [])])
    plan = _run(cache, [(_prompt(1, 300), [])])
    assert plan.rows[0].seq == 3  # the empty stream, not one holding a state
    assert sorted(tokens[len(TEMPLATE)] for tokens in _held(cache).values()) == [1, 1, 2, 3]
    _run(cache, [(_prompt(5, 100), [])])
    # state 2 was the least recently used (states 1 and 3 were read or written since)
    assert sorted(tokens[len(TEMPLATE)] for tokens in _held(cache).values()) == [1, 1, 3, 5]


def test_a_short_pool_overwrites_a_source_with_its_own_reader() -> None:
    cache = StreamCache(2, 512, exact=True)
    _run(cache, [(_prompt(1, 100), [])])
    _run(cache, [(_prompt(2, 100), [])])
    plan = _run(cache, [(_prompt(1, 300), []), (_prompt(2, 300), [])])
    assert all(prompt.reused == len(TEMPLATE) + 60 for prompt in plan.prompts)
    assert all(copy.source is None for copy in plan.steps[0].copies)  # cut in place


def test_reserved_streams_are_never_planned_over() -> None:
    cache = StreamCache(3, 512, exact=True)
    chat = cache.reserve()
    assert cache.capacity == 2
    for question in range(5):
        plan = _run(cache, [(_prompt(question, 100), []), (_prompt(9, question), [])])
        assert chat not in {row.seq for row in plan.rows}
        assert chat not in {copy.target for step in plan.steps for copy in step.copies}
    with pytest.raises(OverflowError, match="2 streams are free"):
        cache.plan([(_prompt(1, 1), [5, 6])])
    cache.release(chat)
    assert cache.capacity == 3


def test_a_sequence_longer_than_a_stream_is_refused() -> None:
    with pytest.raises(OverflowError, match="a stream has 64"):
        StreamCache(4, 64, exact=True).plan([(list(range(65)), [])])


def _check_micro_batches(plan: PassPlan, *, exact: bool) -> None:
    """What llama.cpp's sequential equal split needs for each call to be one micro-batch
    (consecutive ascending stream ids, equal rows each, at most UBATCH_ROWS), and what
    exactness needs (MIN_ROWS rows per stream, never exactly one output row)."""
    for step in plan.steps:
        for batch in step.micro_batches:
            seqs = [row.seq for row in batch]
            order = list(dict.fromkeys(seqs))
            assert order == list(range(order[0], order[0] + len(order)))
            assert seqs == sorted(seqs)
            counts = set(Counter(seqs).values())
            assert len(counts) == 1
            assert len(batch) <= UBATCH_ROWS
            if exact:
                assert counts.pop() >= MIN_ROWS
                assert sum(row.logits for row in batch) != 1
            for seq in order:  # each stream's rows continue in position order
                positions = [row.position for row in batch if row.seq == seq]
                assert positions == list(range(positions[0], positions[0] + len(positions)))


def test_random_passes_keep_every_micro_batch_exact_and_consistent() -> None:
    rng = random.Random(20261201)
    for exact in (True, False):
        cache = StreamCache(16, 1500, exact=exact)
        positions: dict[int, int] = {}  # stream -> next position llama.cpp would accept
        for _ in range(120):
            prompts: list[Prompt] = []
            for _ in range(rng.randint(1, 4)):
                state = rng.randint(1, 5)
                length = rng.choice([1, 2, 3, 40, 300, 700])
                prompt = [*TEMPLATE, *([state] * length), *range(rng.randint(0, 50))]
                conts = rng.sample(range(5, 30), rng.choice([0, 0, 1, 3]))
                prompts.append((prompt, conts))
            unique = list({tuple(p): (p, c) for p, c in prompts}.values())
            plan = cache.plan(unique)
            _check_micro_batches(plan, exact=exact)
            for step in plan.steps:
                for copy in step.copies:
                    positions[copy.target] = copy.keep
                for batch in step.micro_batches:
                    for row in batch:
                        assert row.position == positions.get(row.seq, 0)
                        positions[row.seq] = row.position + 1
            for seq in plan.released:
                positions[seq] = 0
            for (tokens, _), prompt_plan in zip(unique, plan.prompts, strict=True):
                assert plan.rows[prompt_plan.last_row].position == len(tokens) - 1
            cache.commit(plan)


def test_a_copy_is_made_before_its_source_is_cut() -> None:
    cache = StreamCache(3, 512, exact=True)
    _run(cache, [(_prompt(1, 100), [])])
    _run(cache, [(_prompt(2, 100), [])])
    plan = cache.plan([(_prompt(1, 300), []), (_prompt(1, 400), []), (_prompt(2, 9), [])])
    copies = plan.steps[0].copies
    (made,) = [copy for copy in copies if copy.source is not None]
    cut = next(copy for copy in copies if copy.target == made.source)
    assert copies.index(made) < copies.index(cut)
    assert cut.keep == made.keep == len(TEMPLATE) + 60


def test_a_recurrent_model_takes_only_whole_streams() -> None:
    """Its state exists only after a stream's last token: a prompt may continue a stream's
    whole content, never cut it shorter (llama.cpp refuses that for recurrent layers)."""
    cache = StreamCache(6, 512, exact=True, whole_only=True)
    lengths = [0] * 6  # what each stream holds, as llama.cpp would see it

    def run(prompts: list[Prompt]) -> PassPlan:
        plan = _run(cache, prompts)
        for step in plan.steps:
            for copy in step.copies:
                held = lengths[copy.source] if copy.source is not None else lengths[copy.target]
                assert copy.keep in (0, held), (copy, held)  # never a shorter prefix
                lengths[copy.target] = copy.keep
            for batch in step.micro_batches:
                for row in batch:
                    lengths[row.seq] = row.position + 1
        for seq in plan.released:
            lengths[seq] = 0
        return plan

    first = _prompt(1, 100)
    run([(first, [])])
    follow = run([(_prompt(1, 200), [])])  # shares template and state, not all of it
    assert follow.prompts[0].reused == 0
    extended = [*first, 7, 8, 9]
    assert run([(extended, [])]).prompts[0].reused == len(first)
    solo = _prompt(8, 100)
    run([(solo, [])])
    assert run([(solo, [])]).prompts[0].reused == 0  # a repeat would need a cut 2 short
    shared = run([(_prompt(5, 100 * q), [2, 3]) for q in range(1, 3)])
    assert len(shared.steps) == 2  # the state is still decoded once, then copied whole
    for _ in range(3):
        run([(_prompt(9, 100 * q), [4]) for q in range(1, 3)])


def test_a_one_token_prompt_decodes_alone_and_never_cuts_its_neighbour_short() -> None:
    cache = StreamCache(4, 64, exact=True)
    plan = cache.plan([([5], []), ([1, 2, 3, 4], [])])
    long_stream = plan.rows[plan.prompts[1].last_row].seq
    for batch in plan.steps[0].micro_batches:
        mine = [row for row in batch if row.seq == long_stream]
        assert not mine or len(mine) >= MIN_ROWS
        assert len({row.seq for row in batch}) == 1  # the one-row stream rides alone


# -- the one price function ---------------------------------------------------------------


def _request(rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """A request as clients send them: questions about up to three states (each its own
    length), some repeated, some with label continuations; half the time grouped by state."""
    lengths = {state: rng.randint(0, 300) for state in (1, 2, 3)}
    prompts: list[list[int]] = []
    continuations: list[list[int]] = []
    for _ in range(rng.randint(1, 12)):
        if prompts and rng.random() < 0.2:
            prompts.append(list(prompts[-1]))
            continuations.append(list(continuations[-1]))
            continue
        state = rng.randint(1, 3)
        prompts.append(_prompt(state, rng.randint(1, 5) * 100, lengths[state]))
        continuations.append(sorted(rng.sample(range(1, 30), rng.choice([0, 0, 2, 5]))))
    if rng.random() < 0.5:
        order = sorted(range(len(prompts)), key=lambda index: prompts[index][len(TEMPLATE)])
        prompts = [prompts[index] for index in order]
        continuations = [continuations[index] for index in order]
    return prompts, continuations


@pytest.mark.parametrize("seed", range(80))
def test_price_bounds_what_a_request_alone_decodes_in_one_pass(seed: int) -> None:
    """Invariant: on an empty cache, scoring a request's prompts in one pass decodes no more
    than a quarter over the rows `price` gives them, with the template once per state it
    asks about (the price credits a prefix shared with the prompt before, a pass decodes it
    once per stem; the price decides prompt by prompt, the planner over the whole pass:
    measured at most 1.24 over 3,000 requests), and holds no more streams than it counts
    (repeats ride free). The scheduler packs passes by these numbers and the request budget
    charges them."""
    rng = random.Random(seed)
    prompts, continuations = _request(rng)
    cost = price(prompts, continuations, stream_cells=512)
    cache = StreamCache(64, 512, exact=True)
    distinct: dict[tuple[int, ...], set[int]] = {}
    for prompt, extra in zip(prompts, continuations, strict=True):
        distinct.setdefault(tuple(prompt), set()).update(extra)
    plan = cache.plan([(list(p), sorted(e)) for p, e in distinct.items()])
    states = len({prompt[len(TEMPLATE)] for prompt in prompts})
    bound = sum(c.rows for c in cost.prompts) + len(TEMPLATE) * states
    assert len(plan.rows) <= 1.25 * bound, seed
    assert sum(c.sequences for c in cost.prompts) >= sum(1 + len(e) for e in distinct.values())
    # The cells its rows attend to (the speed model's second term, fitted, so only its shape
    # matters): within half over, a row at position p attending to p + 1 cells.
    attended = sum(row.position + 1 for row in plan.rows)
    template = len(TEMPLATE) * (len(TEMPLATE) + 1) // 2 * states
    assert attended <= 1.5 * (cost.work().cells + template), seed


def test_a_pass_cuts_its_stems_where_they_save_the_most() -> None:
    """Questions about two states that share only the template: each state is decoded once
    (not once per question, as one template-wide stem would), on an empty cache too."""
    prompts: list[Prompt] = [
        (_prompt(state, q, 200), []) for state in (1, 2) for q in (100, 200, 300)
    ]
    plan = StreamCache(16, 512, exact=True).plan(prompts)
    once = 2 * (len(TEMPLATE) + 200) + 6 * (20 + MIN_ROWS)
    assert len(plan.rows) <= once


def test_price_charges_copies_by_stream_size_and_repeats_nothing() -> None:
    """Oracles for the price's parts that the planner does not bound: a prompt repeating
    the one before it adds nothing (the pass scores it once), each sequence's whole-stream
    copy costs more in a larger stream while the rows stay, and `charge(start)` is what the
    prompts from `start` on cost, for the scheduler's account of a request in progress."""
    state, sibling = _prompt(1, 100), _prompt(1, 200)
    once = price([state, sibling], [[5, 6], [7, 8]], stream_cells=1024)
    repeated = price([state, state, sibling], [[5, 6], [5, 6], [7, 8]], stream_cells=1024)
    assert repeated.charge() == once.charge()
    assert repeated.charge(2) == once.charge(1) < once.charge()
    cache = StreamCache(16, 1024, exact=True)
    decoded = len(cache.plan([(state, [5, 6]), (sibling, [7, 8])]).rows)
    assert decoded <= 1.25 * sum(cost.rows for cost in once.prompts)
    larger = price([state, sibling], [[5, 6], [7, 8]], stream_cells=4096)
    assert [c.rows for c in larger.prompts] == [c.rows for c in once.prompts]
    assert larger.charge() > once.charge()
    copies = sum(cost.copies for cost in once.prompts)
    assert copies >= 1 + 2 + 1 + 2  # a stream per prompt and per continuation
    assert larger.charge() - once.charge() == copies * (larger.copy_rows - once.copy_rows)


def test_price_counts_the_passes_a_request_needs_alone() -> None:
    prompts = [_prompt(state, 100, 400) for state in range(1, 6)]  # ~462 rows each
    cost = price(prompts, [[] for _ in prompts], stream_cells=512)
    passes = cost.passes(1024, 31)
    # two per pass, the last alone: the work of each, which together is the request's
    assert passes == [cost.work(0, 2), cost.work(2, 4), cost.work(4)]
    assert sum(passes, Work()) == cost.work()
    assert len(cost.passes(1024, 1)) == 5  # one stream per pass
    assert cost.passes(1024, 31, start=4) == [cost.work(4)]
    labelled = price([_prompt(1, 100)] * 2, [[1, 2, 3], [4]], stream_cells=512)
    assert len(labelled.passes(1024, 31)) == 1
    assert len(labelled.passes(1024, 4)) == 2  # 4 + 2 sequences


# -- memory that keeps only whole streams (recurrent, hybrid): checkpoints ---------------------


def _asked(
    cache: StreamCache, prompts: list[list[int]], cuts: tuple[int, ...]
) -> tuple[int, list[int]]:
    """Rows one pass decodes and what each prompt reused, with the prompts' boundaries."""
    plan = _run_with(cache, [(prompt, []) for prompt in prompts], [cuts] * len(prompts))
    return len(plan.rows), [prompt.reused for prompt in plan.prompts]


def _run_with(
    cache: StreamCache, prompts: list[Prompt], boundaries: list[tuple[int, ...]]
) -> PassPlan:
    plan = cache.plan(prompts, boundaries)
    cache.commit(plan)
    return plan


def test_whole_stream_memory_keeps_checkpoints_where_prompts_branch() -> None:
    """Targets of the hybrid-model issue, on the planner: a new question about a resident
    state decodes what a prompt-keeping cache does (its question), a question about a new
    state reuses the system turn, and a state asked over several passes is decoded once."""
    system, state_end = len(TEMPLATE), len(TEMPLATE) + 300
    cuts = (system, state_end)
    whole = StreamCache(32, 1024, exact=True, whole_only=True)
    prefix = StreamCache(32, 1024, exact=True)
    for cache in (whole, prefix):
        _asked(cache, [_prompt(1, 100, 300)], cuts)
    held = {len(tokens) for tokens in whole.held if len(tokens)}
    assert {system, state_end} <= held  # kept exactly there
    rows, (reused,) = _asked(whole, [_prompt(1, 200, 300)], cuts)
    prefix_rows, _ = _asked(prefix, [_prompt(1, 200, 300)], cuts)
    assert reused == state_end
    assert rows <= 1.2 * prefix_rows
    rows, (reused,) = _asked(whole, [_prompt(2, 200, 300)], cuts)
    assert reused == system  # a new state: the system turn is not decoded again
    assert rows <= 300 + 20 + 2 * MIN_ROWS + MIN_ROWS  # its state and question, and the rest
    decoded = 0
    for start in range(100, 1700, 400):  # 16 questions about state 3, four per pass
        questions = [_prompt(3, q, 300) for q in range(start, start + 400, 100)]
        rows, took = _asked(whole, questions, cuts)
        decoded += rows
        if start > 100:
            assert took == [state_end] * 4
    assert decoded <= 300 + 16 * (20 + 2 * MIN_ROWS) + 2 * MIN_ROWS


def test_checkpoints_never_crowd_out_the_prompts() -> None:
    """Checkpoints take only streams a pass leaves free; none on a prefix-keeping cache."""
    cuts = (len(TEMPLATE), len(TEMPLATE) + 60)
    tight = StreamCache(4, 1024, exact=True, whole_only=True)
    plan = tight.plan([(_prompt(1, q), []) for q in (100, 200, 300, 400)], [cuts] * 4)
    assert len(plan.resident) == 4  # the prompts, no checkpoint
    roomy = StreamCache(8, 1024, exact=True)
    plan = roomy.plan([(_prompt(1, 100), [])], [cuts])
    assert len(plan.resident) == 1


def _branches(rng: random.Random, state: int) -> tuple[list[list[int]], list[int]]:
    """A likelihood question: one prompt, a branch per option (1-12 tokens, some sharing
    their first tokens), each scoring its option's tokens."""
    prompt = _prompt(state, rng.randint(1, 5) * 100, rng.randint(0, 200))
    options = [
        [*([500] * rng.choice([0, 0, 2])), *rng.sample(range(600, 700), rng.randint(1, 12))]
        for _ in range(rng.randint(2, 8))
    ]
    return [[*prompt, *option] for option in options], [len(option) for option in options]


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "loose"])
def test_scored_rows_are_decoded_in_the_pass_with_logits_in_position_order(exact: bool) -> None:
    """Invariant, over random passes on a warm cache: every row that scores a token is
    decoded in the pass (a resident prefix keeps no logits), outputs logits, and stands
    just before the token it scores, on the prompt's own path; the micro-batches stay exact."""
    rng = random.Random(20261203)
    cache = StreamCache(40, 700, exact=exact)
    for _ in range(60):
        prompts: list[list[int]] = []
        scored: list[int] = []
        for _ in range(rng.randint(1, 3)):
            branches, counts = _branches(rng, rng.randint(1, 4))
            prompts += branches
            scored += counts
        unique = {tuple(p): (p, s) for p, s in zip(prompts, scored, strict=True)}
        plan = cache.plan(
            [(p, []) for p, _ in unique.values()], scored=[s for _, s in unique.values()]
        )
        _check_micro_batches(plan, exact=exact)
        rows = plan.rows
        for (tokens, count), prompt_plan in zip(unique.values(), plan.prompts, strict=True):
            assert len(prompt_plan.scored_rows) == count
            positions = [rows[row].position for row in prompt_plan.scored_rows]
            assert positions == list(range(len(tokens) - count - 1, len(tokens) - 1))
            assert all(rows[row].logits for row in prompt_plan.scored_rows)
            assert set(prompt_plan.scored_rows) <= prompt_plan.new_rows
            assert prompt_plan.reused <= len(tokens) - count - 1
            assert set(prompt_plan.scored_rows) <= set(plan.output_rows)
        cache.commit(plan)


def test_scored_tokens_must_leave_a_row_to_score_the_first() -> None:
    with pytest.raises(ValueError, match="scored tokens"):
        StreamCache(4, 64, exact=True).plan([([1, 2, 3], [])], scored=[3])


@pytest.mark.parametrize("seed", range(40))
def test_price_bounds_what_scored_branches_decode(seed: int) -> None:
    """The price invariant above for likelihood questions: branches that share their
    option's first tokens are still charged every scored row they decode themselves."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    scored: list[int] = []
    for state in rng.sample((1, 2, 3), rng.randint(1, 2)):
        branches, counts = _branches(rng, state)
        prompts += branches
        scored += counts
    cost = price(prompts, [[] for _ in prompts], stream_cells=512, scored=scored)
    plan = StreamCache(64, 512, exact=True).plan([(p, []) for p in prompts], scored=scored)
    states = len({prompt[len(TEMPLATE)] for prompt in prompts})
    bound = sum(c.rows for c in cost.prompts) + len(TEMPLATE) * states
    assert len(plan.rows) <= 1.25 * bound, seed
    assert sum(c.rows for c in cost.prompts) >= sum(count + 1 for count in scored)


def _simulate(plan: PassPlan, streams: dict[int, list[int]]) -> None:
    """Run a plan on token lists: copies (a stream's first `keep` cells), then every row
    appended where llama.cpp would put it."""
    for step in plan.steps:
        for copy in step.copies:
            held = streams.get(copy.target if copy.source is None else copy.source, [])
            assert copy.keep <= len(held)
            streams[copy.target] = held[: copy.keep]
        for batch in step.micro_batches:
            for row in batch:
                assert row.position == len(streams.setdefault(row.seq, []))
                streams[row.seq].append(row.token)
    for seq in plan.released:
        streams[seq] = []


def _tree_prompts(rng: random.Random, *, whole_streams: bool) -> tuple[list[list[int]], list[int]]:
    """A likelihood question's option tree (adapter.option_tree) as the service sends it:
    options sharing prefixes at several depths, some ending where others go on."""
    prompt = _prompt(rng.randint(1, 5), 100, rng.randint(20, 200))
    heads = [rng.sample(range(600, 700), rng.randint(1, 4)) for _ in range(rng.randint(1, 4))]
    options = {
        (*rng.choice(heads), *rng.sample(range(700, 800), rng.randint(0, 3)), 9)
        for _ in range(rng.randint(2, 24))
    }
    tree = option_tree(sorted(options), whole_streams=whole_streams)
    prompts = [[*prompt, *edge.path] for edge in tree.edges]
    return prompts, [edge.scored for edge in tree.edges]


@pytest.mark.parametrize("whole_only", [False, True], ids=["cuts", "whole-streams"])
def test_an_option_tree_decodes_every_edge_once_from_a_copy_of_its_parent(
    whole_only: bool,
) -> None:
    """Over random option trees, in one pass on an empty cache and in passes of random
    sizes on a warm one: every stream holds exactly its prompt's tokens (copies and rows
    replayed), the micro-batches stay exact, every scored row stands before its token on
    the prompt's own path, and one pass decodes the prompt once and each edge once, which
    is what the price charges (a one-token edge: the row before it too; kept whole, such
    edges are carried below instead)."""
    rng = random.Random(20261205)
    for _ in range(40):
        prompts, scored = _tree_prompts(rng, whole_streams=whole_only)
        root = len(prompts[0])
        cache = StreamCache(64, 1024, exact=True, whole_only=whole_only)
        plan = cache.plan([(p, []) for p in prompts], scored=scored)
        _check_micro_batches(plan, exact=True)
        streams: dict[int, list[int]] = {}
        _simulate(plan, streams)
        for seq, resident in plan.resident:
            assert streams[seq] == resident.tolist()
        rows = plan.rows
        for prompt, count, prompt_plan in zip(prompts, scored, plan.prompts, strict=True):
            positions = [rows[row].position for row in prompt_plan.scored_rows]
            assert positions == list(range(len(prompt) - count - 1, len(prompt) - 1))
            assert rows[prompt_plan.last_row].position == len(prompt) - 1
        # Each edge decodes its own tokens, a one-token edge the row before it too.
        grown = sum(
            len(p) - min(max(len(q) for q in prompts[:i] if p[: len(q)] == q), len(p) - MIN_ROWS)
            for i, p in enumerate(prompts)
            if i
        )
        assert len(rows) == root + grown
        cost = price(prompts, [[] for _ in prompts], stream_cells=1024, scored=scored)
        assert sum(c.rows for c in cost.prompts[1:]) == grown
        warm = StreamCache(12, 1024, exact=True, whole_only=whole_only)
        held: dict[int, list[int]] = {}
        start = 0
        while start < len(prompts):
            end = min(len(prompts), start + rng.randint(1, 10))
            part = warm.plan([(p, []) for p in prompts[start:end]], scored=scored[start:end])
            _check_micro_batches(part, exact=True)
            _simulate(part, held)
            for seq, tokens in part.resident:
                assert held[seq] == tokens.tolist()
            warm.commit(part)
            start = end
