"""The option tree (adapter.option_tree) alone: which prompts it sends and where each token's
log-probability is read, against a made-up model that scores a token by its whole prefix."""

from __future__ import annotations

import random
import zlib

import pytest

from adapter.option_tree import AFTER, MIN_EDGE, option_tree


def _logprob(prefix: tuple[int, ...], token: int) -> float:
    """A made-up model: any function of the whole prefix and the token will do."""
    return -float(zlib.crc32(repr((prefix, token)).encode()) % 1000) / 100


def _options(rng: random.Random) -> list[list[int]]:
    heads = [rng.sample(range(10, 30), rng.randint(1, 3)) for _ in range(rng.randint(1, 3))]
    found = {
        (*rng.choice(heads), *rng.sample(range(30, 40), rng.randint(0, 3)), 2)
        for _ in range(rng.randint(1, 12))
    }
    return [list(option) for option in sorted(found)]


@pytest.mark.parametrize("whole_streams", [False, True])
def test_every_token_is_read_where_a_separate_forward_reads_it(whole_streams: bool) -> None:
    """What the engine gives each edge (its scored tokens, the tokens read after it) read
    back by the recipes is, option by option, each token's log-probability after its own
    prefix; every edge comes after its parent and decodes at least MIN_EDGE rows: a
    one-token edge scores its token (the row before it decoded again), except where whole
    streams are kept, whose edges are all at least MIN_EDGE tokens long."""
    rng = random.Random(5)
    for _ in range(300):
        options = _options(rng)
        tree = option_tree(options, whole_streams=whole_streams)
        assert tree.edges[0].path == ()
        for index, edge in enumerate(tree.edges[1:], start=1):
            parents = [e for e in tree.edges[:index] if edge.path[: len(e.path)] == e.path]
            parent = max(parents, key=lambda e: len(e.path))
            own = len(edge.path) - len(parent.path)
            assert own >= (MIN_EDGE if whole_streams else 1)
            assert edge.scored == max(own - 1, 1)
            assert edge.path[len(parent.path)] in parent.after
        scored = [
            [
                _logprob(e.path[: len(e.path) - e.scored + i], e.path[-e.scored + i])
                for i in range(e.scored)
            ]
            for e in tree.edges
        ]
        after = [{token: _logprob(e.path, token) for token in e.after} for e in tree.edges]
        for option, recipe in zip(options, tree.recipes, strict=True):
            read = [
                after[edge][token] if at == AFTER else scored[edge][at]
                for (edge, at), token in zip(recipe, option, strict=True)
            ]
            assert read == [_logprob(tuple(option[:i]), option[i]) for i in range(len(option))]


def test_shared_prefixes_are_sent_once() -> None:
    """Two options sharing "10 11" then a one-token branch: the shared edge is sent once,
    the one-token edges are carried below it, an option ending at a branch point sends
    nothing of its own, and a clone is the same leaf."""
    options = [[10, 11, 12, 2], [10, 11, 13, 2], [10, 11, 2], [10, 11, 12, 2], [14, 2]]
    tree = option_tree(options)
    assert [edge.path for edge in tree.edges] == [
        (),
        (10, 11),
        (10, 11, 12, 2),
        (10, 11, 13, 2),
        (14, 2),
    ]
    assert tree.edges[1].after == (2, 12, 13)
    assert tree.recipes[2] == ((0, AFTER), (1, 0), (1, AFTER))
    assert tree.recipes[0] == tree.recipes[3]
    # A branch point one token in: sent as an edge of its own that decodes the row before
    # it again, or carried into each branch where streams are kept whole.
    forked = [[20, 21, 2], [20, 22, 2], [23, 2]]
    assert [e.path for e in option_tree(forked).edges] == [
        (),
        (20,),
        (20, 21, 2),
        (20, 22, 2),
        (23, 2),
    ]
    assert option_tree(forked).edges[1].scored == 1
    carried = option_tree(forked, whole_streams=True)
    assert [e.path for e in carried.edges] == [(), (20, 21, 2), (20, 22, 2), (23, 2)]
