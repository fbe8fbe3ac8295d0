"""One llama.cpp model and context that scores prompts by their last-position logits.

Two kinds of reuse make scoring cheap:
- across calls, sequence 0 keeps the previous prompt's KV cache and only the tokens after
  the longest common prefix are evaluated;
- within one call, the prompts' common prefix is evaluated once into sequence 0, then
  copied into one branch sequence per prompt (a metadata copy in the unified KV cache) and
  every branch's suffix is decoded in one batch.
A prompt may also ask for the logits after some continuation tokens (a two-token answer
label needs P(second | first)): its suffix is decoded into one extra sequence per
continuation, each with that token appended, so those logits come out of the same decode.
Scoring generates nothing; `generate` (chat) samples tokens into sequence 0 and keeps them
for prefix reuse. The engine is not thread-safe: callers hold its lock.

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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import llama_cpp
import llama_cpp._logger
import numpy as np
import numpy.typing as npt

_ALL_LAYERS = 1_000_000
_MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
_UBATCH_TOKENS = 512
# Tokens llama.cpp's special-token parsing splits out of text; with parse_special off it
# still splits USER_DEFINED ones, so only CONTROL and UNKNOWN can be forged.
_SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
_FORGEABLE_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
_C_SPACE = " \t\n\v\f\r"  # what llama.cpp's isspace() strips next to LSTRIP/RSTRIP tokens


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


@dataclass(frozen=True)
class BatchTiming:
    prefix_tokens: int
    reused_tokens: int
    suffix_tokens: int
    prefill_seconds: float
    suffix_seconds: float
    branch_waves: int


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


_Branch = tuple[Sequence[int], Sequence[int]]  # a prompt and its continuation tokens


def _first_stop(text: str, stop: Sequence[str], scanned: int) -> int | None:
    """Where the earliest stop string starts, looking only at text not yet scanned."""
    hits = [
        found
        for marker in stop
        if (found := text.find(marker, max(0, scanned - len(marker) + 1))) >= 0
    ]
    return min(hits) if hits else None


def require_unified_kv_binding() -> None:
    """Refuse a binding that cannot express a unified multi-sequence KV cache.

    Setting an unknown field on a ctypes structure silently creates a Python attribute, so
    an older binding would give each branch sequence 1/n of the cache and fail later, deep
    inside a request. The images build the binding from a pinned commit; this turns an ABI
    mismatch into a start error that names the cause.
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
            "llama.cpp with the llama_memory_* API and unified KV caches"
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


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for left, right in zip(first, second, strict=False):
        if left != right:
            break
        length += 1
    return length


class LlamaEngine:
    """Owns the native model and context; frees both on close()."""

    def __init__(
        self,
        gguf: Path,
        *,
        kv_cells: int,
        max_branches: int,
        threads: int | None,
        n_gpu_layers: int,
        prefix_reuse: bool = True,
        cancel: threading.Event | None = None,
    ) -> None:
        require_unified_kv_binding()
        llama_cpp._logger.set_verbose(False)  # native INFO chatter off; errors still print
        llama_cpp.llama_backend_init()
        self._cancel = cancel or threading.Event()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = _ALL_LAYERS if n_gpu_layers < 0 else n_gpu_layers
        read_weights_into_memory(model_params)
        # Returning False aborts the load; kept on self so ctypes does not free it early.
        self._progress = llama_cpp.llama_progress_callback(
            lambda progress, data: not self._cancel.is_set()
        )
        model_params.progress_callback = self._progress
        self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self._model:
            if self._cancel.is_set():
                raise CancelledWorkError("model load cancelled: the server is shutting down")
            raise ModelLoadError(f"llama.cpp could not load {gguf}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.special_tokens = self._special_tokens()
        context_params = llama_cpp.llama_context_default_params()
        context_params.n_ctx = kv_cells
        context_params.n_batch = kv_cells
        context_params.n_ubatch = min(_UBATCH_TOKENS, kv_cells)
        # One sequence holds the reusable prefix; the others are decision branches.
        self.max_branches = max(1, min(max_branches, _MAX_SEQUENCES - 1))
        context_params.n_seq_max = self.max_branches + 1
        context_params.kv_unified = True
        n_threads = threads or os.cpu_count() or 1
        context_params.n_threads = n_threads
        context_params.n_threads_batch = n_threads
        self._context = llama_cpp.llama_init_from_model(self._model, context_params)
        if not self._context:
            llama_cpp.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp could not create a context of {kv_cells} cells")
        self._memory = llama_cpp.llama_get_memory(self._context)
        self.kv_cells = kv_cells
        self.threads = n_threads
        self.prefix_reuse = prefix_reuse
        self._cached: list[int] = []

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
            "kv_cells": self.kv_cells,
            "max_branches": self.max_branches,
            "threads": self.threads,
            "prefix_reuse": self.prefix_reuse,
            "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        }

    # -- scoring -------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[PromptScore], BatchTiming]:
        """Score every prompt; they share whatever token prefix they have in common.

        The common prefix (reused from the previous call where it matches) is decoded once
        into sequence 0; each prompt's remaining tokens are decoded as a branch, as many
        branches per batch as the KV cache and sequence count allow. `continuations[i]`
        lists tokens whose next-token logits are wanted after prompt i (each costs one
        extra token and one sequence in the same batch).
        """
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        extra = continuations if continuations is not None else [()] * len(prompts)
        if len(extra) != len(prompts):
            raise ValueError("give one continuation list per prompt")
        branches = list(zip(prompts, extra, strict=True))
        longest = max(len(prompt) + len(tokens) for prompt, tokens in branches)
        if longest > self.kv_cells:
            # Checked before any decode: llama.cpp aborts the process on an oversized batch.
            raise CapacityError(f"a prompt needs {longest} KV cells; the cache has {self.kv_cells}")
        prefix_length = min(len(prompt) for prompt in prompts) - 1
        for prompt in prompts[1:]:
            prefix_length = min(prefix_length, common_prefix_length(prompts[0], prompt))
        prefix = list(prompts[0][:prefix_length])
        if not self.prefix_reuse:
            self.reset()
        try:
            self._check_cancel()
            reused, prefill_seconds = self._extend_prefix(prefix)
            scores: list[PromptScore] = []
            waves = 0
            started = time.perf_counter()
            for wave in self._waves(branches, prefix_length):
                self._check_cancel()
                waves += 1
                scores.extend(self._decode_branches(wave, prefix_length))
            suffix_seconds = time.perf_counter() - started
        except (NativeFailureError, CapacityError, CancelledWorkError):
            self.reset()
            raise
        timing = BatchTiming(
            prefix_tokens=prefix_length,
            reused_tokens=reused,
            suffix_tokens=sum(len(prompt) - prefix_length for prompt in prompts),
            prefill_seconds=prefill_seconds,
            suffix_seconds=suffix_seconds,
            branch_waves=waves,
        )
        return scores, timing

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise CancelledWorkError("cancelled: the server is shutting down")

    def reset(self) -> None:
        """Forget every cached token (after a failure, or to measure without reuse)."""
        llama_cpp.llama_memory_clear(self._memory, True)
        self._cached = []

    def _extend_prefix(self, prefix: list[int]) -> tuple[int, float]:
        """Make sequence 0 hold exactly `prefix`, evaluating only what the cache lacks."""
        reused = common_prefix_length(self._cached, prefix)
        if reused < len(self._cached) and not llama_cpp.llama_memory_seq_rm(
            self._memory, 0, reused, -1
        ):
            self.reset()  # e.g. recurrent or sliding-window caches cannot drop a tail
            reused = 0
        self._cached = prefix[:reused]
        started = time.perf_counter()
        if len(prefix) > reused:
            batch = llama_cpp.llama_batch_init(len(prefix) - reused, 0, 1)
            try:
                for offset, token in enumerate(prefix[reused:]):
                    self._put(batch, offset, token, reused + offset, [0], wants_logits=False)
                batch.n_tokens = len(prefix) - reused
                self._decode(batch)
            finally:
                llama_cpp.llama_batch_free(batch)
            self._cached = list(prefix)
        return reused, time.perf_counter() - started

    def _waves(self, items: list[_Branch], prefix_length: int) -> list[list[_Branch]]:
        """Group branches into batches that fit the free KV cells and sequence ids."""
        free_cells = self.kv_cells - prefix_length
        waves: list[list[_Branch]] = [[]]
        used_cells = used_sequences = 0
        for prompt, tokens in items:
            cells = len(prompt) - prefix_length + len(tokens)
            sequences = 1 + len(tokens)
            if cells > free_cells or sequences > self.max_branches:
                raise CapacityError(
                    f"a prompt needs {prefix_length + cells} KV cells and {sequences} "
                    f"sequences; the cache has {self.kv_cells} and {self.max_branches}"
                )
            if waves[-1] and (
                used_cells + cells > free_cells or used_sequences + sequences > self.max_branches
            ):
                waves.append([])
                used_cells = used_sequences = 0
            waves[-1].append((prompt, tokens))
            used_cells += cells
            used_sequences += sequences
        return waves

    def _decode_branches(self, wave: list[_Branch], prefix_length: int) -> list[PromptScore]:
        """Decode one wave: each suffix once, shared by its branch and its continuations."""
        total = sum(len(prompt) - prefix_length + len(tokens) for prompt, tokens in wave)
        widest = 1 + max(len(tokens) for _, tokens in wave)
        batch = llama_cpp.llama_batch_init(total, 0, widest)
        outputs: list[tuple[int, list[int]]] = []
        sequence = 0
        try:
            row = 0
            for prompt, tokens in wave:
                # The branch's own sequence comes first: llama.cpp masks by a token's first id.
                owned = list(range(sequence + 1, sequence + 2 + len(tokens)))
                sequence = owned[-1]
                for copy in owned:
                    llama_cpp.llama_memory_seq_cp(self._memory, 0, copy, -1, -1)
                suffix = prompt[prefix_length:]
                for offset, token in enumerate(suffix):
                    last = offset == len(suffix) - 1
                    self._put(batch, row, token, prefix_length + offset, owned, wants_logits=last)
                    row += 1
                last_row = row - 1
                next_rows = []
                for token, continuation in zip(tokens, owned[1:], strict=True):
                    self._put(batch, row, token, len(prompt), [continuation], wants_logits=True)
                    next_rows.append(row)
                    row += 1
                outputs.append((last_row, next_rows))
            batch.n_tokens = total
            self._decode(batch)
            scores = []
            for (prompt, tokens), (last_row, next_rows) in zip(wave, outputs, strict=True):
                next_logits = {
                    token: self._logits(next_row)
                    for token, next_row in zip(tokens, next_rows, strict=True)
                }
                scores.append(
                    PromptScore(
                        logits=self._logits(last_row),
                        input_tokens=len(prompt),
                        next_logits=next_logits,
                    )
                )
            return scores
        finally:
            llama_cpp.llama_batch_free(batch)
            for used in range(1, sequence + 1):
                llama_cpp.llama_memory_seq_rm(self._memory, used, -1, -1)

    def _logits(self, row: int) -> npt.NDArray[np.float32]:
        pointer = llama_cpp.llama_get_logits_ith(self._context, row)
        if not pointer:
            raise NativeFailureError(f"llama.cpp returned no logits for batch row {row}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    # -- generation (chat) ----------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str] = (),
    ) -> Generation:
        """Sample up to `max_new_tokens` after `prompt` in sequence 0, stopping at end of
        generation or at the first `stop` string (which is not returned)."""
        if not prompt or max_new_tokens < 1:
            raise ValueError("generation needs a prompt and at least one new token")
        if len(prompt) + max_new_tokens > self.kv_cells:
            raise CapacityError(
                f"{len(prompt)} prompt tokens plus {max_new_tokens} new tokens need more KV "
                f"cells than the cache has ({self.kv_cells})"
            )
        if not self.prefix_reuse:
            self.reset()
        sampler = self._sampler(sampling)
        try:
            self._check_cancel()
            reused, _ = self._extend_prefix(list(prompt[:-1]))
            self._decode_next(prompt[-1], len(prompt) - 1)
            text, count, finish = self._sample_loop(sampler, len(prompt), max_new_tokens, stop)
        except (NativeFailureError, CapacityError, CancelledWorkError):
            self.reset()
            raise
        finally:
            llama_cpp.llama_sampler_free(sampler)
        return Generation(
            text=text,
            prompt_tokens=len(prompt),
            completion_tokens=count,
            reused_tokens=reused,
            finish_reason=finish,
        )

    def _sample_loop(
        self, sampler: llama_cpp.llama_sampler_p, position: int, limit: int, stop: Sequence[str]
    ) -> tuple[str, int, Literal["stop", "length"]]:
        """Sample, check the stop rules, and decode each kept token at the next position."""
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        text = ""
        count = 0
        while True:
            token = int(llama_cpp.llama_sampler_sample(sampler, self._context, -1))
            if llama_cpp.llama_vocab_is_eog(self._vocab, token):
                return text + decoder.decode(b"", final=True), count, "stop"
            count += 1
            scanned = len(text)
            text += decoder.decode(self._piece_bytes(token))
            cut = _first_stop(text, stop, scanned)
            if cut is not None:
                return text[:cut], count, "stop"
            if count >= limit:
                return text + decoder.decode(b"", final=True), count, "length"
            self._check_cancel()
            self._decode_next(token, position)
            position += 1

    def _decode_next(self, token: int, position: int) -> None:
        """Append one token to sequence 0 with logits, keeping the prefix cache in step."""
        batch = llama_cpp.llama_batch_init(1, 0, 1)
        try:
            self._put(batch, 0, token, position, [0], wants_logits=True)
            batch.n_tokens = 1
            self._decode(batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        self._cached.append(token)

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
