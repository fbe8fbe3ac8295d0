"""What a new question about a resident state costs on each memory kind, and whether it is exact.

A decision prompt is a system turn, a state and a question. Asked a second question about
the same state, the engine should decode only what is new: on plain and sliding-window
attention by cutting and copying the resident prefix, on whole-stream (hybrid) memory from
the state's checkpoint (docs/adapter.md, "Memory kinds"). For each model this decodes one
prompt on an empty cache, then a second question about the same state, and prints the rows
evaluated for each, the tokens reused and whether the second answer is bit-identical to a
fresh engine's. The tiny random models (one per kind, written into --out) run on any
machine; `--gguf` adds real models (their tokens are random ids: cost and exactness only).

    python -m bench.memory_kinds [--out DIR] [--gguf PATH ...] [--state-tokens N]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np

from adapter.backends import cpu_backend
from adapter.core.engine import LlamaEngine
from model_build.tiny_gguf import write_tiny_gguf, write_tiny_hybrid_gguf, write_tiny_swa_gguf

SYSTEM_TOKENS = 40
QUESTION_TOKENS = 24


def _engine(gguf: Path, threads: int) -> LlamaEngine:
    return LlamaEngine(
        gguf,
        stream_cells=4096,
        max_branches=8,
        threads=threads,
        n_gpu_layers=0,
        weight_buffers="auto",
        cpu=cpu_backend(None),
    )


def measure(gguf: Path, state_tokens: int, threads: int) -> dict[str, object]:
    """One prompt on an empty cache, then a second question about its state."""
    rng = random.Random(37)  # noqa: S311 - token ids, seeded: runs repeat
    system, state, first, second = (
        [rng.randrange(3, 200) for _ in range(count)]
        for count in (SYSTEM_TOKENS, state_tokens, QUESTION_TOKENS, QUESTION_TOKENS)
    )
    cuts = [SYSTEM_TOKENS, SYSTEM_TOKENS + state_tokens]  # where a checkpoint may go
    engine, fresh = _engine(gguf, threads), _engine(gguf, threads)
    try:
        started = time.perf_counter()
        _, opened = engine.score([system + state + first], boundaries=[cuts])
        first_seconds = time.perf_counter() - started
        started = time.perf_counter()
        (asked,), again = engine.score([system + state + second], boundaries=[cuts])
        second_seconds = time.perf_counter() - started
        (alone,), _ = fresh.score([system + state + second])
        return {
            "model": gguf.name,
            "memory_kind": engine.memory_kind,
            "prompt_tokens": again.input_tokens,
            "first_evaluated": opened.evaluated_tokens,
            "second_evaluated": again.evaluated_tokens,
            "second_reused": again.reused_tokens,
            "time_ratio": round(second_seconds / first_seconds, 3),
            "bit_identical": bool(np.array_equal(asked.logits, alone.logits)),
        }
    finally:
        engine.close()
        fresh.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/bench/memory-kinds"))
    parser.add_argument("--gguf", type=Path, action="append", default=[])
    parser.add_argument("--state-tokens", type=int, default=1300)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    models = [
        write_tiny_gguf(args.out / "tiny-llama.gguf"),
        write_tiny_swa_gguf(args.out / "tiny-gemma3.gguf"),
        write_tiny_hybrid_gguf(args.out / "tiny-qwen35.gguf"),
        *args.gguf,
    ]
    columns = [
        "model",
        "memory_kind",
        "prompt_tokens",
        "first_evaluated",
        "second_evaluated",
        "second_reused",
        "time_ratio",
        "bit_identical",
    ]
    print(" | ".join(columns))
    for gguf in models:
        row = measure(gguf, args.state_tokens, args.threads)
        print(" | ".join(str(row[column]) for column in columns), flush=True)


if __name__ == "__main__":
    main()
