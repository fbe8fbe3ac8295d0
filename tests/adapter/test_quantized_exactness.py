"""Exact scoring on quantized weights: the kernels llama.cpp picks by a micro-batch's size.

The f32 test models run the same kernels at any row count; quantized ones do not. ggml's CPU
backend multiplies K-quant weights with tiled kernels from 8 rows on and per-row dot
products below, and CPU_REPACK's Q4_K products take rows four at a time and the rest one at
a time: both round differently, so a prompt whose last rows rode in a small micro-batch
(reuse, a stem, a busy pass) scored otherwise than alone (0.12 on a tiny Q6_K llama, 5.6 on
gemma-3-270m Q4_K_M). The engine pins the tiled kernels for every size
(`adapter.core.native.pin_matmul_kernels`) and `auto` keeps CPU_REPACK only for weights
whose repacked products were measured exact (Q4_0): these tests hold both, bit for bit.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from adapter.backends import cpu_backend, load_backends
from adapter.core.failures import ModelLoadError
from adapter.core.native import weight_types
from model_build.tiny_gguf import write_tiny_gguf, write_tiny_swa_gguf
from tests.adapter.test_batching import _histories_match_alone
from tests.support.models import open_engine
from tests.support.quantized import quantize

# K-quants need rows of 256 weights; 256 wide is still a 2 MB model that loads at once.
WIDTH = 256


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("quantized")
    llama = write_tiny_gguf(folder / "llama.gguf", n_embd=WIDTH)
    gemma = write_tiny_swa_gguf(folder / "gemma3.gguf", n_embd=WIDTH)
    return {
        "llama-Q4_K_S": quantize(llama, folder / "llama-q4_k_s.gguf", "Q4_K_S"),
        "gemma3-Q4_K_M": quantize(gemma, folder / "gemma3-q4_k_m.gguf", "Q4_K_M"),
        "llama-Q4_0": quantize(llama, folder / "llama-q4_0.gguf", "Q4_0"),
    }


@pytest.mark.parametrize("name", ["llama-Q4_K_S", "gemma3-Q4_K_M"])
def test_a_prompts_last_rows_decoded_apart_score_as_the_whole_prompt(
    quantized: dict[str, Path], name: str
) -> None:
    """The case that showed it: a prompt whose last 2..7 rows are decoded after a reused
    prefix (a micro-batch of fewer than 8 rows) against the prompt decoded at once."""
    engine = open_engine(quantized[name], stream_cells=256)
    try:
        prompt = [random.Random(7).randrange(3, 200) for _ in range(30)]
        engine.reset()
        (whole,), _ = engine.score([prompt])
        for rest in range(2, 8):
            engine.reset()
            engine.score([prompt[:-rest]])
            (split,), _ = engine.score([prompt])
            assert split.reused_tokens == len(prompt) - rest
            assert np.array_equal(split.logits, whole.logits), rest
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["llama-Q4_K_S", "gemma3-Q4_K_M", "llama-Q4_0"])
def test_quantized_models_score_bit_identically_whatever_the_history(
    quantized: dict[str, Path], name: str
) -> None:
    _histories_match_alone(quantized[name], trials=12, tolerance=0.0)


def test_auto_keeps_the_repack_for_q4_0_and_refuses_it_for_k_quants(
    quantized: dict[str, Path],
) -> None:
    load_backends(None)
    if "CPU_REPACK" not in cpu_backend(None).extra_buffer_types:
        pytest.skip("this CPU backend offers no CPU_REPACK buffers")
    for name, repacked in (("llama-Q4_0", True), ("llama-Q4_K_S", False)):
        engine = open_engine(quantized[name], stream_cells=256)
        try:
            description = engine.description()
            weights = description["weight_buffers"]
            assert isinstance(weights, dict)
            assert ("CPU_REPACK" in weights["weights_in"]) is repacked, name
            assert description["exact_scoring"] is True
        finally:
            engine.close()


def test_the_weight_types_are_read_from_the_header_as_gguf_reads_them(
    quantized: dict[str, Path], tmp_path: Path
) -> None:
    for path in quantized.values():
        expected = frozenset(t.tensor_type.name for t in GGUFReader(path).tensors)
        assert weight_types(path) == expected
    assert "Q4_K" in weight_types(quantized["llama-Q4_K_S"])
    assert weight_types(quantized["llama-Q4_0"]) >= {"Q4_0"}
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(quantized["llama-Q4_0"].read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="cannot read the tensor types"):
        weight_types(broken)
