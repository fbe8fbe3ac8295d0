"""One llama.cpp model and context that scores prompts by their last-position logits.

Two kinds of reuse make decisions cheap:
- across requests, sequence 0 keeps the previous prompt's KV cache and only the tokens
  after the longest common prefix are evaluated;
- within a shared-state request, the common prefix is evaluated once into sequence 0, then
  copied into one branch sequence per decision (a metadata copy in the unified KV cache)
  and every branch's suffix is decoded in one batch.
No token is ever generated. The engine is not thread-safe: callers hold its lock.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import llama_cpp._logger
import numpy as np
import numpy.typing as npt

from adapter.prompts import ANSWER_LETTERS, ChatTemplate, render_decision
from adapter.schema import Decision, Option

_ALL_LAYERS = 1_000_000
_MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ
_UBATCH_TOKENS = 512


class ModelLoadError(RuntimeError):
    """The model cannot be served: load failure, missing chat template or unusable letters."""


class NativeFailureError(RuntimeError):
    """llama.cpp reported an internal error; the context can no longer be trusted."""


class CapacityError(RuntimeError):
    """A batch did not fit the KV cache; the request can be retried smaller."""


@dataclass(frozen=True)
class PromptScore:
    """Last-position logits of one prompt and how its tokens were obtained."""

    logits: npt.NDArray[np.float32]
    input_tokens: int


@dataclass(frozen=True)
class BatchTiming:
    prefix_tokens: int
    reused_tokens: int
    suffix_tokens: int
    prefill_seconds: float
    suffix_seconds: float
    branch_waves: int


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
    ) -> None:
        llama_cpp._logger.set_verbose(False)  # native INFO chatter off; errors still print
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = _ALL_LAYERS if n_gpu_layers < 0 else n_gpu_layers
        self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {gguf}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
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
        self.chat_template = ChatTemplate(
            self._chat_template_source(gguf),
            bos_token=self.piece(llama_cpp.llama_vocab_bos(self._vocab), special=True),
            eos_token=self.piece(llama_cpp.llama_vocab_eos(self._vocab), special=True),
        )
        self.slot_token_ids = self._check_answer_slots()

    # -- model facts ---------------------------------------------------------------------

    def _chat_template_source(self, gguf: Path) -> str:
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        if not raw:
            self.close()
            raise ModelLoadError(
                f"{gguf.name} has no chat template (tokenizer.chat_template); the decision "
                "prompt is rendered with the model's own template, so one is required"
            )
        return bytes(raw).decode("utf-8")

    def _check_answer_slots(self) -> tuple[int, ...]:
        """Each answer letter must be one distinct token appended cleanly after a prompt."""
        probe = Decision(
            id="probe",
            state="Probe evidence.",
            question="Which option applies?",
            options=tuple(Option(letter, f"Option {letter}.") for letter in ANSWER_LETTERS),
        )
        prompt = render_decision(self.chat_template, probe)
        base = self.tokenize(prompt)
        slots: list[int] = []
        for letter in ANSWER_LETTERS:
            extended = self.tokenize(prompt + letter)
            added = extended[len(base) :]
            if extended[: len(base)] != base or len(added) != 1:
                self.close()
                raise ModelLoadError(
                    f"answer letter {letter!r} does not append as exactly one token after the "
                    f"prompt (got {len(added)} new tokens, prefix kept: "
                    f"{extended[: len(base)] == base}); this model cannot be scored by letters"
                )
            if self.piece(added[0]) != letter:
                self.close()
                raise ModelLoadError(
                    f"answer letter {letter!r} token {added[0]} reads back as "
                    f"{self.piece(added[0])!r}"
                )
            slots.append(added[0])
        if len(set(slots)) != len(slots):
            self.close()
            raise ModelLoadError("answer letters A..P do not map to distinct tokens")
        return tuple(slots)

    def tokenize(self, text: str) -> list[int]:
        """Tokenize rendered template text, parsing its special tokens, adding BOS if due."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buffer, capacity, False, True
        )
        if count < 0:
            capacity = -count
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, False, True
            )
        tokens = list(buffer[:count])
        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if llama_cpp.llama_vocab_get_add_bos(self._vocab) and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

    def piece(self, token: int, *, special: bool = False) -> str:
        buffer = ctypes.create_string_buffer(256)
        length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, 256, 0, special)
        return buffer.raw[: max(length, 0)].decode("utf-8", errors="replace")

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

    def score(self, prompts: Sequence[Sequence[int]]) -> tuple[list[PromptScore], BatchTiming]:
        """Score every prompt; they share whatever token prefix they have in common.

        The common prefix (reused from the previous call where it matches) is decoded once
        into sequence 0; each prompt's remaining tokens are decoded as a branch, as many
        branches per batch as the KV cache and sequence count allow.
        """
        if not prompts or any(len(prompt) == 0 for prompt in prompts):
            raise ValueError("every prompt needs at least one token")
        longest = max(len(prompt) for prompt in prompts)
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
            reused, prefill_seconds = self._extend_prefix(prefix)
            scores: list[PromptScore] = []
            waves = 0
            started = time.perf_counter()
            for wave in self._waves(prompts, prefix_length):
                waves += 1
                scores.extend(self._decode_branches(wave, prefix_length))
            suffix_seconds = time.perf_counter() - started
        except (NativeFailureError, CapacityError):
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
                    self._put(batch, offset, token, reused + offset, 0, wants_logits=False)
                batch.n_tokens = len(prefix) - reused
                self._decode(batch)
            finally:
                llama_cpp.llama_batch_free(batch)
            self._cached = list(prefix)
        return reused, time.perf_counter() - started

    def _waves(
        self, prompts: Sequence[Sequence[int]], prefix_length: int
    ) -> list[list[Sequence[int]]]:
        free_cells = self.kv_cells - prefix_length
        waves: list[list[Sequence[int]]] = [[]]
        used = 0
        for prompt in prompts:
            need = len(prompt) - prefix_length
            if need > free_cells:
                raise CapacityError(
                    f"a prompt needs {prefix_length + need} KV cells; the cache has {self.kv_cells}"
                )
            if waves[-1] and (used + need > free_cells or len(waves[-1]) >= self.max_branches):
                waves.append([])
                used = 0
            waves[-1].append(prompt)
            used += need
        return waves

    def _decode_branches(self, wave: list[Sequence[int]], prefix_length: int) -> list[PromptScore]:
        total = sum(len(prompt) - prefix_length for prompt in wave)
        batch = llama_cpp.llama_batch_init(total, 0, 1)
        output_rows: list[int] = []
        try:
            row = 0
            for branch, prompt in enumerate(wave, start=1):
                llama_cpp.llama_memory_seq_cp(self._memory, 0, branch, -1, -1)
                suffix = prompt[prefix_length:]
                for offset, token in enumerate(suffix):
                    last = offset == len(suffix) - 1
                    self._put(batch, row, token, prefix_length + offset, branch, wants_logits=last)
                    row += 1
                output_rows.append(row - 1)
            batch.n_tokens = total
            self._decode(batch)
            scores = []
            for prompt, output_row in zip(wave, output_rows, strict=True):
                pointer = llama_cpp.llama_get_logits_ith(self._context, output_row)
                if not pointer:
                    raise NativeFailureError(
                        f"llama.cpp returned no logits for batch row {output_row}"
                    )
                logits = np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()
                scores.append(PromptScore(logits=logits, input_tokens=len(prompt)))
            return scores
        finally:
            llama_cpp.llama_batch_free(batch)
            for branch in range(1, len(wave) + 1):
                llama_cpp.llama_memory_seq_rm(self._memory, branch, -1, -1)

    @staticmethod
    def _put(
        batch: llama_cpp.llama_batch,
        row: int,
        token: int,
        position: int,
        sequence: int,
        *,
        wants_logits: bool,
    ) -> None:
        batch.token[row] = token
        batch.pos[row] = position  # type: ignore[call-overload]  # binding mistypes pos
        batch.n_seq_id[row] = 1
        batch.seq_id[row][0] = sequence
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
