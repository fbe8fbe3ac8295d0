"""Where every token of a scoring pass goes in the KV cache, so results never depend on history.

Measured on the embedded model (docs/adapter.md, "Exact scoring"): the same prompt's letter
logits move by up to 0.9 when its cells sit at another offset in the cache, because the
CPU kernels that sum attention over cells accumulate by cell index modulo the SIMD width,
and the quantized model amplifies that rounding. They are bit-identical when (a) each of a
sequence's tokens sits in a cell congruent to its position modulo `alignment` and (b) a
sequence's cells are in position order. This module plans passes that keep both true:

- The cache is an append-only arena: occupied cells are exactly [0, top) and llama.cpp
  places the next batch's tokens at top, top+1, ... in batch order (its slot search starts
  at the head, which removals only ever move back to `top`).
- Resident prefixes (`Entry`, one sequence each) are never freed in the middle: an evicted
  entry's cells are relabelled to the JUNK sequence and stay occupied, and the arena is
  wiped when a pass no longer fits above `top`, or when re-decoding what it would reuse
  costs less than attending over the arena (`PrefixCache._cost`).
- A pass decodes the prompts' new tokens as a trie (shared tokens once, carrying every
  sequence below them), each segment preceded by pad tokens that bring the next cell to
  the segment's first position modulo `alignment`. Segments that become resident come
  first; rows thrown away after the pass (re-scored last tokens, label continuations) and
  their pads come last, so removing them leaves [0, top) intact.

Pure bookkeeping: the engine executes the plan with llama.cpp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

JUNK_SEQUENCE = 0  # cells of evicted entries and of pads below resident segments
PAD_SEQUENCE = 1  # every pad of a pass, at positions 0, 1, ... (llama.cpp wants them consecutive)
FIRST_FREE_SEQUENCE = 2
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
UBATCH_ROWS = 512  # the context's n_ubatch: llama.cpp splits a batch into runs of this many
KV_PAD_CELLS = 256  # llama.cpp attends over the used cells rounded up to this


@dataclass
class Entry:
    """A resident prefix: sequence `seq` holds `tokens` at positions 0..len-1."""

    seq: int
    tokens: np.ndarray
    last_used: int


@dataclass(frozen=True)
class Row:
    token: int
    position: int
    sequences: tuple[int, ...]
    logits: bool


@dataclass(frozen=True)
class PromptPlan:
    """How one distinct prompt is scored: its output rows and what was reused."""

    reused: int  # tokens taken from a resident entry
    last_row: int
    continuation_rows: tuple[int, ...]
    new_rows: frozenset[int]  # rows on its path decoded in this pass (pads excluded)


@dataclass(frozen=True)
class PassPlan:
    """Everything the engine does for one pass, in order."""

    wipe: bool  # clear the whole cache first
    junk: tuple[int, ...]  # entries to evict (relabel to JUNK) before the copies
    copies: tuple[tuple[int, int, int], ...]  # (source seq, target seq, length) seq_cp
    rows: tuple[Row, ...]
    prompts: tuple[PromptPlan, ...]
    temporary: tuple[int, ...]  # sequences to remove after the decode (PAD included)
    new_entries: tuple[tuple[int, int], ...]  # (seq, prompt index) resident afterwards
    bases: tuple[int, ...]  # resident entries this pass reused (most recently used now)
    kept_top: int  # `top` once the temporary rows are removed
    kept_pads: int  # PAD positions [0, kept_pads) lie below `kept_top`: relabelled to JUNK

    @property
    def output_rows(self) -> list[int]:
        """The rows whose logits the prompts read (a spare output row is not one)."""
        rows = {row for p in self.prompts for row in (p.last_row, *p.continuation_rows)}
        return sorted(rows)

    @property
    def pad_rows(self) -> int:
        return sum(1 for row in self.rows if row.sequences[0] == PAD_SEQUENCE)


@dataclass
class _Prompt:
    tokens: np.ndarray
    continuations: tuple[int, ...]
    base: Entry | None
    reused: int
    seq: int = -1
    continuation_seqs: tuple[int, ...] = ()
    resident_already: bool = False
    last_row: int = -1
    continuation_rows: tuple[int, ...] = ()
    new_rows: set[int] = field(default_factory=set)

    @property
    def sequences(self) -> tuple[int, ...]:
        return (self.seq, *self.continuation_seqs)


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    return common_prefix(np.asarray(first), np.asarray(second))


def longest_entry(tokens: np.ndarray, entries: dict[int, Entry]) -> tuple[Entry | None, int]:
    """The entry sharing the longest prefix with `tokens` (on a tie, one holding exactly
    `tokens`, then the lowest sequence id), and that length."""
    best: Entry | None = None
    best_key = (0, False)
    for seq in sorted(entries):
        entry = entries[seq]
        length = common_prefix(tokens, entry.tokens)
        key = (length, length == len(tokens) == len(entry.tokens))
        if length > 0 and key > best_key:
            best, best_key = entry, key
    return best, best_key[0]


def common_prefix(first: np.ndarray, second: np.ndarray) -> int:
    length = min(len(first), len(second))
    if length == 0:
        return 0
    differs = np.flatnonzero(first[:length] != second[:length])
    return int(differs[0]) if len(differs) else length


class PrefixCache:
    """The arena's state: resident entries, free sequence ids and the occupied top."""

    def __init__(
        self,
        cells: int,
        *,
        alignment: int,
        max_entries: int,
        break_even_cells: float | None = None,
    ) -> None:
        if alignment < 1 or cells < 1:
            raise ValueError("cells and alignment must be positive")
        if break_even_cells is not None and break_even_cells <= 0:
            raise ValueError("break_even_cells must be positive")
        self.cells = cells
        # Every row attends over all cells up to the arena's top (without flash attention a
        # masked cell costs as much as a used one): a row costs its weights times
        # (1 + cells attended / break_even_cells). A pass wipes the arena when that makes it
        # cheaper, re-decoding what it would have reused; None wipes only when full.
        self.break_even_cells = break_even_cells
        self.alignment = alignment
        self.max_entries = max_entries
        self.entries: dict[int, Entry] = {}
        self.top = 0
        self.passes = 0
        self._free = list(range(MAX_SEQUENCES - 1, FIRST_FREE_SEQUENCE - 1, -1))

    def clear(self) -> None:
        for seq in self.entries:
            self._free.append(seq)
        self.entries.clear()
        self.top = 0

    def plan(
        self, prompts: Sequence[tuple[Sequence[int], Sequence[int]]], *, held_tokens: int = 0
    ) -> PassPlan:
        """Plan one pass over distinct prompts (each with its continuation tokens).
        `held_tokens` are cached outside passes (a running chat's context): a wipe makes
        their owner decode them again, so they count in the wipe's price."""
        self.passes += 1
        plan = self._plan(prompts, wipe=False)
        if plan is None or (self.top > 0 and self.break_even_cells is not None):
            fresh = self._plan(prompts, wipe=True)
            if plan is None or (
                fresh is not None and self._cost(fresh, held_tokens) < self._cost(plan)
            ):
                plan = fresh
        if plan is None:
            raise OverflowError(
                f"the pass needs more than the cache's {self.cells} cells even when empty"
            )
        return plan

    def _cost(self, plan: PassPlan, redecoded: int = 0) -> float:
        """The pass's decode cost in rows' worth of weights, attention over the arena
        included (llama.cpp attends over its used cells rounded up to KV_PAD_CELLS), plus
        `redecoded` tokens that others must decode again after it."""
        assert self.break_even_cells is not None
        rows = len(plan.rows) + redecoded
        end = (0 if plan.wipe else self.top) + rows
        attended = KV_PAD_CELLS * -(-end // KV_PAD_CELLS)
        return rows * (1 + attended / self.break_even_cells)

    def reserve(self) -> int:
        """A sequence id held outside passes (a generation) until `release`."""
        if not self._free:
            raise OverflowError("no free sequence id")
        return self._free.pop()

    def release(self, seq: int) -> None:
        self._free.append(seq)

    def longest_match(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """The resident entry sharing the longest prefix with `tokens`, and its length."""
        entry, length = longest_entry(np.asarray(tokens, dtype=np.int64), self.entries)
        return (None if entry is None else entry.seq), length

    def commit(
        self, plan: PassPlan, prompts: Sequence[tuple[Sequence[int], Sequence[int]]]
    ) -> None:
        """Record a pass that ran: new entries become resident, temporaries are free."""
        if plan.wipe:
            self.clear()
        for seq in plan.junk:
            self.entries.pop(seq)
            self._free.append(seq)
        for seq, index in plan.new_entries:
            self._take(seq)
            self.entries[seq] = Entry(seq, np.asarray(prompts[index][0]), self.passes)
        for seq in plan.bases:
            if seq in self.entries:
                self.entries[seq].last_used = self.passes
        self.top = plan.kept_top

    def _take(self, seq: int) -> None:
        if seq in self._free:
            self._free.remove(seq)

    def _plan(
        self, raw: Sequence[tuple[Sequence[int], Sequence[int]]], *, wipe: bool
    ) -> PassPlan | None:
        entries = {} if wipe else dict(self.entries)
        prompts = [self._match(tokens, conts, entries, self.alignment) for tokens, conts in raw]
        bases = {p.base.seq for p in prompts if p.base is not None}
        free = list(self._free) + ([] if not wipe else list(self.entries))
        free.sort(reverse=True)
        new_count = sum(1 for p in prompts if not p.resident_already)
        needed = sum(1 + len(p.continuations) for p in prompts)
        junk: list[int] = []
        # Evict least recently used entries (never a base of this pass) for sequence ids
        # and to stay within max_entries once this pass's prompts are resident.
        victims = sorted(
            (entry for seq, entry in entries.items() if seq not in bases),
            key=lambda entry: entry.last_used,
        )
        while victims and (
            len(free) < needed or len(entries) - len(junk) + new_count > self.max_entries
        ):
            victim = victims.pop(0)
            junk.append(victim.seq)
            free.append(victim.seq)
        if len(free) < needed:
            return None
        allocate = iter(sorted(free))
        for prompt in prompts:
            prompt.seq = next(allocate)
            prompt.continuation_seqs = tuple(next(allocate) for _ in prompt.continuations)
        top = 0 if wipe else self.top
        builder = _RowBuilder(top, self.alignment)
        kept = [p for p in prompts if not p.resident_already]
        builder.trie(kept)
        kept_top, kept_pads = builder.cursor, builder.pads
        for prompt in prompts:
            if prompt.resident_already:
                builder.scratch_last(prompt)
            if prompt.continuations:
                builder.continuations(prompt)
        if len(builder.rows) % UBATCH_ROWS == 1:
            builder.pad_row()  # a one-row ubatch runs another kernel (GEMV): other logits
        builder.pair_outputs()
        if builder.cursor > self.cells:
            return None
        copies = tuple(
            (prompt.base.seq, seq, prompt.reused)
            for prompt in prompts
            if prompt.base is not None and prompt.reused > 0
            for seq in prompt.sequences
        )
        temporary = [PAD_SEQUENCE]
        for prompt in prompts:
            temporary.extend(prompt.continuation_seqs)
            if prompt.resident_already:
                temporary.append(prompt.seq)
        return PassPlan(
            wipe=wipe,
            junk=tuple(junk),
            copies=copies,
            rows=tuple(builder.rows),
            prompts=tuple(
                PromptPlan(
                    reused=p.reused,
                    last_row=p.last_row,
                    continuation_rows=p.continuation_rows,
                    new_rows=frozenset(p.new_rows),
                )
                for p in prompts
            ),
            temporary=tuple(temporary),
            new_entries=tuple(
                (p.seq, index) for index, p in enumerate(prompts) if not p.resident_already
            ),
            bases=tuple(sorted(bases)),
            kept_top=kept_top,
            kept_pads=kept_pads,
        )

    @staticmethod
    def _match(
        tokens: Sequence[int], conts: Sequence[int], entries: dict[int, Entry], alignment: int
    ) -> _Prompt:
        """The resident entry sharing the longest prefix (at most all but the last token:
        the last token is decoded to produce logits)."""
        array = np.asarray(tokens, dtype=np.int64)
        best, best_length = longest_entry(array, entries)
        resident = best is not None and best_length == len(array) == len(best.tokens)
        usable = min(best_length, len(array) - 1)
        return _Prompt(
            tokens=array,
            continuations=tuple(conts),
            base=best,
            reused=usable - usable % alignment,  # reuse whole blocks only
            resident_already=resident,
        )


class _RowBuilder:
    """Appends rows from cell `top` on, padding each segment to its alignment."""

    def __init__(self, top: int, alignment: int) -> None:
        self.cursor = top
        self.alignment = alignment
        self.rows: list[Row] = []
        self.pads = 0

    def _pad_to(self, position: int) -> None:
        for _ in range((position - self.cursor) % self.alignment):
            self.pad_row()

    def pad_row(self) -> None:
        self._append(Row(0, self.pads, (PAD_SEQUENCE,), False))
        self.pads += 1

    def _append(self, row: Row) -> int:
        self.rows.append(row)
        self.cursor += 1
        return len(self.rows) - 1

    def trie(self, prompts: list[_Prompt]) -> None:
        """Decode the prompts' new tokens, each shared token once: groups of prompts that
        reuse the same base to the same length share their common new tokens."""
        groups: dict[tuple[int, int], list[_Prompt]] = {}
        for prompt in prompts:
            key = (prompt.base.seq if prompt.base is not None else -1, prompt.reused)
            groups.setdefault(key, []).append(prompt)
        for key in sorted(groups):
            self._segment(groups[key], key[1])

    def _segment(self, group: list[_Prompt], start: int) -> None:
        """Decode the group's tokens from `start` (a block boundary). A lone prompt runs to
        its end; several share tokens only up to the last block boundary before they
        diverge, then each child group goes on from there (re-decoding the few shared
        tokens past it), so no prompt's block is ever split across two segments."""
        if len(group) == 1:
            self._emit(group, start, len(group[0].tokens))
            return
        first = group[0].tokens
        end = min(len(prompt.tokens) for prompt in group)
        for prompt in group[1:]:
            end = min(end, common_prefix(first[:end], prompt.tokens[:end]))
        shared_end = max(start, end - end % self.alignment)
        if shared_end > start:
            self._emit(group, start, shared_end)
        children: dict[int, list[_Prompt]] = {}
        for prompt in group:
            token = int(prompt.tokens[end]) if len(prompt.tokens) > end else -1
            children.setdefault(token, []).append(prompt)
        for token in sorted(children):
            self._segment(children[token], shared_end)

    def _emit(self, group: list[_Prompt], start: int, stop: int) -> None:
        """Rows for positions [start, stop) shared by the group, after pads that put
        `start` on a cell congruent to it."""
        self._pad_to(start)
        sequences = tuple(sorted(seq for prompt in group for seq in prompt.sequences))
        tokens = group[0].tokens
        for position in range(start, stop):
            ending = [p for p in group if len(p.tokens) == position + 1]
            row = self._append(Row(int(tokens[position]), position, sequences, bool(ending)))
            for prompt in group:
                prompt.new_rows.add(row)
            for prompt in ending:
                prompt.last_row = row

    def pair_outputs(self) -> None:
        """Give every micro-batch with exactly one output row a second one. llama.cpp runs
        the last layer and the output head over a micro-batch's output rows only, and one
        row takes the matrix-vector kernel instead of the tiled one (f32 and f16 weights):
        other rounding than the same prompt gets beside a batch mate. The extra output
        is an existing row of the micro-batch, so the layout does not move; its logits are
        never read."""
        for start in range(0, len(self.rows), UBATCH_ROWS):
            chunk = range(start, min(start + UBATCH_ROWS, len(self.rows)))
            if sum(self.rows[index].logits for index in chunk) == 1:
                spare = next(index for index in chunk if not self.rows[index].logits)
                self.rows[spare] = replace(self.rows[spare], logits=True)

    def scratch_last(self, prompt: _Prompt) -> None:
        """A prompt already resident in full: decode its last block again, to throw away
        (the logits of its last token come out exactly as when it was first scored)."""
        self._emit([prompt], prompt.reused, len(prompt.tokens))

    def continuations(self, prompt: _Prompt) -> None:
        """Each label continuation token after the prompt, in its own sequence; together
        one segment aligned to the position after the prompt."""
        position = len(prompt.tokens)
        self._pad_to(position)
        rows = []
        for token, seq in zip(prompt.continuations, prompt.continuation_seqs, strict=True):
            rows.append(self._append(Row(int(token), position, (seq,), logits=True)))
        prompt.continuation_rows = tuple(rows)
