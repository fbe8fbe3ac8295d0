"""One chat generation: a token per step, in a KV stream of its own.

Threads: the scheduler's worker only (it owns the engine this drives). A run reaches the
engine only through `StreamHost`, the few stream operations it needs; whether its stream
was emptied (the engine's `reset` after a failed pass) it learns from the engine's reset
counter, so nothing outside reaches into a run.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import llama_cpp

from adapter.core.failures import RefusedCutError
from adapter.core.layout import Copy, StreamCache


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


class StreamHost(Protocol):
    """What a generation may do to the engine: take a prefix, decode, sample, empty."""

    @property
    def cache(self) -> StreamCache: ...

    @property
    def resets(self) -> int:
        """How many times every stream was emptied; a change means re-read the context."""
        ...

    def take(self, copy: Copy) -> None: ...

    def decode_tokens(self, seq: int, tokens: Sequence[int], start: int) -> None: ...

    def sample(self, sampler: llama_cpp.llama_sampler_p) -> int: ...

    def empty(self, seq: int) -> None:
        """Drop a stream's cells (nothing once the context is freed)."""
        ...

    def check_cancel(self) -> None: ...


class Pieces(Protocol):
    """What a generation reads of the vocabulary."""

    def is_end(self, token: int) -> bool: ...

    def piece_bytes(self, token: int, *, special: bool = False) -> bytes: ...


def first_stop(text: str, stop: Sequence[str], scanned: int) -> int | None:
    """Where the earliest stop string starts, looking only at text not yet scanned."""
    hits = [
        found
        for marker in stop
        if (found := text.find(marker, max(0, scanned - len(marker) + 1))) >= 0
    ]
    return min(hits) if hits else None


def stop_prefix_length(text: str, stop: Sequence[str]) -> int:
    """How many of the text's last characters could still begin a stop string: the longest
    end of `text` that is the start (not the whole) of one. A stream holds them back until
    the next tokens decide, so no part of a stop string is ever sent."""
    longest = 0
    for marker in stop:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


def new_sampler(sampling: Sampling) -> llama_cpp.llama_sampler_p:
    """A llama.cpp sampler chain: greedy at temperature 0, else top-p, temperature, draw."""
    params = llama_cpp.llama_sampler_chain_default_params()
    chain: llama_cpp.llama_sampler_p = llama_cpp.llama_sampler_chain_init(params)
    if sampling.temperature <= 0:
        llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_greedy())
        return chain
    seed = llama_cpp.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_top_p(sampling.top_p, 1))
    llama_cpp.llama_sampler_chain_add(
        chain, llama_cpp.llama_sampler_init_temp(sampling.temperature)
    )
    llama_cpp.llama_sampler_chain_add(chain, llama_cpp.llama_sampler_init_dist(seed))
    return chain


class GenerationRun:
    """One chat generation, a token per `step`, in a sequence of its own.

    Sampling reads the logits of the last decode, so each step decodes the previous token
    and samples the next at once; scoring passes may run between steps, and never touch its
    stream. It starts from a copy of the stream sharing its longest prefix; its own stream is
    emptied at `close` (one-row decodes round differently, so scoring never reuses it). After
    the engine's streams were emptied (a failed pass) the next step re-reads the context.
    """

    def __init__(
        self,
        host: StreamHost,
        vocab: Pieces,
        prompt: list[int],
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
    ) -> None:
        self._host = host
        self._vocab = vocab
        self.prompt_tokens = len(prompt)
        self._context = prompt
        self._limit = max_new_tokens
        self._stop = stop
        self._sampler: llama_cpp.llama_sampler_p | None = new_sampler(sampling)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._seq = host.cache.reserve()
        self._resets_seen: int | None = None  # the host's reset count when last caught up
        self._decoded = 0  # context tokens the sequence holds
        self._text = ""
        self._sent = 0  # characters of `_text` handed out by `new_text` (a stream)
        self._count = 0
        self._finish: Literal["stop", "length"] | None = None
        self.reused_tokens = -1

    def step(self) -> bool:
        """Decode what is due and sample one token; True once finished."""
        if self._finish is not None:
            return True
        self._host.check_cancel()
        self._catch_up()
        assert self._sampler is not None  # set until close()
        token = self._host.sample(self._sampler)
        if self._vocab.is_end(token):
            return self._end("stop", self._decoder.decode(b"", final=True))
        self._count += 1
        scanned = len(self._text)
        self._text += self._decoder.decode(self._vocab.piece_bytes(token))
        cut = first_stop(self._text, self._stop, scanned)
        if cut is not None:
            self._text = self._text[:cut]
            return self._end("stop", "")
        if self._count >= self._limit:
            return self._end("length", self._decoder.decode(b"", final=True))
        self._context.append(token)
        return False

    def new_text(self) -> str:
        """The text a stream may send now that it has not yet: what the tokens so far say
        for certain. Bytes of an unfinished character are still in the UTF-8 decoder, and
        an end that may begin a stop string is held back (`stop_prefix_length`) until a
        later token completes or rules it out; once finished, all of the rest. So the
        pieces, joined, are exactly `result().text`: the held end can only be cut, never
        sent, and what was sent can never be cut (a stop string starting there would have
        been held)."""
        end = len(self._text)
        if self._finish is None:
            end -= stop_prefix_length(self._text, self._stop)
        piece = self._text[self._sent : end]
        self._sent = end
        return piece

    def _catch_up(self) -> None:
        host = self._host
        if self._resets_seen != host.resets:  # first step, or the streams were emptied
            base, length = host.cache.longest_match(self._context[:-1])
            try:
                host.take(Copy(base if length > 0 else None, self._seq, length))
            except RefusedCutError:  # the prefix cannot be had: read the context from scratch
                length = 0
                host.take(Copy(None, self._seq, 0))
            if self.reused_tokens < 0:
                self.reused_tokens = length
            self._decoded = length
            self._resets_seen = host.resets
        host.decode_tokens(self._seq, self._context, self._decoded)
        self._decoded = len(self._context)

    def _end(self, finish: Literal["stop", "length"], tail: str) -> bool:
        self._text += tail
        self._finish = finish
        return True

    def close(self) -> None:
        """Free the sampler and give the stream back emptied."""
        if self._sampler is not None:
            llama_cpp.llama_sampler_free(self._sampler)
            self._sampler = None
        self._host.empty(self._seq)
        self._host.cache.release(self._seq)

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
