"""The tiny random Qwen3.5 (`qwen35`) loads in llama.cpp as a hybrid model whose memory
copies whole sequences exactly and refuses to cut a sequence's tail."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import numpy as np
import numpy.typing as npt
import pytest

from model_build.tiny_gguf import (
    CHAT_TEMPLATE,
    tiny_vocabulary,
    write_tiny_gguf,
    write_tiny_hybrid_gguf,
)

STREAMS = 4
STREAM_CELLS = 64


@dataclass(frozen=True)
class Row:
    token: int
    position: int
    seq: int
    logits: bool = False


@dataclass
class Native:
    model: llama_cpp.llama_model_p
    context: llama_cpp.llama_context_p
    memory: llama_cpp.llama_memory_t
    n_vocab: int

    def decode(self, rows: Sequence[Row]) -> None:
        batch = llama_cpp.llama_batch_init(len(rows), 0, 1)
        try:
            for index, row in enumerate(rows):
                batch.token[index] = row.token
                batch.pos[index] = row.position
                batch.n_seq_id[index] = 1
                batch.seq_id[index][0] = row.seq
                batch.logits[index] = row.logits
            batch.n_tokens = len(rows)
            assert llama_cpp.llama_decode(self.context, batch) == 0
        finally:
            llama_cpp.llama_batch_free(batch)

    def logits(self, row: int) -> npt.NDArray[np.float32]:
        pointer = llama_cpp.llama_get_logits_ith(self.context, row)
        assert pointer
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()


def _prompt(seq: int, tokens: Sequence[int], *, start: int = 0) -> list[Row]:
    last = len(tokens) - 1
    return [Row(t, start + i, seq, logits=i == last) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def hybrid_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hybrid_gguf(tmp_path_factory.mktemp("hybrid") / "tiny-qwen35.gguf")


@pytest.fixture(scope="module")
def model(hybrid_gguf: Path) -> Iterator[llama_cpp.llama_model_p]:
    loaded = llama_cpp.llama_model_load_from_file(
        str(hybrid_gguf).encode(), llama_cpp.llama_model_default_params()
    )
    assert loaded, "llama.cpp refused the tiny qwen35 GGUF"
    yield loaded
    llama_cpp.llama_model_free(loaded)


@pytest.fixture
def native(model: llama_cpp.llama_model_p) -> Iterator[Native]:
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = STREAMS
    params.n_ctx = STREAMS * STREAM_CELLS
    params.kv_unified = False  # a stream per sequence, as the adapter runs it
    params.n_batch = params.n_ubatch = STREAM_CELLS
    params.n_threads = params.n_threads_batch = 2
    context = llama_cpp.llama_init_from_model(model, params)
    assert context
    vocab = llama_cpp.llama_model_get_vocab(model)
    try:
        yield Native(
            model,
            context,
            llama_cpp.llama_get_memory(context),
            llama_cpp.llama_vocab_n_tokens(vocab),
        )
    finally:
        llama_cpp.llama_free(context)


def test_same_arguments_give_the_same_bytes(tmp_path: Path, hybrid_gguf: Path) -> None:
    again = write_tiny_hybrid_gguf(tmp_path / "again.gguf")
    assert again.read_bytes() == hybrid_gguf.read_bytes()
    other = write_tiny_hybrid_gguf(tmp_path / "other.gguf", seed=1)
    assert other.read_bytes() != hybrid_gguf.read_bytes()


def test_it_is_a_hybrid_with_the_tiny_llama_tokenizer_and_template(
    tmp_path: Path, model: llama_cpp.llama_model_p
) -> None:
    assert llama_cpp.llama_model_is_hybrid(model)
    assert not llama_cpp.llama_model_is_recurrent(model)
    assert llama_cpp.llama_model_n_layer(model) == 4
    assert llama_cpp.llama_model_n_embd(model) == 64
    template = llama_cpp.llama_model_chat_template(model, None)
    assert template is not None
    assert template.decode() == CHAT_TEMPLATE
    llama = llama_cpp.llama_model_load_from_file(
        str(write_tiny_gguf(tmp_path / "llama.gguf")).encode(),
        llama_cpp.llama_model_default_params(),
    )
    assert llama
    try:
        text = b"<|im_start|>user\nthe answer in A<|im_end|>\n"

        def tokenize(m: llama_cpp.llama_model_p) -> list[int]:
            vocab = llama_cpp.llama_model_get_vocab(m)
            out = (llama_cpp.llama_token * 64)()
            n = llama_cpp.llama_tokenize(vocab, text, len(text), out, 64, False, True)
            assert n > 0
            return list(out[:n])

        assert tokenize(model) == tokenize(llama)
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        assert n_vocab == len(tiny_vocabulary().tokens)
    finally:
        llama_cpp.llama_model_free(llama)


def test_two_sequences_decode_to_finite_logits(native: Native) -> None:
    first, second = [10, 20, 30, 40, 50], [60, 70, 80]
    native.decode([*_prompt(0, first), *_prompt(1, second)])
    a, b = native.logits(len(first) - 1), native.logits(len(first) + len(second) - 1)
    assert np.isfinite(a).all()
    assert np.isfinite(b).all()
    assert not np.array_equal(a, b)
    assert llama_cpp.llama_memory_seq_pos_max(native.memory, 0) == len(first) - 1
    assert llama_cpp.llama_memory_seq_pos_max(native.memory, 1) == len(second) - 1


def test_a_whole_stream_copy_is_exact(native: Native) -> None:
    prompt = [5, 6, 7, 8, 9, 11]
    native.decode(_prompt(0, prompt))
    llama_cpp.llama_memory_seq_cp(native.memory, 0, 2, -1, -1)
    assert llama_cpp.llama_memory_seq_pos_max(native.memory, 2) == len(prompt) - 1
    position = len(prompt)
    native.decode([Row(99, position, 0, logits=True), Row(99, position, 2, logits=True)])
    original, copy = native.logits(0), native.logits(1)
    assert np.isfinite(original).all()
    assert original.tobytes() == copy.tobytes()


def test_a_partial_cut_is_refused_and_a_whole_one_is_not(native: Native) -> None:
    prompt = [12, 13, 14, 15, 16]
    native.decode(_prompt(3, prompt))
    assert not llama_cpp.llama_memory_seq_rm(native.memory, 3, 2, -1)
    assert llama_cpp.llama_memory_seq_pos_max(native.memory, 3) == len(prompt) - 1
    assert llama_cpp.llama_memory_seq_rm(native.memory, 3, -1, -1)
    assert llama_cpp.llama_memory_seq_pos_max(native.memory, 3) == -1


def test_the_binding_exposes_the_experimental_rollback_setting(
    model: llama_cpp.llama_model_p,
) -> None:
    # llama.cpp's n_rs_seq (recurrent-state snapshots for short rollbacks, qwen35 among the
    # few architectures that support it) is a field of the binding's llama_context_params.
    params = llama_cpp.llama_context_default_params()
    assert params.n_rs_seq == 0
    params.n_seq_max = 2
    params.n_ctx = 2 * STREAM_CELLS
    params.kv_unified = False
    params.n_rs_seq = 2
    context = llama_cpp.llama_init_from_model(model, params)
    assert context
    try:
        assert llama_cpp.llama_n_rs_seq(context) == 2
    finally:
        llama_cpp.llama_free(context)
