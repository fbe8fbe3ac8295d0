"""Where every token of a scoring pass goes in the KV cache, so results never depend on history.

The cache is one stream per sequence (llama.cpp's `kv_unified = false`): stream s holds
sequence s, its cell i holds position i, and a row attends over its own stream only, so a
pass costs its rows and never the other prompts' cells. Measured on the embedded model and
the f32 test model (docs/adapter.md, "Exact scoring"), a prompt's logits are then
bit-identical whatever the streams held before and whatever else rode in the pass, provided
(a) a sequence decodes at least `MIN_ROWS` rows in every micro-batch it is in (one row per
stream takes the matrix-vector kernels, which round differently), and (b) no micro-batch has
exactly one output row (llama.cpp runs the last layer and the output head over output rows
only; one row takes those kernels too). This module plans passes that keep both true:

- Every stream holds one resident prompt. A new prompt starts from the stream sharing its
  longest prefix, at most all but `MIN_ROWS` tokens of it. It is decoded into another stream
  (an empty one, else the least recently used that no prompt of the pass reads from), after a
  whole-stream copy of that prefix; the prefix it was read from stays resident.
- Prompts of one pass that share more with each other than with any stream (one state asked
  several questions, a prompt and its label continuations) decode that stem once, in a first
  step; it is copied to the others before the second step decodes what each has left.
- A prompt that grows out of another prompt of the pass and scores its own last tokens (an
  option tree's edge, adapter.option_tree) is decoded a step after that prompt, from a
  copy of its stream (cut where the edge must decode a row of it again; whole on memory
  that keeps whole streams): a tree is decoded level by level, each node once.
- A step's rows are cut into the micro-batches llama.cpp's equal split makes of them
  (consecutive stream ids, the same number of rows each), so the plan knows every micro-batch
  and can hold (a) and (b).

Pure bookkeeping: the engine executes the plan with llama.cpp. `price` is the one place
that says what a request costs (rows and streams per pass, whole-stream copies, the tokens
charged against SEMIF_MAX_REQUEST_TOKENS); the scheduler packs passes with it and the
service charges the request budget with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise

import numpy as np

UBATCH_ROWS = 512  # the context's n_ubatch: the engine decodes one micro-batch per call
MIN_ROWS = 2  # rows a sequence decodes per micro-batch on the exact path
STEM_MIN_SHARED = 16  # tokens a stem must save per prompt to be worth a step of its own

# A cross-stream copy moves the whole source stream (every cell, every layer: llama.cpp's
# kv_unified=false), so it costs by the stream's size, not by the tokens it keeps. Charged
# as one row per this many cells: on the embedded model (docs/benchmark-history.md, "What a
# copy costs") a copy of a 4,352-cell stream took about as long as decoding 4 rows.
COPY_CELLS_PER_ROW = 1024

Prompt = tuple[Sequence[int], Sequence[int]]  # tokens and the continuation tokens after them


@dataclass(frozen=True)
class PromptCost:
    """What one prompt of a request adds to a pass: KV rows decoded, streams held, and
    whole-stream copies made (its stem's or prefix's copy, one per continuation), and the
    cells its rows attend to (each row the positions before it): a row deep in a long
    prompt costs more than one near its start (the speed model reads both,
    adapter.core.admission)."""

    rows: int
    sequences: int
    copies: int
    cells: int = 0


@dataclass(frozen=True)
class Work:
    """Rows and attended cells: what a pass, a request or part of one decodes."""

    rows: int = 0
    cells: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.rows + other.rows, self.cells + other.cells)

    def __sub__(self, other: Work) -> Work:
        return Work(self.rows - other.rows, self.cells - other.cells)


def fitting(
    costs: Sequence[PromptCost],
    start: int,
    *,
    rows: int,
    sequences: int,
    pass_rows: int,
    max_sequences: int,
) -> int:
    """The packing rule, the one the scheduler packs passes by and a price counts passes
    by: how far prompts from `start` on fit a pass that already holds `rows` rows and
    `sequences` sequences (the index after the last that fits). A repeat (no sequences of
    its own) rides with the prompt it repeats; the first prompt of an empty pass always
    fits (it must run somewhere, however large)."""
    end = start
    while end < len(costs):
        cost = costs[end]
        fits = cost.sequences == 0 or (
            rows + cost.rows <= pass_rows and sequences + cost.sequences <= max_sequences
        )
        if not fits and (rows or sequences):
            break
        rows += cost.rows
        sequences += cost.sequences
        end += 1
    return end


@dataclass(frozen=True)
class Price:
    """A request's cost, prompt by prompt in request order, and what it is charged."""

    prompts: tuple[PromptCost, ...]
    copy_rows: int  # rows one whole-stream copy is charged as

    def charge(self, start: int = 0, end: int | None = None) -> int:
        """Its prompts' rows from `start` on (to `end`), copies charged as rows: the work it
        queues ahead of later requests, and (from 0) what SEMIF_MAX_REQUEST_TOKENS is
        charged, so a request of many prompts pays for every pass and copy it needs."""
        return sum(cost.rows + cost.copies * self.copy_rows for cost in self.prompts[start:end])

    def work(self, start: int = 0, end: int | None = None) -> Work:
        """The charged rows (as `charge`) and the attended cells of prompts `start:end`."""
        cells = sum(cost.cells for cost in self.prompts[start:end])
        return Work(self.charge(start, end), cells)

    def passes(self, pass_rows: int, max_sequences: int, start: int = 0) -> list[Work]:
        """The work of each pass it needs alone from prompt `start` on, packed by the
        scheduler's rule (`fitting`): the scheduler packs others alongside, never fewer."""
        passes = []
        while start < len(self.prompts):
            end = fitting(
                self.prompts,
                start,
                rows=0,
                sequences=0,
                pass_rows=pass_rows,
                max_sequences=max_sequences,
            )
            passes.append(self.work(start, end))
            start = end
        return passes


def price(
    prompts: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    stream_cells: int,
    scored: Sequence[int] = (),
) -> Price:
    """What scoring these prompts (each with its label continuations) costs the engine.

    A request's prompts about one state are neighbours, and what a prompt shares with the
    one before it is decoded once (a stem): it adds its own tokens plus the `MIN_ROWS` the
    exact path decodes again where prompts diverge, and each continuation decodes again
    what its prompt does not share with the stem it copies, and its own token (or, where
    cheaper, the prompt is decoded whole and its continuations copy all of it). Every
    sequence is one whole-stream copy, charged by the stream's size (`COPY_CELLS_PER_ROW`).
    A prompt repeating the one before
    it (with the same continuations) costs nothing: it always fits the same pass, where the
    engine scores it once. What the planner decodes for the request alone on an empty
    cache stays within a quarter over this, counting a prefix a prompt shares with the one
    before it in another stem (a template shared by two states: decoded once per stem)
    once per stem (tests/adapter/test_layout.py); the cache may save more. A prompt whose
    last `scored[i]` tokens are scored (an option's own words, adapter/likelihood.py)
    decodes at least those rows and the one before them itself: it shares no more; one
    that grows out of an earlier prompt of the request (an option tree's edge, sent after
    the edge it leaves) is charged its own tokens and a copy (`StreamCache._followers`).
    """
    costs = []
    chain: list[int] = []  # earlier prompts, each a prefix of the next (an option tree's path)
    for index, prompt in enumerate(prompts):
        extra = len(continuations[index])
        if index > 0 and _repeats(prompts, continuations, index):
            costs.append(PromptCost(rows=0, sequences=0, copies=0))
            continue
        length = len(prompt)
        own = scored[index] if index < len(scored) else 0
        limit = length - max(MIN_ROWS, own + 1)
        parent = _grown_from(prompts, chain, index)
        if own and parent is not None:  # a branch of an option tree: its own edge, copied
            start = min(len(prompts[parent]), limit)
            costs.append(PromptCost(length - start, 1, 1, _attended(start, length)))
            continue
        before = _shared(prompts, index, index - 1)
        if index < len(scored) and scored[index]:
            before = min(before, max(len(prompt) - scored[index] - 1, 0))
        # With a neighbour, its continuations copy the stem they share (what it shares with
        # the nearest other prompt on either side) and decode the rest and a token; alone
        # with its continuations, it decodes all its tokens and they only their last few.
        earlier = next((i for i in range(index - 1, -1, -1) if prompts[i] != prompt), -1)
        later = next((i for i in range(index + 1, len(prompts)) if prompts[i] != prompt), -1)
        stem = max(_shared(prompts, index, earlier), _shared(prompts, index, later))
        tail = len(prompt) - min(stem or len(prompt), len(prompt) - MIN_ROWS)
        joined = Work(
            length - before + MIN_ROWS + (tail + 1) * extra,
            _attended(before - MIN_ROWS, length) + extra * _attended(length - tail, length + 1),
        )
        alone = Work(
            length + MIN_ROWS + (MIN_ROWS + 1) * extra,
            _attended(0, length) + extra * _attended(length - MIN_ROWS, length + 1),
        )
        work = alone if extra and alone.rows < joined.rows else joined
        costs.append(
            PromptCost(rows=work.rows, sequences=1 + extra, copies=1 + extra, cells=work.cells)
        )
    return Price(tuple(costs), copy_rows=-(-stream_cells // COPY_CELLS_PER_ROW))


def _grown_from(prompts: Sequence[Sequence[int]], chain: list[int], index: int) -> int | None:
    """The longest earlier prompt on `chain` that prompt `index` grows out of (the
    planner's follower rule, StreamCache._followers); `chain` becomes the path to prompt
    `index`. Prompts sent parents first (an option tree, depth first) keep every parent on
    the chain, so the whole walk is linear."""
    prompt = prompts[index]
    while chain and not _extends(prompt, prompts[chain[-1]]):
        chain.pop()
    parent = chain[-1] if chain else None
    chain.append(index)
    return parent


def _extends(prompt: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(prefix) < len(prompt) and common_prefix_length(prompt, prefix) == len(prefix)


def _attended(first: int, end: int) -> int:
    """The cells rows at positions `first..end-1` attend to (a row at position p: p + 1)."""
    first = max(first, 0)
    return (end * (end + 1) - first * (first + 1)) // 2 if end > first else 0


def _shared(prompts: Sequence[Sequence[int]], index: int, other: int) -> int:
    """What prompt `index` shares with prompt `other`, if a pass would decode it once (a
    stem saves at least STEM_MIN_SHARED tokens); 0 otherwise or past either end."""
    if not 0 <= other < len(prompts):
        return 0
    shared = common_prefix_length(prompts[index], prompts[other])
    return shared if shared >= STEM_MIN_SHARED else 0


def _repeats(
    prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], index: int
) -> bool:
    return list(prompts[index]) == list(prompts[index - 1]) and set(continuations[index]) <= set(
        continuations[index - 1]
    )


def distinct_tokens(prompts: Sequence[Sequence[int]]) -> int:
    """Tokens in the prompts' prefix tree (the input a client is told it sent): neighbours
    in sorted order share the most."""
    ordered = sorted(tuple(prompt) for prompt in prompts)
    shared = sum(common_prefix_length(left, right) for left, right in pairwise(ordered))
    return sum(len(prompt) for prompt in ordered) - shared


@dataclass(frozen=True)
class Row:
    token: int
    position: int
    seq: int
    logits: bool


@dataclass(frozen=True)
class Copy:
    """Before a step: stream `target` takes the first `keep` cells of stream `source`
    (`source` None: it is only cut to `keep`, which may be 0)."""

    source: int | None
    target: int
    keep: int


@dataclass(frozen=True)
class Step:
    """Copies and cuts (copies first), then one llama_decode per micro-batch."""

    copies: tuple[Copy, ...]
    micro_batches: tuple[tuple[Row, ...], ...]


@dataclass(frozen=True)
class PromptPlan:
    """How one distinct prompt is scored: its output rows and what was reused."""

    reused: int  # tokens taken from a resident stream
    last_row: int
    continuation_rows: tuple[int, ...]
    new_rows: frozenset[int]  # rows on its path decoded in this pass (its stem's too)
    # The rows whose logits score its last `scored` tokens (the row before each), in order.
    scored_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class PassPlan:
    """Everything the engine does for one pass, in order."""

    steps: tuple[Step, ...]
    prompts: tuple[PromptPlan, ...]
    released: tuple[int, ...]  # streams emptied after the pass (label continuations)
    redecoded: int  # rows decoded only because the exact path stops reuse short
    resident: tuple[tuple[int, np.ndarray], ...]  # (stream, tokens) it holds afterwards
    read: tuple[int, ...]  # streams its prompts took a prefix from (recently used now)

    @property
    def rows(self) -> list[Row]:
        return [row for step in self.steps for batch in step.micro_batches for row in batch]

    @property
    def output_rows(self) -> list[int]:
        """The rows whose logits the prompts read (a spare output row is not one)."""
        rows = {
            row for p in self.prompts for row in (p.last_row, *p.continuation_rows, *p.scored_rows)
        }
        return sorted(rows)


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    return common_prefix(np.asarray(first), np.asarray(second))


def common_prefix(first: np.ndarray, second: np.ndarray) -> int:
    length = min(len(first), len(second))
    if length == 0:
        return 0
    differs = np.flatnonzero(first[:length] != second[:length])
    return int(differs[0]) if len(differs) else length


@dataclass
class _Target:
    """One sequence a pass decodes: a prompt, a prompt with one continuation token, or a
    checkpoint (`prompt` -1): a prefix kept resident for later prompts to take whole."""

    tokens: np.ndarray
    prompt: int
    continuation: bool
    scored: int = 0  # its last tokens whose log-probabilities are read: decoded here
    source: int | None = None  # the stream sharing its longest prefix
    shared: int = 0  # tokens in common with that stream
    reused: int = 0  # of those, taken (at least min_rows of it are left to decode)
    stream: int = -1
    rows: list[int] = field(default_factory=list)  # row ids on its path, stem included
    # The prompt of the same pass it grows out of (`StreamCache._followers`), the tokens it
    # takes of it, and the step after which its stream holds all its tokens.
    parent: _Target | None = None
    keep: int = 0
    step: int = 0


@dataclass
class _Group:
    """Targets decoded together: the leader decodes the stem once (from what it reuses),
    the others copy it; a group of one is a target decoded alone."""

    members: list[_Target]
    leader: _Target
    stem: int
    common: int  # the members' common prefix, before the exact path stops it short


class StreamCache:
    """The streams' contents, free and reserved streams, and their recency."""

    def __init__(self, streams: int, cells: int, *, exact: bool, whole_only: bool = False) -> None:
        if streams < 2 or cells < 1:
            raise ValueError("a stream cache needs two streams and one cell")
        self.streams = streams
        self.cells = cells
        self.min_rows = MIN_ROWS if exact else 1
        # A recurrent layer's state exists only after the last token a stream holds: such a
        # model may take a stream's whole content, never a shorter prefix of it.
        self.whole_only = whole_only
        self.held: list[np.ndarray] = [np.empty(0, np.int64) for _ in range(streams)]
        self.last_used = [0] * streams
        self.reserved: set[int] = set()
        self.passes = 0

    @property
    def capacity(self) -> int:
        """Sequences one pass may decode (the streams not reserved)."""
        return self.streams - len(self.reserved)

    def clear(self) -> None:
        self.held = [np.empty(0, np.int64) for _ in range(self.streams)]

    def reserve(self) -> int:
        """A stream held outside passes (a generation) until `release`; it starts empty."""
        free = self._pool(exclude=set())
        if not free:
            raise OverflowError("no free stream")
        seq = free[0]
        self.reserved.add(seq)
        self.held[seq] = np.empty(0, np.int64)
        return seq

    def release(self, seq: int) -> None:
        self.reserved.discard(seq)
        self.forget(seq)

    def forget(self, seq: int) -> None:
        """The stream holds nothing a later prompt may take."""
        self.held[seq] = np.empty(0, np.int64)

    def longest_match(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The unreserved stream with the longest usable prefix of `tokens`, and its length."""
        array = np.asarray(tokens, dtype=np.int64)
        seq, _, usable = self._best(array, len(array))
        return seq, usable

    def _best(self, tokens: np.ndarray, limit: int) -> tuple[int | None, int, int]:
        """The stream to take a prefix from (at most `limit` tokens): its id, the tokens it
        shares with `tokens` and how many of them can be taken."""
        best: tuple[int | None, int, int] = (None, 0, 0)
        best_key = (0, 0)
        for seq in range(self.streams):
            if seq in self.reserved:
                continue
            shared, usable = self._usable(tokens, seq, limit)
            key = (usable, self.last_used[seq])  # on a tie, the most recently used
            if usable > 0 and key > best_key:
                best, best_key = (seq, shared, usable), key
        return best

    def _usable(self, tokens: np.ndarray, seq: int, limit: int) -> tuple[int, int]:
        """(tokens shared with stream `seq`, tokens that can be taken from it)."""
        held = self.held[seq]
        shared = common_prefix(tokens, held)
        if self.whole_only:
            usable = shared if shared == len(held) <= limit else 0
            return usable, usable
        return shared, min(shared, limit)

    def _pool(self, exclude: set[int]) -> list[int]:
        """Streams a pass may overwrite: empty ones first, then least recently used."""
        free = [s for s in range(self.streams) if s not in self.reserved and s not in exclude]
        return sorted(free, key=lambda s: (len(self.held[s]) > 0, self.last_used[s], s))

    def plan(
        self,
        prompts: Sequence[Prompt],
        boundaries: Sequence[Sequence[int]] = (),
        scored: Sequence[int] = (),
    ) -> PassPlan:
        """Plan one pass over distinct prompts (each with its continuation tokens).

        `boundaries[i]` are positions in prompt i where later prompts are likely to branch
        (after the system turn, after the state). Where the cache can only take whole
        streams, each one no stream holds yet becomes a checkpoint: a stream decoded to
        exactly there and kept, as long as the pass has streams to spare. `scored[i]`
        (default 0) asks for the logits before each of prompt i's last `scored[i]` tokens:
        those rows are decoded in this pass, never taken from a stream or a shared stem
        (a resident prefix keeps no logits)."""
        wanted = [*scored, *[0] * (len(prompts) - len(scored))]
        for (tokens, _), count in zip(prompts, wanted, strict=True):
            if not 0 <= count < len(tokens):
                raise ValueError(f"{count} scored tokens of a {len(tokens)}-token prompt")
        targets = [
            _Target(
                np.asarray([*tokens, *extra], dtype=np.int64),
                index,
                bool(extra),
                0 if extra else wanted[index],
            )
            for index, (tokens, conts) in enumerate(prompts)
            for extra in ([], *([token] for token in conts))
        ]
        if len(targets) > self.capacity:
            raise OverflowError(
                f"the pass needs {len(targets)} sequences; {self.capacity} streams are free"
            )
        longest = max(len(target.tokens) for target in targets)
        if longest > self.cells:
            raise OverflowError(f"a sequence needs {longest} cells; a stream has {self.cells}")
        if self.whole_only:
            targets += self._checkpoints(prompts, boundaries, self.capacity - len(targets))
        for target in targets:
            limit = self._cap(target)
            target.source, target.shared, target.reused = self._best(target.tokens, limit)
        followers = self._followers(targets)
        groups = self._groups([target for target in targets if target.parent is None])
        self._assign(targets, [group.leader for group in groups])
        copies: list[list[Copy]] = [[], []]
        tracks: list[dict[int, list[Row]]] = [{}, {}]
        for group in groups:
            leader = group.leader
            copies[0].append(self._take_prefix(leader))
            if len(group.members) == 1:
                tracks[0][leader.stream] = self._rows(leader, leader.reused, len(leader.tokens))
                continue
            tracks[0][leader.stream] = self._rows(leader, leader.reused, group.stem)
            for target in group.members:
                target.reused = leader.reused
                target.step = 1
                source = None if target is leader else leader.stream
                copies[1].append(Copy(source, target.stream, group.stem))
                tracks[1][target.stream] = self._rows(target, group.stem, len(target.tokens))
        for target in followers:  # parents first: each a step after its parent is whole
            parent = target.parent
            assert parent is not None
            # What it takes from its parent counts as taken, not decoded for it: every row of
            # the pass is then some prompt's own, and reused and decoded tokens add up to the
            # input.
            target.step, target.reused = parent.step + 1, target.keep
            if target.step == len(tracks):
                copies.append([])
                tracks.append({})
            copies[target.step].append(Copy(parent.stream, target.stream, target.keep))
            tracks[target.step][target.stream] = self._rows(target, target.keep, len(target.tokens))
        steps = [
            Step(_copies_first(step_copies), self._micro_batches(rows))
            for step_copies, rows in zip(copies, tracks, strict=True)
            if rows
        ]
        return self._finish(targets, groups, followers, steps, len(prompts))

    def _followers(self, targets: list[_Target]) -> list[_Target]:
        """Branches of an option tree (adapter.option_tree) that grow out of another prompt
        of the pass: a target whose last tokens are scored takes the most it can of a
        prompt of the pass that is a prefix of it (all of it, or short of the rows it must
        decode itself: `_cap`; on memory that keeps whole streams, only all of it), when
        that is more than a stream gives it. It is decoded a step after that prompt, from a
        copy of that prompt's stream cut there (`keep`), so a shared branch is decoded once
        however many branches grow out of it, and every stream still decodes at least
        `min_rows` rows per micro-batch. Returned parents first."""
        prompts = [t for t in targets if t.prompt >= 0 and not t.continuation]
        for target in prompts:
            if not target.scored:
                continue
            limit = self._cap(target)
            for other in prompts:
                if len(other.tokens) >= len(target.tokens):
                    continue
                if common_prefix(other.tokens, target.tokens) < len(other.tokens):
                    continue  # not a prefix of it: a sibling (stems share those: `_groups`)
                keep = min(len(other.tokens), limit)
                if self.whole_only and keep < len(other.tokens):
                    continue
                if keep > max(target.reused, target.keep):
                    target.parent, target.keep = other, keep
        return sorted((t for t in prompts if t.parent is not None), key=lambda t: len(t.tokens))

    def _checkpoints(
        self, prompts: Sequence[Prompt], boundaries: Sequence[Sequence[int]], room: int
    ) -> list[_Target]:
        """A checkpoint per boundary that no stream holds exactly, at most `room` of them,
        the deepest of each prompt first (a state before the system turn: the system turn
        is one prefix for every state, so it pays once; each state pays again until kept).
        A boundary too short to save a stem, or within a prompt's last rows, is skipped."""
        held = {
            tuple(tokens.tolist())
            for seq, tokens in enumerate(self.held)
            if len(tokens) and seq not in self.reserved
        }
        found: list[_Target] = []
        for (tokens, _), cuts in zip(prompts, boundaries, strict=False):
            for cut in sorted(set(cuts), reverse=True):
                prefix = tuple(tokens[:cut])
                if not STEM_MIN_SHARED <= cut <= len(tokens) - self.min_rows or prefix in held:
                    continue
                if len(found) >= room:
                    return found
                held.add(prefix)
                found.append(_Target(np.asarray(prefix, dtype=np.int64), -1, False))
        return found

    def _cap(self, target: _Target) -> int:
        """The most tokens a sequence may take from elsewhere: the rest is at least
        `min_rows` rows (a one-token sequence decodes its one row), and holds every row
        whose logits score its tokens."""
        return max(len(target.tokens) - max(self.min_rows, target.scored + 1), 0)

    def _groups(self, targets: list[_Target]) -> list[_Group]:
        """Targets in token order, cut into the runs that decode the fewest rows in all: a
        run shares one stem (its common prefix, short of every member's last `min_rows`
        tokens), decoded once, and must save `STEM_MIN_SHARED` tokens over what each member
        takes from a stream to be worth a step of its own. A group has one stem, so the cut
        matters: questions about two states that share only the template, grouped
        together, would decode each state once per question. Exhaustive over the cuts
        (a pass holds at most a few dozen sequences)."""
        order = sorted(targets, key=lambda target: target.tokens.tolist())
        adjacent = [common_prefix(a.tokens, b.tokens) for a, b in pairwise(order)]
        best = [0] + [-1] * len(order)  # rows of the best cut of order[:j]
        start = [0] * (len(order) + 1)  # where its last run starts
        for end in range(1, len(order) + 1):
            common = len(order[end - 1].tokens)
            for begin in range(end - 1, -1, -1):
                members = order[begin:end]
                if begin < end - 1:
                    common = min(common, adjacent[begin])
                    saved = self._stem(members, common) - max(m.reused for m in members)
                    if saved < STEM_MIN_SHARED:
                        break  # a longer run shares no more
                rows = best[begin] + self._rows_of(members, common)
                if best[end] < 0 or rows < best[end]:
                    best[end], start[end] = rows, begin
        groups: list[_Group] = []
        end = len(order)
        while end > 0:
            begin = start[end]
            members = order[begin:end]
            common = min([len(members[0].tokens), *adjacent[begin : end - 1]])
            groups.append(self._group(members, common))
            end = begin
        return groups[::-1]

    def _rows_of(self, members: list[_Target], common: int) -> int:
        """Rows a group decodes: its stem once (after what its leader reuses), then every
        member's tail."""
        if len(members) == 1:
            return len(members[0].tokens) - members[0].reused
        stem = self._stem(members, common)
        reused = max(member.reused for member in members)
        return max(stem - reused, 0) + sum(len(member.tokens) - stem for member in members)

    def _stem(self, members: list[_Target], common: int) -> int:
        return min(common, *(self._cap(member) for member in members))

    def _group(self, members: list[_Target], common: int) -> _Group:
        leader = max(members, key=lambda target: target.reused)
        if len(members) == 1:
            return _Group(members, leader, stem=0, common=0)
        return _Group(members, leader, stem=self._stem(members, common), common=common)

    def _assign(self, targets: list[_Target], readers: list[_Target]) -> None:
        """A stream per target: from the pool (empty, then least recently used), keeping
        every stream a reader (a group's leader, or a target alone) takes a prefix from;
        when the pool runs short, the least recently used of those streams is overwritten
        by one of its own readers."""
        sources = {t.source for t in readers if t.source is not None and t.reused > 0}
        pool = self._pool(exclude=sources)
        short = len(targets) - len(pool)
        for source in sorted(sources, key=lambda s: self.last_used[s])[: max(short, 0)]:
            reader = max((t for t in readers if t.source == source), key=lambda t: t.reused)
            reader.stream = source
        free = iter(pool)
        for target in targets:
            if target.stream < 0:
                target.stream = next(free)

    def _take_prefix(self, target: _Target) -> Copy:
        """The first step's copy that gives the target's stream its reused prefix; a stream
        that already holds as long a prefix of it is only cut."""
        _, own = self._usable(target.tokens, target.stream, self._cap(target))
        if own >= target.reused or target.source is None:
            target.reused = own
            return Copy(None, target.stream, own)
        return Copy(target.source, target.stream, target.reused)

    @staticmethod
    def _rows(target: _Target, start: int, stop: int) -> list[Row]:
        """Rows of its positions start..stop-1; the last row and the rows scoring its last
        `scored` tokens output logits."""
        first_output = len(target.tokens) - 1 - target.scored
        return [
            Row(int(target.tokens[position]), position, target.stream, position >= first_output)
            for position in range(start, stop)
        ]

    def _micro_batches(self, tracks: dict[int, list[Row]]) -> tuple[tuple[Row, ...], ...]:
        """Cut rows into the micro-batches llama.cpp's sequential equal split makes: a run of
        consecutive stream ids, the same number of rows from each, at most UBATCH_ROWS in
        all; a stream that would be left fewer than `min_rows` rows waits for a later one. A
        stream with fewer rows than that in all (a one-token prompt: the one case the exact
        path cannot make exact) decodes alone, so it never cuts its neighbours short."""
        left = {seq: list(rows) for seq, rows in tracks.items() if rows}
        batches: list[tuple[Row, ...]] = []
        while left:
            seqs = sorted(left)
            if len(left[seqs[0]]) < self.min_rows:
                run = seqs[:1]
            else:
                run = _consecutive([seq for seq in seqs if len(left[seq]) >= self.min_rows])
            while True:
                cap = UBATCH_ROWS // len(run)
                take = min(cap, *(len(left[seq]) for seq in run))
                fine = [seq for seq in run if not 0 < len(left[seq]) - take < self.min_rows]
                if not fine:  # every stream would keep one row: keep min_rows instead
                    take = cap - self.min_rows
                    break
                if fine == run:
                    break
                run = _consecutive(fine)
            rows = [row for seq in run for row in left[seq][:take]]
            for seq in run:
                left[seq] = left[seq][take:]
                if not left[seq]:
                    del left[seq]
            batches.append(self._pair_outputs(rows))
        return tuple(batches)

    def _pair_outputs(self, rows: list[Row]) -> tuple[Row, ...]:
        """A micro-batch with one output row gets a second: an existing row whose logits
        are never read, so that the output head runs the same kernel as beside a mate."""
        if self.min_rows > 1 and sum(row.logits for row in rows) == 1 and len(rows) > 1:
            spare = next(index for index, row in enumerate(rows) if not row.logits)
            rows[spare] = replace(rows[spare], logits=True)
        return tuple(rows)

    def _finish(
        self,
        targets: list[_Target],
        groups: list[_Group],
        followers: list[_Target],
        steps: list[Step],
        count: int,
    ) -> PassPlan:
        numbered: dict[tuple[int, int], int] = {}  # (stream, position) -> row id
        rows = (row for step in steps for batch in step.micro_batches for row in batch)
        for row_id, row in enumerate(rows):
            numbered[(row.seq, row.position)] = row_id
        redecoded = 0
        for group in groups:
            for target in group.members:
                stem = group.stem if len(group.members) > 1 else target.reused
                target.rows = [
                    numbered[(group.leader.stream, position)]
                    for position in range(target.reused, stem)
                ] + [numbered[(target.stream, p)] for p in range(stem, len(target.tokens))]
                # where it would have started without the exact path's MIN_ROWS
                end = len(target.tokens) - 1 - target.scored
                loose = min(end, max(target.shared, group.common))
                redecoded += max(loose - stem, 0)
        for target in followers:  # its parent's path to where it took it, then its own rows
            parent = target.parent
            assert parent is not None
            taken = parent.rows[: len(parent.rows) - (len(parent.tokens) - target.keep)]
            own = [numbered[(target.stream, p)] for p in range(target.keep, len(target.tokens))]
            target.rows = taken + own
        prompts = []
        for index in range(count):
            mine = [target for target in targets if target.prompt == index]
            main = next(target for target in mine if not target.continuation)
            prompts.append(
                PromptPlan(
                    reused=main.reused,
                    last_row=main.rows[-1],
                    continuation_rows=tuple(t.rows[-1] for t in mine if t.continuation),
                    new_rows=frozenset(row for target in mine for row in target.rows),
                    scored_rows=tuple(main.rows[len(main.rows) - 1 - main.scored : -1]),
                )
            )
        return PassPlan(
            steps=tuple(steps),
            prompts=tuple(prompts),
            released=tuple(sorted(t.stream for t in targets if t.continuation)),
            redecoded=redecoded,
            resident=tuple((t.stream, t.tokens) for t in targets if not t.continuation),
            read=tuple(sorted({g.leader.source for g in groups if g.leader.source is not None})),
        )

    def commit(self, plan: PassPlan) -> None:
        """Record a pass that ran: its prompts are resident, its continuations freed."""
        self.passes += 1
        for seq in plan.read:
            self.last_used[seq] = self.passes
        for seq in plan.released:
            self.held[seq] = np.empty(0, np.int64)
        for seq, tokens in plan.resident:
            self.held[seq] = tokens
            self.last_used[seq] = self.passes


def _copies_first(copies: list[Copy]) -> tuple[Copy, ...]:
    """Copies before cuts: a stream one prompt overwrites may be another's source, and a
    copy takes its source's cells as they are when it is made."""
    return tuple(sorted(copies, key=lambda copy: copy.source is None))


def _consecutive(seqs: list[int]) -> list[int]:
    """The run of consecutive ids that starts the (sorted) list."""
    run = [seqs[0]]
    for seq in seqs[1:]:
        if seq != run[-1] + 1:
            break
        run.append(seq)
    return run
