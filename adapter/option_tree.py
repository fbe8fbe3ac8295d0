"""A likelihood question's branches as a tree: every shared option prefix decoded once.

Options that start alike ("billing: refund ...", "billing: invoice ...") share leading
tokens. Sent as one branch per option, each branch decodes those tokens again. Here the
options' tokens (each ending with the end of the turn) form a prefix tree below the prompt,
and each prompt sent to the engine is one of its edges:
- the root is the prompt itself, scoring nothing of its own, and asking (`Entry.after`)
  for the log-probability of each token that starts an edge leaving it;
- an edge of m tokens is the prompt followed by the path to its end: it scores its last
  m - 1 tokens (the first is read after the edge it leaves) and asks after itself for the
  first token of each edge leaving it;
- every stream decodes at least two rows (the exact path's rule,
  adapter.core.layout.MIN_ROWS): a one-token edge that ends at a branch point decodes the
  row before it again (scoring its token there a second time) where the memory can cut a
  stream short, and is carried into each edge below it where it cannot (memory that keeps
  whole streams: the layout copies only whole prompts there); an option that ends where
  others go on (its end of turn alone below the branch point) is read after that point and
  sends nothing.
The layout decodes an edge from a copy of the one it leaves (`StreamCache._followers`), so
each tree node is decoded once; each token's log-probability is read from exactly one row,
the row a separate forward of that option would read it from (bit for bit on the exact
path: tests/adapter/test_likelihood.py against brute force).

Pure: tokens in, engine prompts and reading recipes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

MIN_EDGE = 2  # rows an edge's prompt decodes at least (the exact path's MIN_ROWS)
AFTER = -1  # a token read after its edge's parent (PromptScore.after_logprobs)


@dataclass
class _Trie:
    children: dict[int, _Trie] = field(default_factory=dict)


@dataclass(frozen=True)
class Edge:
    """One prompt for the engine: the tokens after the root prompt, how many of its last
    tokens it scores, and the tokens whose log-probability is read after it."""

    path: tuple[int, ...]
    scored: int
    after: tuple[int, ...]


# Where one token's log-probability is read: (edge index, AFTER) for the token read after
# that edge, or (edge index, i) for the edge's i-th scored token.
Source = tuple[int, int]


@dataclass(frozen=True)
class OptionTree:
    """The edges (the root first, then each edge before the edges below it) and, per
    option, where each of its tokens' log-probabilities is read."""

    edges: tuple[Edge, ...]
    recipes: tuple[tuple[Source, ...], ...]


def option_tree(options: Sequence[Sequence[int]], *, whole_streams: bool = False) -> OptionTree:
    """The tree of `options` (each its scored tokens, the end of the turn last), for memory
    that can cut a stream short or (`whole_streams`) cannot."""
    root = _Trie()
    for option in options:
        node = root
        for token in option:
            node = node.children.setdefault(token, _Trie())
    edges: list[Edge] = []
    sources: dict[tuple[int, ...], Source] = {}
    _Grower(edges, sources, carry=whole_streams).grow(root, (), ())
    recipes = tuple(
        tuple(sources[tuple(option[: end + 1])] for end in range(len(option))) for option in options
    )
    return OptionTree(tuple(edges), recipes)


@dataclass
class _Grower:
    """Walks the trie depth first, adding each edge before the edges below it."""

    edges: list[Edge]
    sources: dict[tuple[int, ...], Source]
    carry: bool  # one-token edges at branch points: carried below (whole streams) or sent

    def grow(self, node: _Trie, path: tuple[int, ...], edge: tuple[int, ...]) -> None:
        """Add the edge that ends at `node` (`edge`: its tokens, `path` all tokens from
        the root) and, below it, every edge leaving it. A one-token edge also scores its
        token, so that its prompt decodes the row before it again."""
        index = len(self.edges)
        scored = 1 if len(edge) == 1 else max(len(edge) - 1, 0)
        self.edges.append(Edge(path, scored, tuple(sorted(node.children))))
        for offset in range(1, len(edge)):
            self.sources[path[: len(path) - len(edge) + offset + 1]] = (index, offset - 1)
        for token, child in sorted(node.children.items()):
            self.sources[(*path, token)] = (index, AFTER)
            self.follow(child, (*path, token), (token,))

    def follow(self, node: _Trie, path: tuple[int, ...], edge: tuple[int, ...]) -> None:
        """Extend an edge down the tree to where it ends: a branch point or a leaf (an
        option's end of turn, read after the parent when it is that token alone); a
        one-token edge at a branch point is carried into each branch below it where
        whole streams are kept."""
        while len(node.children) == 1:
            ((token, node),) = node.children.items()
            path, edge = (*path, token), (*edge, token)
        if not node.children and len(edge) < MIN_EDGE:
            return  # an end of turn alone: read after the parent, nothing to send
        if self.carry and len(edge) < MIN_EDGE:
            for token, child in sorted(node.children.items()):
                self.follow(child, (*path, token), (*edge, token))
            return
        self.grow(node, path, edge)
