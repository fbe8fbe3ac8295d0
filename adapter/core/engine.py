"""The llama.cpp context and its KV cache: passes that score prompts by last-position logits.

The KV cache is one stream per sequence (adapter/core/layout.py plans where every token
goes). Two kinds of reuse make scoring cheap:
- across calls, every stream keeps the last prompt decoded into it, and a new prompt starts
  from the stream sharing its longest prefix (a copy of that prefix into its own stream);
- within one call, what several prompts share beyond that (a state asked several questions)
  is decoded once and copied to each before their own tokens are decoded together.
A prompt may also ask for the logits after some continuation tokens (a two-token answer
label needs P(second | first)): each continuation is one more sequence, the prompt with that
token appended, decoded in the same pass. Or for the log-probabilities of its own last
tokens (an option's words after a shared prompt): those rows are decoded in the pass.
Scoring generates nothing; `start_generation` (chat, adapter/core/generation.py) samples
tokens into a stream of its own.

Threads: the context, the KV cache and its plan (`score`, `reset`, the stream operations a
generation uses) belong to the scheduler's worker alone; start-up probes call `score`
before the worker exists, and `close` runs on the shutdown thread once the worker has
ended. `vocab` (adapter/core/vocab.py) is the one part request
threads use. Weights are read into memory at load (no mmap), so the file can change on disk
without changing what is served. A `cancel` event (set at shutdown) aborts a load, and
stops scoring and generation at the next decode boundary.

It knows tokens, logits and the KV cache, nothing about decisions: prompts, labels and
readout live in the modules that use it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp
import llama_cpp._logger
import numpy as np
import numpy.typing as npt

from adapter.core.failures import (
    CancelledWorkError,
    CapacityError,
    ModelLoadError,
    NativeFailureError,
    RefusedCutError,
)
from adapter.core.generation import GenerationRun, Sampling
from adapter.core.layout import UBATCH_ROWS, Copy, PassPlan, Row, StreamCache
from adapter.core.native import (
    load_weights,
    measure_stream_cost,
    pin_matmul_kernels,
    require_kv_stream_binding,
)
from adapter.core.vocab import Vocabulary
from adapter.kv_memory import KvBudget, plan_cache
from adapter.weight_buffers import CpuBackend, WeightBuffers

LOG = logging.getLogger("adapter")
# KV streams (as many as the memory budget holds, adapter.kv_memory) each hold one sequence
# of up to `stream_cells` tokens. A pass decodes at most all but one of them (one is kept
# for a generation).
KV_PAD_CELLS = 256  # llama.cpp rounds a stream's size up to this
# Rows one pass takes: enough to share a template and a state across many prompts, few
# enough that a request waiting behind a pass is not kept long.
PASS_ROWS = 1024


@dataclass(frozen=True)
class PromptScore:
    """Last-position logits of one prompt and how its tokens were obtained.

    `next_logits` maps each requested continuation token to the logits that follow it. A
    prompt whose last tokens are scored gets `token_logprobs` instead, and empty `logits`:
    keeping a vocabulary-sized vector per option branch would hold hundreds of MB for a
    question of a thousand options.
    """

    logits: npt.NDArray[np.float32]
    input_tokens: int
    next_logits: dict[int, npt.NDArray[np.float32]] = field(default_factory=dict)
    reused_tokens: int = 0  # taken from a resident prefix
    rows: frozenset[int] = frozenset()  # rows of the pass on its path (shared ones too)
    # log P(token | the tokens before it) for its last `scored` tokens, in order, and the
    # most likely token where the first of them stands (where its `after` tokens stand
    # when it scores none).
    token_logprobs: tuple[float, ...] = ()
    scored_top_token: int | None = None
    # log P(token | the whole prompt) for each token asked `after` it (an option tree's
    # branches: the first token of each branch leaving this prompt).
    after_logprobs: dict[int, float] = field(default_factory=dict)

    @classmethod
    def held(cls, tokens: int) -> PromptScore:
        """A prompt a stream already held whole, so not decoded (nothing reads its logits)."""
        return cls(_NO_LOGITS, tokens, reused_tokens=tokens)


@dataclass(frozen=True)
class BatchTiming:
    """What one pass cost: tokens reused from resident streams, rows decoded (shared tokens
    once), of those the rows decoded again only because the exact path stops reuse short
    (`pad_tokens`), and the time."""

    input_tokens: int
    reused_tokens: int
    evaluated_tokens: int
    pad_tokens: int
    seconds: float


_NO_LOGITS = np.empty(0, np.float32)  # a scored prompt's `logits` (see PromptScore)
_Read = tuple[tuple[float, ...], int]  # a row's tokens' log-probabilities, its top token


def _token_logprobs(
    logits: npt.NDArray[np.float32], tokens: Sequence[int]
) -> tuple[tuple[float, ...], int]:
    """log P(token) of each of `tokens` under a row's logits (full-vocabulary log-softmax in
    float64, once per row; NaN stays NaN, for the readout to refuse) and the row's most
    likely token."""
    wide = logits.astype(np.float64)
    top = wide.max()
    norm = top + np.log(np.exp(wide - top).sum())
    return tuple(float(wide[token] - norm) for token in tokens), int(wide.argmax())


class LlamaEngine:
    """Owns the native model and context; frees both on close()."""

    def __init__(
        self,
        gguf: Path,
        *,
        stream_cells: int,
        max_branches: int,
        threads: int | None,
        n_gpu_layers: int,
        weight_buffers: WeightBuffers,
        cpu: CpuBackend,
        prefix_reuse: bool = True,
        exact: bool = True,
        kv_budget: KvBudget | None = None,
        container_bytes: int | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """`kv_budget` (SEMIF_KV_MEMORY; fractions are of `container_bytes`, by default the
        memory this process sees) sizes the cache; without one it holds MAX_STREAMS streams,
        whatever they take."""
        require_kv_stream_binding()
        if stream_cells < 1:
            raise ModelLoadError(f"a KV stream needs at least one cell, not {stream_cells}")
        stream_cells = KV_PAD_CELLS * -(-stream_cells // KV_PAD_CELLS)
        llama_cpp._logger.set_verbose(False)  # native INFO chatter off; errors still print
        # Process-wide and read once, at the first product: pinned by every engine (the fast
        # path too), so the exact one never depends on which engine came first.
        pin_matmul_kernels()
        llama_cpp.llama_backend_init()
        self._cancel = cancel or threading.Event()
        loaded = load_weights(
            gguf,
            n_gpu_layers=n_gpu_layers,
            weight_buffers=weight_buffers,
            cpu=cpu,
            exact=exact,
            cancel=self._cancel,
        )
        self._model: llama_cpp.llama_model_p | None = loaded.model
        self.weights = loaded.placement
        self.vocab = Vocabulary(self._model)
        try:
            self.memory = plan_cache(
                kv_budget,
                stream_cells=stream_cells,
                cost=measure_stream_cost(self._model),
                weights_bytes=gguf.stat().st_size,
                container_bytes=container_bytes,
            )
        except BaseException:
            llama_cpp.llama_model_free(self._model)
            raise
        streams = self.memory.streams
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = streams * stream_cells
        context_params.n_batch = UBATCH_ROWS  # the plan decodes one micro-batch per call
        context_params.n_ubatch = UBATCH_ROWS
        self.max_branches = max(1, min(max_branches, streams - 1))
        context_params.n_seq_max = streams
        context_params.kv_unified = False  # a stream per sequence: a row attends to its own
        # Sliding-window layers keep every cell of a stream, as the others do: a smaller
        # cache reuses the cells a window has left behind, and a shorter prefix taken from
        # that stream would attend to a window with holes (see `_forget_truncated`).
        context_params.swa_full = True
        # Flash attention's CPU kernel picks its summation path by row count: off when exact.
        context_params.flash_attn_type = (
            llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
            if exact
            else llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        )
        n_threads = threads or os.cpu_count() or 1
        context_params.n_threads = n_threads
        context_params.n_threads_batch = n_threads
        self._context = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._context:
            llama_cpp.llama_model_free(self._model)
            raise ModelLoadError(
                f"llama.cpp could not create {streams} KV streams of {stream_cells} cells"
            )
        self._memory = llama_cpp.llama_get_memory(self._context)
        self.stream_cells = stream_cells
        self.threads = n_threads
        self.prefix_reuse = prefix_reuse
        self.exact = exact
        # Recurrent layers (Mamba, RWKV; hybrid models such as Qwen3.5) keep one state per
        # sequence, after its last token: prefixes are reused only where a stream ends.
        self.recurrent = bool(
            llama_cpp.llama_model_is_recurrent(self._model)
            or llama_cpp.llama_model_is_hybrid(self._model)
        )
        # Sliding-window attention (Gemma 2 and 3: llama.cpp's llama_kv_cache_iswa) sees only
        # the last `sliding_window` positions in some layers; with every cell kept, a prefix
        # is cut and copied as on plain attention.
        self.sliding_window = int(llama_cpp.llama_model_n_swa(self._model))
        self.cache = StreamCache(streams, stream_cells, exact=exact, whole_only=self.recurrent)
        self.truncated = 0  # streams forgotten because llama.cpp dropped their first cells
        self.pass_rows = PASS_ROWS
        self.resets = 0  # times every stream was emptied (a generation re-reads after one)

    def description(self) -> dict[str, object]:
        return {
            "n_vocab": self.vocab.n_vocab,
            "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(self._model)),
            **self.memory.summary(),
            "max_branches": self.max_branches,
            "threads": self.threads,
            "prefix_reuse": self.prefix_reuse,
            "exact_scoring": self.exact and self.weights.choice.exact,
            "memory_kind": self.memory_kind,
            "sliding_window": self.sliding_window,
            "recurrent_memory": self.recurrent,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "weight_buffers": self.weights.summary(),
        }

    @property
    def memory_kind(self) -> str:
        """What reuse the model's memory allows (docs/adapter.md, "Memory kinds"): `plain`
        and `sliding_window` cut and copy any prefix, `whole_stream` takes streams whole."""
        if self.recurrent:
            return "whole_stream"
        return "sliding_window" if self.sliding_window > 0 else "plain"

    # -- scoring -------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]] | None = None,
        *,
        continuing: bool = False,
        boundaries: Sequence[Sequence[int]] = (),
        scored: Sequence[int] = (),
        after: Sequence[Sequence[int]] = (),
    ) -> tuple[list[PromptScore], BatchTiming]:
        """Score every prompt in one pass; prompts share whatever prefix they have in
        common with each other and with the resident prefixes of earlier passes.

        `continuations[i]` lists tokens whose next-token logits are wanted after prompt i
        (each costs one extra row and sequence). Identical prompts are scored once. The
        layout (adapter/core/layout.py) makes every result independent of what the cache
        held and of what else rode in the pass. With prefix reuse off the cache is emptied
        first, unless the caller says the pass is `continuing` requests that the passes
        just before began: a request larger than one pass then decodes its state once.
        `boundaries[i]` are where prompt i's state and system turn end: on a model whose
        memory keeps only whole streams, the layout keeps checkpoints there. `scored[i]`
        (default 0) of prompt i's last tokens get their log-probabilities given the tokens
        before them (`PromptScore.token_logprobs`), computed in float64 from the logits, and
        each token of `after[i]` its log-probability after the whole prompt
        (`PromptScore.after_logprobs`): a prompt asked for either keeps no logits.
        """
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        extra = continuations if continuations is not None else [()] * len(prompts)
        if len(extra) != len(prompts):
            raise ValueError("give one continuation list per prompt")
        distinct: dict[tuple[int, ...], set[int]] = {}
        counts: dict[tuple[int, ...], int] = {}
        following: dict[tuple[int, ...], set[int]] = {}
        for index, (prompt, tokens) in enumerate(zip(prompts, extra, strict=True)):
            distinct.setdefault(tuple(prompt), set()).update(tokens)
            following.setdefault(tuple(prompt), set()).update(after[index] if after else ())
            count = scored[index] if index < len(scored) else 0
            if counts.setdefault(tuple(prompt), count) != count:
                raise ValueError("one prompt asked for with two counts of scored tokens")
        unique = [(prompt, sorted(tokens)) for prompt, tokens in distinct.items()]
        cuts = dict(zip(map(tuple, prompts), boundaries, strict=False))
        sequences = sum(1 + len(tokens) for _, tokens in unique)
        if sequences > self.max_branches:
            raise CapacityError(
                f"the pass needs {sequences} sequences; at most {self.max_branches} fit"
            )
        if not (self.prefix_reuse or continuing):
            self.reset()
        started = time.perf_counter()
        wanted = [cuts.get(prompt, ()) for prompt, _ in unique]
        reads = [(counts[prompt], sorted(following[prompt])) for prompt, _ in unique]
        try:
            plan, outputs, read = self._plan_and_run(unique, wanted, reads)
        except RefusedCutError as error:
            # Never from a plan on an empty cache (it cuts nothing), so one retry settles it.
            LOG.warning("%s; scoring the pass again from an empty cache", error)
            plan, outputs, read = self._plan_and_run(unique, wanted, reads)
        self.cache.commit(plan)
        self._forget_truncated(seq for seq, _ in plan.resident)
        by_prompt = {}
        for (prompt, tokens), prompt_plan, (_, asked) in zip(
            unique, plan.prompts, reads, strict=True
        ):
            scored_rows = prompt_plan.scored_rows
            last = read.get(prompt_plan.last_row) if asked else None
            first = read[scored_rows[0]] if scored_rows else last
            by_prompt[prompt] = PromptScore(
                logits=outputs.get(prompt_plan.last_row, _NO_LOGITS),
                input_tokens=len(prompt),
                next_logits={
                    token: outputs[row]
                    for token, row in zip(tokens, prompt_plan.continuation_rows, strict=True)
                },
                reused_tokens=prompt_plan.reused,
                rows=prompt_plan.new_rows,
                token_logprobs=tuple(read[row][0][0] for row in scored_rows),
                scored_top_token=None if first is None else first[1],
                after_logprobs={} if last is None else dict(zip(asked, last[0], strict=True)),
            )
        scores = [by_prompt[tuple(prompt)] for prompt in prompts]
        timing = BatchTiming(
            input_tokens=sum(len(prompt) for prompt in prompts),
            reused_tokens=sum(prompt_plan.reused for prompt_plan in plan.prompts),
            evaluated_tokens=len(plan.rows),
            pad_tokens=plan.redecoded,
            seconds=time.perf_counter() - started,
        )
        return scores, timing

    def _plan_and_run(
        self,
        unique: Sequence[tuple[Sequence[int], Sequence[int]]],
        wanted: Sequence[Sequence[int]],
        asked: Sequence[tuple[int, Sequence[int]]],
    ) -> tuple[PassPlan, dict[int, npt.NDArray[np.float32]], dict[int, _Read]]:
        """Plan the pass on what the cache holds and run it; on any failure every stream is
        emptied (they no longer match the plan) before the error propagates."""
        try:
            self.check_cancel()
            try:
                # The one cell limit (a stream holds a prompt and one continuation token, the
                # planner's rule), checked before any decode: llama.cpp aborts the process on
                # an oversized batch.
                plan = self.cache.plan(unique, wanted, [count for count, _ in asked])
            except OverflowError as error:
                raise CapacityError(str(error)) from None
            kept: set[int] = set()
            reads: dict[int, tuple[int, ...]] = {}  # row -> the tokens read there
            for (prompt, _), prompt_plan, (_, after) in zip(
                unique, plan.prompts, asked, strict=True
            ):
                rows = prompt_plan.scored_rows
                start = len(prompt) - len(rows)
                reads.update({row: (prompt[start + i],) for i, row in enumerate(rows)})
                if after:
                    reads[prompt_plan.last_row] = tuple(after)
                elif not rows:
                    kept.update((prompt_plan.last_row, *prompt_plan.continuation_rows))
            return plan, *self._run_pass(plan, kept, reads)
        except BaseException:
            self.reset()
            raise

    def _run_pass(
        self, plan: PassPlan, kept: set[int], reads: dict[int, tuple[int, ...]]
    ) -> tuple[dict[int, npt.NDArray[np.float32]], dict[int, _Read]]:
        """Execute a pass plan step by step: copies and cuts, then one decode per
        micro-batch. Returns the logits of the `kept` rows, and for each row in `reads` the
        log-probabilities of its tokens and the row's most likely token (read at once, so a
        pass holds no vocabulary-sized vector per scored row)."""
        outputs: dict[int, npt.NDArray[np.float32]] = {}
        read: dict[int, _Read] = {}
        first_row = 0
        for step in plan.steps:
            for copy in step.copies:
                self.take(copy)
            for rows in step.micro_batches:
                self.check_cancel()
                self._decode_rows(rows)
                for index in range(len(rows)):
                    row = first_row + index
                    if row in kept:
                        outputs[row] = self._logits(index)
                    elif row in reads:
                        read[row] = _token_logprobs(self._logits(index), reads[row])
                first_row += len(rows)
        for seq in plan.released:
            self._remove(seq, 0)
        return outputs, read

    def _decode_rows(self, rows: Sequence[Row]) -> None:
        batch = llama_cpp.llama_batch_init(len(rows), 0, 1)
        try:
            for index, row in enumerate(rows):
                self._put(batch, index, row.token, row.position, [row.seq], wants_logits=row.logits)
            batch.n_tokens = len(rows)
            self._decode(batch)
        finally:
            llama_cpp.llama_batch_free(batch)

    def _logits(self, row: int) -> npt.NDArray[np.float32]:
        pointer = llama_cpp.llama_get_logits_ith(self._context, row)
        if not pointer:
            raise NativeFailureError(f"llama.cpp returned no logits for batch row {row}")
        return np.ctypeslib.as_array(pointer, shape=(self.vocab.n_vocab,)).copy()

    # -- the stream operations (worker only; a generation uses them as its StreamHost) ----

    def take(self, copy: Copy) -> None:
        """A stream takes another's first `keep` cells (a whole-stream copy, then a cut)."""
        if copy.source is not None:
            llama_cpp.llama_memory_seq_cp(self._memory, copy.source, copy.target, -1, -1)
        self._remove(copy.target, copy.keep)

    def empty(self, seq: int) -> None:
        """Drop every cell of a stream (nothing to do once the context is freed)."""
        if self._context:
            self._remove(seq, 0)

    def _remove(self, seq: int, keep: int) -> None:
        """Drop a stream's cells from position `keep` on. A model whose memory cannot drop a
        sequence's tail (recurrent or hybrid layers) refuses; reusing a prefix there would
        give wrong logits, so this fails instead (the caller then starts from scratch)."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, keep if keep > 0 else -1, -1):
            raise RefusedCutError(
                f"llama.cpp refused to cut stream {seq} back to {keep} tokens (this model's "
                f"memory keeps {'only whole streams' if self.recurrent else 'every prefix'})"
            )

    def _forget_truncated(self, streams: Iterable[int]) -> None:
        """Forget a stream whose first cells llama.cpp has dropped. A sliding-window cache
        may reuse a cell every later position has left behind, and then drops the positions
        before it; a prefix taken from that stream would attend to a window with holes. With
        every cell kept (`swa_full`) it never happens: this is the check that it did not."""
        if not self.sliding_window:
            return
        for seq in streams:
            if llama_cpp.llama_memory_seq_pos_min(self._memory, seq) > 0:
                LOG.warning("KV stream %d lost its first cells; it is not reused", seq)
                self._remove(seq, 0)
                self.cache.forget(seq)
                self.truncated += 1

    def decode_tokens(self, seq: int, tokens: Sequence[int], start: int) -> None:
        """Decode tokens[start:] into `seq`, a micro-batch at a time (logits for the last)."""
        last = len(tokens) - 1
        for begin in range(start, len(tokens), UBATCH_ROWS):
            self._decode_rows(
                [
                    Row(int(tokens[position]), position, seq, position == last)
                    for position in range(begin, min(begin + UBATCH_ROWS, len(tokens)))
                ]
            )

    def sample(self, sampler: llama_cpp.llama_sampler_p) -> int:
        """A token drawn from the last decode's logits."""
        return int(llama_cpp.llama_sampler_sample(sampler, self._context, -1))

    def check_cancel(self) -> None:
        if self._cancel.is_set():
            raise CancelledWorkError("cancelled: the server is shutting down")

    def held(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` a stream already holds, from the first (the worker asks
        before it sends a long prompt's chunks: adapter.core.scheduler)."""
        return self.cache.longest_match(tokens)[1]

    def reset(self) -> None:
        """Forget every cached token (after a failure, or to measure without reuse). A
        generation in progress sees `resets` change and re-reads its context. The cells'
        data stays: attention weighs a cell no sequence holds by exactly 0."""
        llama_cpp.llama_memory_clear(self._memory, False)
        self.cache.clear()
        self.resets += 1

    # -- generation (chat) ----------------------------------------------------------------

    def start_generation(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str] = (),
    ) -> GenerationRun:
        """Begin sampling up to `max_new_tokens` after `prompt` in a sequence of its own;
        `GenerationRun.step` decodes one token at a time, so scoring passes can run between
        steps. One generation at a time (it holds the one reserved stream)."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("generation needs a prompt and at least one new token")
        if len(prompt) + max_new_tokens > self.stream_cells:
            raise CapacityError(
                f"{len(prompt)} prompt tokens plus {max_new_tokens} new tokens need more KV "
                f"cells than a stream has ({self.stream_cells})"
            )
        if self.cache.reserved:
            raise RuntimeError("a generation is already running")
        return GenerationRun(self, self.vocab, list(prompt), max_new_tokens, sampling, stop)

    @staticmethod
    def _put(
        batch: llama_cpp.llama_batch,
        row: int,
        token: int,
        position: int,
        sequences: Sequence[int],
        *,
        wants_logits: bool,
    ) -> None:
        batch.token[row] = token
        batch.pos[row] = position  # type: ignore[call-overload]  # binding mistypes pos
        batch.n_seq_id[row] = len(sequences)
        for index, sequence in enumerate(sequences):
            batch.seq_id[row][index] = sequence
        batch.logits[row] = wants_logits

    def _decode(self, batch: llama_cpp.llama_batch) -> None:
        status = llama_cpp.llama_decode(self._context, batch)
        if status == 1:
            raise CapacityError("llama.cpp found no KV cache slot for the batch")
        if status != 0:
            raise NativeFailureError(f"llama_decode failed with status {status}")

    def close(self) -> None:
        if getattr(self, "_context", None):
            llama_cpp.llama_free(self._context)
            self._context = None
        if getattr(self, "_model", None):
            llama_cpp.llama_model_free(self._model)
            self._model = None
