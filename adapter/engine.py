"""One llama.cpp model and context that scores prompts by their last-position logits.

The KV cache is one stream per sequence (adapter/kv_layout.py plans where every token goes).
Two kinds of reuse make scoring cheap:
- across calls, every stream keeps the last prompt decoded into it, and a new prompt starts
  from the stream sharing its longest prefix (a copy of that prefix into its own stream);
- within one call, what several prompts share beyond that (a state asked several questions)
  is decoded once and copied to each before their own tokens are decoded together.
A prompt may also ask for the logits after some continuation tokens (a two-token answer
label needs P(second | first)): each continuation is one more sequence, the prompt with that
token appended, decoded in the same pass. Scoring generates nothing; `start_generation`
(chat) samples tokens into a stream of its own.

Threads: decoding, the context and the KV cache (`score`, generation, `reset`) belong to
the scheduler's worker alone. Tokenizing (`tokenize`, `tokenize_prompt`, `piece`) reads
only the vocabulary, which llama.cpp never changes after load, so request threads call it
while the worker decodes; the service keeps `close` from freeing it under them.

Prompts mix template text with text from requests. `tokenize_prompt` turns control-token
texts (`<|im_start|>`, ...) into control tokens only where the template wrote them: text
inside the given user spans is always tokenized as plain text, so a request cannot forge a
turn. Weights are read into memory at load (no mmap), so the file can change on disk
without changing what is served. A `cancel` event (set at shutdown) aborts a load, and
stops scoring and generation at the next decode boundary.

It knows tokens, logits and the KV cache, nothing about decisions: prompts, labels and
readout live in the modules that use it.
"""

from __future__ import annotations

import bisect
import codecs
import ctypes
import os
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import llama_cpp
import llama_cpp._logger
import numpy as np
import numpy.typing as npt

from adapter.kv_layout import UBATCH_ROWS, Copy, PassPlan, Row, StreamCache
from adapter.weight_buffers import (
    BufferChoice,
    CpuBackend,
    WeightBufferError,
    WeightBuffers,
    check_landed,
    choose_buffers,
)

_ALL_LAYERS = 1_000_000
# KV streams: each holds one sequence of up to `stream_cells` tokens. A pass decodes at most
# all but one of them (one is kept for a generation); a question with letter-digit labels
# needs 27 (its prompt and one continuation per first letter).
KV_STREAMS = 32
KV_PAD_CELLS = 256  # llama.cpp rounds a stream's size up to this
# Rows one pass takes: enough to share a template and a state across many prompts, few
# enough that a request waiting behind a pass is not kept long.
PASS_ROWS = 1024


# Tokens llama.cpp's special-token parsing splits out of text; with parse_special off it
# still splits USER_DEFINED ones, so only CONTROL and UNKNOWN can be forged.
_SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
_FORGEABLE_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
_C_SPACE = " \t\n\v\f\r"  # what llama.cpp's isspace() strips next to LSTRIP/RSTRIP tokens
# llama.cpp's load log names every buffer the weights went to, with its size.
_BUFFER_LINE = re.compile(r"^\S+:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")


class ModelLoadError(RuntimeError):
    """The model cannot be served: load failure, missing chat template or unusable letters."""


class NativeFailureError(RuntimeError):
    """llama.cpp reported an internal error; the context can no longer be trusted."""


class CapacityError(RuntimeError):
    """A batch did not fit the KV cache; the request can be retried smaller."""


class CancelledWorkError(RuntimeError):
    """The work was cancelled (the server is shutting down); the KV cache was reset."""


@dataclass(frozen=True)
class SpecialToken:
    """A token llama.cpp's special parsing splits out of text, with its attributes."""

    id: int
    text: str
    attr: int

    @property
    def forgeable(self) -> bool:
        """A control (or unknown) token: only the template may produce it."""
        return bool(self.attr & _FORGEABLE_ATTRS)


# A prompt cut at special tokens: token ids, and (start, end) spans of raw text.
_Fragment = int | tuple[int, int]


@dataclass(frozen=True)
class PromptScore:
    """Last-position logits of one prompt and how its tokens were obtained.

    `next_logits` maps each requested continuation token to the logits that follow it.
    """

    logits: npt.NDArray[np.float32]
    input_tokens: int
    next_logits: dict[int, npt.NDArray[np.float32]] = field(default_factory=dict)
    reused_tokens: int = 0  # taken from a resident prefix
    rows: frozenset[int] = frozenset()  # rows of the pass on its path (shared ones too)


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


@dataclass(frozen=True)
class Sampling:
    """How chat picks each token: temperature 0 is greedy (deterministic)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """Generated text (stop string excluded) and what it cost."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int
    finish_reason: Literal["stop", "length"]


def _first_stop(text: str, stop: Sequence[str], scanned: int) -> int | None:
    """Where the earliest stop string starts, looking only at text not yet scanned."""
    hits = [
        found
        for marker in stop
        if (found := text.find(marker, max(0, scanned - len(marker) + 1))) >= 0
    ]
    return min(hits) if hits else None


def require_kv_stream_binding() -> None:
    """Refuse a binding that cannot ask for one KV stream per sequence.

    Setting an unknown field on a ctypes structure silently creates a Python attribute, so
    an older binding would ignore `kv_unified` and the streams, and scoring would fail later,
    deep inside a request. The images build the binding from a pinned commit; this turns an
    ABI mismatch into a start error that names the cause.
    """
    fields = {name for name, *_ in llama_cpp.llama_context_params._fields_}
    missing = [name for name in ("kv_unified", "n_seq_max") if name not in fields]
    missing += [
        name
        for name in ("llama_memory_seq_cp", "llama_memory_seq_rm", "llama_get_memory")
        if not hasattr(llama_cpp, name)
    ]
    if missing:
        raise ModelLoadError(
            f"the llama-cpp-python binding lacks {', '.join(missing)}; it must match a "
            "llama.cpp with the llama_memory_* API and per-sequence KV streams"
        )


def read_weights_into_memory(params: llama_cpp.llama_model_params) -> None:
    """Load without mmap: with a mapped file, bytes rewritten in place after the sha256
    check would be served under the verified identity. Bindings spell this `load_mode`
    (newer) or `use_mmap` (older, the DLC's pin); setting a field a ctypes structure lacks
    silently does nothing, so the field is looked up first."""
    fields = {name for name, *_ in llama_cpp.llama_model_params._fields_}
    if "load_mode" in fields:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        if "lazy_mode" in fields:
            params.lazy_mode = llama_cpp.LLAMA_LAZY_MODE_OFF  # lazy reading needs mmap
    elif "use_mmap" in fields:
        params.use_mmap = False
    else:
        raise ModelLoadError(
            "the llama-cpp-python binding has neither load_mode nor use_mmap; cannot load "
            "the weights into memory"
        )


def restrict_weight_buffers(params: llama_cpp.llama_model_params, choice: BufferChoice) -> None:
    """Apply the weight-buffer choice to the load parameters. A binding without
    `use_extra_bufts` (setting an unknown ctypes field silently does nothing) cannot turn
    llama.cpp's extra buffer types off, so such a choice is refused, not ignored."""
    fields = {name for name, *_ in llama_cpp.llama_model_params._fields_}
    if "use_extra_bufts" in fields:
        params.use_extra_bufts = choice.use_extra
    elif not choice.use_extra:
        raise WeightBufferError(
            "the llama-cpp-python binding has no llama_model_params.use_extra_bufts, so "
            f"llama.cpp's extra weight buffers cannot be turned off ({choice.reason}); use a "
            "binding that matches the library, or SEMIF_WEIGHT_BUFFERS=all to accept them"
        )


@contextmanager
def capture_model_buffers() -> Iterator[dict[str, float]]:
    """Collect llama.cpp's `<buffer> model buffer size = <MiB>` load lines while the block
    runs (the mapping fills in as they arrive), passing every line on to the binding's own
    logger. The log callback is process-wide: one load at a time, as the server does."""
    landed: dict[str, float] = {}
    forward = llama_cpp._logger.llama_log_callback

    def record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        match = _BUFFER_LINE.match(text.decode("utf-8", errors="replace").strip())
        if match:
            landed[match.group(1)] = landed.get(match.group(1), 0.0) + float(match.group(2))
        forward(level, text, user_data)

    callback = llama_cpp.llama_log_callback(record)  # referenced until the restore below
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield landed
    finally:
        llama_cpp.llama_log_set(forward, ctypes.c_void_p(0))


@dataclass(frozen=True)
class WeightPlacement:
    """Where the weights went and why: the CPU backend's report, the buffer-type choice
    made from it, and the buffers (name -> MiB) llama.cpp loaded them into."""

    cpu: CpuBackend
    choice: BufferChoice
    landed: dict[str, float]

    def describe(self) -> str:
        """One log line: what an operator needs to read a native crash at the first decode."""
        buffers = ", ".join(f"{name} {mib:.1f} MiB" for name, mib in self.landed.items())
        refused = ", ".join(self.choice.refused) or "none"
        return (
            f"llama.cpp CPU features: {self.cpu.describe()}; extra weight buffer types "
            f"offered: {', '.join(self.choice.offered) or 'none'}; refused: {refused} "
            f"(SEMIF_WEIGHT_BUFFERS={self.choice.setting}: {self.choice.reason}); weights "
            f"in: {buffers or 'not reported'}"
        )

    def summary(self) -> dict[str, object]:
        return {
            "setting": self.choice.setting,
            "offered": list(self.choice.offered),
            "refused": list(self.choice.refused),
            "weights_in": sorted(self.landed),
        }


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
        cancel: threading.Event | None = None,
    ) -> None:
        require_kv_stream_binding()
        if stream_cells < 1:
            raise ModelLoadError(f"a KV stream needs at least one cell, not {stream_cells}")
        stream_cells = KV_PAD_CELLS * -(-stream_cells // KV_PAD_CELLS)
        llama_cpp._logger.set_verbose(False)  # native INFO chatter off; errors still print
        llama_cpp.llama_backend_init()
        self._cancel = cancel or threading.Event()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = _ALL_LAYERS if n_gpu_layers < 0 else n_gpu_layers
        read_weights_into_memory(model_params)
        choice = choose_buffers(weight_buffers, cpu)
        restrict_weight_buffers(model_params, choice)
        # Returning False aborts the load; kept on self so ctypes does not free it early.
        self._progress = llama_cpp.llama_progress_callback(
            lambda progress, data: not self._cancel.is_set()
        )
        model_params.progress_callback = self._progress
        with capture_model_buffers() as landed:
            self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self._model:
            if self._cancel.is_set():
                raise CancelledWorkError("model load cancelled: the server is shutting down")
            raise ModelLoadError(f"llama.cpp could not load {gguf}")
        self.weights = WeightPlacement(cpu, choice, landed)
        try:
            check_landed(choice, landed)
        except WeightBufferError:
            llama_cpp.llama_model_free(self._model)
            raise
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.special_tokens = self._special_tokens()
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = KV_STREAMS * stream_cells
        context_params.n_batch = UBATCH_ROWS  # the plan decodes one micro-batch per call
        context_params.n_ubatch = UBATCH_ROWS
        self.max_branches = max(1, min(max_branches, KV_STREAMS - 1))
        context_params.n_seq_max = KV_STREAMS
        context_params.kv_unified = False  # a stream per sequence: a row attends to its own
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
                f"llama.cpp could not create {KV_STREAMS} KV streams of {stream_cells} cells"
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
        self.cache = StreamCache(KV_STREAMS, stream_cells, exact=exact, whole_only=self.recurrent)
        self.pass_rows = PASS_ROWS
        self._generation: GenerationRun | None = None

    # -- model facts ---------------------------------------------------------------------

    def chat_template_source(self) -> str:
        """The GGUF's chat template; decision prompts are rendered with it, so it is required."""
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        if not raw:
            raise ModelLoadError(
                "the model has no chat template (tokenizer.chat_template); the decision "
                "prompt is rendered with the model's own template, so one is required"
            )
        return bytes(raw).decode("utf-8")

    def special_texts(self) -> tuple[str, str]:
        """The BOS and EOS tokens as text, for templates that spell them out."""
        return (
            self.piece(llama_cpp.llama_vocab_bos(self._vocab), special=True),
            self.piece(llama_cpp.llama_vocab_eos(self._vocab), special=True),
        )

    def _special_tokens(self) -> list[SpecialToken]:
        """The tokens llama.cpp's special parsing looks for, longest text first (its order)."""
        found = []
        for token in range(self.n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(self._vocab, token))
            if not attr & _SPECIAL_ATTRS:
                continue
            raw = llama_cpp.llama_vocab_get_text(self._vocab, token)
            try:
                text = raw.decode("utf-8") if raw else ""
            except UnicodeDecodeError:
                continue  # never matched: request and template text are valid UTF-8 strings
            if text:
                found.append(SpecialToken(token, text, attr))
        found.sort(key=lambda special: len(special.text.encode("utf-8")), reverse=True)
        return found

    def tokenize(self, text: str) -> list[int]:
        """Tokenize text the template wrote entirely, parsing its special tokens (llama.cpp's
        own parsing), adding BOS if due. Text from a request goes through `tokenize_prompt`."""
        return self._with_bos(self._tokenize_raw(text, parse_special=True))

    def tokenize_prompt(self, text: str, user_spans: Sequence[tuple[int, int]]) -> list[int]:
        """Tokenize a rendered prompt whose `user_spans` (character ranges) came from a
        request: control tokens are parsed only where the template wrote them.

        This is llama.cpp's special-token parsing done here: cut the text at the special
        tokens (longest first, honouring their LSTRIP/RSTRIP whitespace rules), skipping
        any control-token occurrence that touches user text, then tokenize every piece
        as plain text. With no control-token text inside user spans the result is exactly
        `tokenize(text)`; a forged marker only becomes its own plain-text tokens.
        """
        fragments: list[_Fragment] = [(0, len(text))]
        for special in self.special_tokens:
            if special.text not in text:
                continue
            fragments = self._split_at(text, fragments, special, user_spans)
        tokens: list[int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                tokens.append(fragment)
            else:
                start, end = fragment
                tokens.extend(self._tokenize_raw(text[start:end], parse_special=False))
        return self._with_bos(tokens)

    @staticmethod
    def _split_at(
        text: str,
        fragments: list[_Fragment],
        special: SpecialToken,
        user_spans: Sequence[tuple[int, int]],
    ) -> list[_Fragment]:
        """Cut every raw fragment at the occurrences of one special token."""

        spans = sorted(user_spans)  # disjoint: only the last span starting before `end`
        starts = [span_start for span_start, _ in spans]  # can reach back past `start`

        def user_owned(start: int, end: int) -> bool:
            index = bisect.bisect_left(starts, end) - 1
            return index >= 0 and spans[index][1] > start

        result: list[_Fragment] = []
        length = len(special.text)
        for fragment in fragments:
            if isinstance(fragment, int):
                result.append(fragment)
                continue
            start, end = fragment
            search = start
            while True:
                match = text.find(special.text, search, end)
                if match < 0:
                    break
                if special.forgeable and user_owned(match, match + length):
                    search = match + 1  # request text: stays plain
                    continue
                left_end = match
                if special.attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                    while left_end > start and text[left_end - 1] in _C_SPACE:
                        left_end -= 1
                if left_end > start:
                    result.append((start, left_end))
                result.append(special.id)
                start = search = match + length
                if special.attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP:
                    while start < end and text[start] in _C_SPACE:
                        start += 1
                    search = start
            if start < end:
                result.append((start, end))
        return result

    def _tokenize_raw(self, text: str, *, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buffer, capacity, False, parse_special
        )
        if count < 0:
            capacity = -count
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, False, parse_special
            )
        return list(buffer[:count])

    def _with_bos(self, tokens: list[int]) -> list[int]:
        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if llama_cpp.llama_vocab_get_add_bos(self._vocab) and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

    def piece(self, token: int, *, special: bool = False) -> str:
        return self._piece_bytes(token, special=special).decode("utf-8", errors="replace")

    def _piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        """A token's raw bytes; one character may span several tokens, so decode later."""
        buffer = ctypes.create_string_buffer(256)
        length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, 256, 0, special)
        return buffer.raw[: max(length, 0)]

    def description(self) -> dict[str, object]:
        return {
            "n_vocab": self.n_vocab,
            "n_ctx_train": int(llama_cpp.llama_model_n_ctx_train(self._model)),
            "kv_streams": KV_STREAMS,
            "stream_cells": self.stream_cells,
            "max_branches": self.max_branches,
            "threads": self.threads,
            "prefix_reuse": self.prefix_reuse,
            "exact_scoring": self.exact,
            "recurrent_memory": self.recurrent,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
            "weight_buffers": self.weights.summary(),
        }

    # -- scoring -------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]] | None = None,
        *,
        continuing: bool = False,
    ) -> tuple[list[PromptScore], BatchTiming]:
        """Score every prompt in one pass; prompts share whatever prefix they have in
        common with each other and with the resident prefixes of earlier passes.

        `continuations[i]` lists tokens whose next-token logits are wanted after prompt i
        (each costs one extra row and sequence). Identical prompts are scored once. The
        layout (adapter/kv_layout.py) makes every result independent of what the cache
        held and of what else rode in the pass. With prefix reuse off the cache is emptied
        first, unless the caller says the pass is `continuing` requests that the passes
        just before began: a request larger than one pass then decodes its state once.
        """
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        extra = continuations if continuations is not None else [()] * len(prompts)
        if len(extra) != len(prompts):
            raise ValueError("give one continuation list per prompt")
        longest = max(
            len(prompt) + len(tokens) for prompt, tokens in zip(prompts, extra, strict=True)
        )
        if longest > self.stream_cells:
            # Checked before any decode: llama.cpp aborts the process on an oversized batch.
            raise CapacityError(
                f"a prompt needs {longest} KV cells; a stream has {self.stream_cells}"
            )
        distinct: dict[tuple[int, ...], set[int]] = {}
        for prompt, tokens in zip(prompts, extra, strict=True):
            distinct.setdefault(tuple(prompt), set()).update(tokens)
        unique = [(prompt, sorted(tokens)) for prompt, tokens in distinct.items()]
        sequences = sum(1 + len(tokens) for _, tokens in unique)
        if sequences > self.max_branches:
            raise CapacityError(
                f"the pass needs {sequences} sequences; at most {self.max_branches} fit"
            )
        if not (self.prefix_reuse or continuing):
            self.reset()
        started = time.perf_counter()
        try:
            self._check_cancel()
            try:
                plan = self.cache.plan(unique)
            except OverflowError as error:
                raise CapacityError(str(error)) from None
            outputs = self._run_pass(plan)
        except BaseException:
            self.reset()  # whatever failed, the streams no longer match the plan
            raise
        self.cache.commit(plan)
        by_prompt = {}
        for (prompt, tokens), prompt_plan in zip(unique, plan.prompts, strict=True):
            by_prompt[prompt] = PromptScore(
                logits=outputs[prompt_plan.last_row],
                input_tokens=len(prompt),
                next_logits={
                    token: outputs[row]
                    for token, row in zip(tokens, prompt_plan.continuation_rows, strict=True)
                },
                reused_tokens=prompt_plan.reused,
                rows=prompt_plan.new_rows,
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

    def _run_pass(self, plan: PassPlan) -> dict[int, npt.NDArray[np.float32]]:
        """Execute a pass plan step by step: copies and cuts, then one decode per
        micro-batch. Returns the logits of every row a prompt reads."""
        wanted = set(plan.output_rows)
        outputs: dict[int, npt.NDArray[np.float32]] = {}
        first_row = 0
        for step in plan.steps:
            for copy in step.copies:
                self._take(copy)
            for rows in step.micro_batches:
                self._check_cancel()
                self._decode_rows(rows)
                for index in range(len(rows)):
                    if first_row + index in wanted:
                        outputs[first_row + index] = self._logits(index)
                first_row += len(rows)
        for seq in plan.released:
            self._remove(seq, 0)
        return outputs

    def _take(self, copy: Copy) -> None:
        """A stream takes another's first `keep` cells (a whole-stream copy, then a cut)."""
        if copy.source is not None:
            llama_cpp.llama_memory_seq_cp(self._memory, copy.source, copy.target, -1, -1)
        self._remove(copy.target, copy.keep)

    def _remove(self, seq: int, keep: int) -> None:
        """Drop a stream's cells from position `keep` on. A model whose memory cannot drop a
        sequence's tail (recurrent or hybrid layers) refuses; reusing a prefix there would
        give wrong logits, so this fails instead."""
        if not llama_cpp.llama_memory_seq_rm(self._memory, seq, keep if keep > 0 else -1, -1):
            raise NativeFailureError(
                f"llama.cpp could not drop sequence {seq} from position {keep}: this model's "
                "memory cannot keep a prefix (recurrent layers)"
            )

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
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise CancelledWorkError("cancelled: the server is shutting down")

    def reset(self) -> None:
        """Forget every cached token (after a failure, or to measure without reuse). A
        generation in progress re-reads its context at its next step. The cells' data stays:
        attention weighs a cell no sequence holds by exactly 0."""
        llama_cpp.llama_memory_clear(self._memory, False)
        self.cache.clear()
        if self._generation is not None:
            self._generation.evicted = True

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
        steps. One generation at a time."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("generation needs a prompt and at least one new token")
        if len(prompt) + max_new_tokens > self.stream_cells:
            raise CapacityError(
                f"{len(prompt)} prompt tokens plus {max_new_tokens} new tokens need more KV "
                f"cells than a stream has ({self.stream_cells})"
            )
        if self._generation is not None:
            raise RuntimeError("a generation is already running")
        run = GenerationRun(self, list(prompt), max_new_tokens, sampling, stop)
        self._generation = run
        return run

    def _decode_context(self, seq: int, tokens: Sequence[int], start: int) -> None:
        """Decode tokens[start:] into `seq`, a micro-batch at a time (logits for the last)."""
        last = len(tokens) - 1
        for begin in range(start, len(tokens), UBATCH_ROWS):
            self._decode_rows(
                [
                    Row(int(tokens[position]), position, seq, position == last)
                    for position in range(begin, min(begin + UBATCH_ROWS, len(tokens)))
                ]
            )

    @staticmethod
    def _sampler(sampling: Sampling) -> llama_cpp.llama_sampler_p:
        params = llama_cpp.llama_sampler_chain_default_params()
        chain: llama_cpp.llama_sampler_p = llama_cpp.llama_sampler_chain_init(params)
        if sampling.temperature <= 0:
            llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
            return chain
        seed = llama_cpp.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed
        llama_cpp.llama_sampler_chain_add(
            chain, llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1)
        )
        llama_cpp.llama_sampler_chain_add(
            chain, llama_cpp.llama_sampler_init_temp(sampling.temperature)
        )
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
        return chain

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


class GenerationRun:
    """One chat generation, a token per `step`, in a sequence of its own.

    Sampling reads the logits of the last decode, so each step decodes the previous token
    and samples the next at once; scoring passes may run between steps, and never touch its
    stream. It starts from a copy of the stream sharing its longest prefix; its own stream is
    emptied at `close` (one-row decodes round differently, so scoring never reuses it). After
    `reset` (a failed pass) the next step re-reads the whole context.
    """

    def __init__(
        self,
        engine: LlamaEngine,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
    ) -> None:
        self._engine = engine
        self.prompt_tokens = len(prompt)
        self._context = prompt
        self._limit = max_new_tokens
        self._stop = stop
        self._sampler: llama_cpp.llama_sampler_p | None = engine._sampler(sampling)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._seq = engine.cache.reserve()
        self.evicted = True  # the context is not (or no longer) in the cache
        self._decoded = 0  # context tokens the sequence holds
        self._text = ""
        self._count = 0
        self._finish: Literal["stop", "length"] | None = None
        self.reused_tokens = -1

    def step(self) -> bool:
        """Decode what is due and sample one token; True once finished."""
        if self._finish is not None:
            return True
        engine = self._engine
        engine._check_cancel()
        self._catch_up()
        assert self._sampler is not None  # set until close()
        token = int(llama_cpp.llama_sampler_sample(self._sampler, engine._context, -1))
        if llama_cpp.llama_vocab_is_eog(engine._vocab, token):
            return self._end("stop", self._decoder.decode(b"", final=True))
        self._count += 1
        scanned = len(self._text)
        self._text += self._decoder.decode(engine._piece_bytes(token))
        cut = _first_stop(self._text, self._stop, scanned)
        if cut is not None:
            self._text = self._text[:cut]
            return self._end("stop", "")
        if self._count >= self._limit:
            return self._end("length", self._decoder.decode(b"", final=True))
        self._context.append(token)
        return False

    def _catch_up(self) -> None:
        engine = self._engine
        if self.evicted:
            base, length = engine.cache.longest_match(self._context[:-1])
            engine._take(Copy(base if length > 0 else None, self._seq, length))
            if self.reused_tokens < 0:
                self.reused_tokens = length
            self._decoded = length
            self.evicted = False
        engine._decode_context(self._seq, self._context, self._decoded)
        self._decoded = len(self._context)

    def _end(self, finish: Literal["stop", "length"], tail: str) -> bool:
        self._text += tail
        self._finish = finish
        return True

    def close(self) -> None:
        """Free the sampler and empty the stream."""
        engine = self._engine
        if self._sampler is not None:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None
        if engine._context:
            engine._remove(self._seq, 0)
        engine.cache.release(self._seq)
        engine._generation = None

    def result(self) -> Generation:
        if self._finish is None:
            raise RuntimeError("the generation has not finished")
        return Generation(
            text=self._text,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self._count,
            reused_tokens=max(self.reused_tokens, 0),
            finish_reason=self._finish,
        )
