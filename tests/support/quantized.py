"""Tiny models in llama.cpp's quantized formats, quantized by llama.cpp itself."""

from __future__ import annotations

from pathlib import Path

import llama_cpp


def quantize(source: Path, target: Path, file_type: str, *, requantize: bool = False) -> Path:
    """`source` quantized to `file_type` (a `LLAMA_FTYPE_MOSTLY_*` suffix: Q4_0, Q4_K_S,
    Q4_K_M, ...) at `target`; K-quants need rows of 256 weights (`n_embd=256`).
    `requantize`: `source` is itself quantized (its weights dequantized, then quantized)."""
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = requantize
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    return target
