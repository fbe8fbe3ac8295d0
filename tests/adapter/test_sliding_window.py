"""Sliding-window memory (Gemma 2 and 3: llama.cpp's `llama_kv_cache_iswa`) as the engine runs it.

Exactness and reuse on this kind are the architecture-parametrized tests' (`tiny_any_gguf`
runs them on the tiny gemma3 too); here is what is particular to it: the tiny model really
slides, every cell of a stream is kept and paid for, and a stream that lost its first
cells anyway is never reused.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import pytest

from adapter.core.engine import LlamaEngine
from adapter.core.native import measure_stream_cost
from model_build.tiny_gguf import write_tiny_swa_gguf
from tests.support.models import open_engine

WINDOW = 8  # the tiny gemma3's (tests/conftest.py)


@pytest.fixture
def engine(tiny_swa_gguf: Path) -> Iterator[LlamaEngine]:
    opened = open_engine(tiny_swa_gguf, stream_cells=256)
    yield opened
    opened.close()


def test_same_arguments_give_the_same_bytes(tmp_path: Path, tiny_swa_gguf: Path) -> None:
    assert write_tiny_swa_gguf(tmp_path / "again.gguf").read_bytes() == tiny_swa_gguf.read_bytes()
    other = write_tiny_swa_gguf(tmp_path / "other.gguf", seed=1)
    assert other.read_bytes() != tiny_swa_gguf.read_bytes()


def test_the_engine_sees_a_sliding_window_model(engine: LlamaEngine) -> None:
    description = engine.description()
    assert description["memory_kind"] == "sliding_window"
    assert description["sliding_window"] == WINDOW
    assert description["recurrent_memory"] is False
    assert engine.cache.whole_only is False  # prefixes are cut and copied as on plain attention


def test_the_window_slides(tmp_path: Path, tiny_swa_gguf: Path) -> None:
    """The same weights with a window wider than the prompt: a prompt within the window
    scores alike on both, a longer one does not (its sliding layers saw less)."""
    wide = open_engine(write_tiny_swa_gguf(tmp_path / "wide.gguf", sliding_window=4096))
    narrow = open_engine(tiny_swa_gguf)
    try:
        rng = random.Random(3)
        prompt = [rng.randrange(3, 200) for _ in range(4 * WINDOW)]
        for tokens, alike in ((prompt[:WINDOW], True), (prompt, False)):
            (on_wide,), _ = wide.score([tokens])
            (on_narrow,), _ = narrow.score([tokens])
            assert bool((on_wide.logits == on_narrow.logits).all()) is alike
    finally:
        wide.close()
        narrow.close()


def test_every_cell_of_both_caches_is_counted(tiny_swa_gguf: Path) -> None:
    """With `swa_full` the sliding layers keep a stream's every cell, as the full ones do:
    the KV budget's cost per cell is all four layers' keys and values in f16."""
    model = llama_cpp.llama_model_load_from_file(
        str(tiny_swa_gguf).encode(), llama_cpp.llama_model_default_params()
    )
    try:
        n_layer, head_dim, n_head_kv, f16 = 4, 16, 1, 2
        cost = measure_stream_cost(model)
        assert cost.cell_bytes == n_layer * 2 * head_dim * n_head_kv * f16
        assert cost.state_bytes == 0
    finally:
        llama_cpp.llama_model_free(model)


def test_a_stream_that_lost_its_first_cells_is_not_reused(engine: LlamaEngine) -> None:
    """What a sliding-window cache may do when it runs out of cells (reuse a cell every later
    position has left behind, then drop the positions before it) is simulated by cutting a
    resident stream's first cells: the engine forgets that stream instead of reusing a
    prefix whose window has holes."""
    prompt = [random.Random(5).randrange(3, 200) for _ in range(3 * WINDOW)]
    engine.score([prompt])
    seq, held = engine.cache.longest_match(prompt)
    assert seq is not None
    assert held == len(prompt)
    memory = llama_cpp.llama_get_memory(engine._context)
    assert llama_cpp.llama_memory_seq_rm(memory, seq, 0, 3)
    engine._forget_truncated([seq])
    assert engine.truncated == 1
    assert engine.held(prompt) == 0
    (again,), _ = engine.score([prompt])
    assert again.reused_tokens == 0
