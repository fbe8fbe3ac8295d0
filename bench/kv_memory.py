"""What SEMIF_KV_MEMORY buys on a model: streams, cache size, load time and peak memory.

Each budget is loaded in a fresh process (peak memory is per process): the service as the
server builds it (`load_service`), then one line of figures. The defaults compare `auto`
with a budget that holds all 32 streams, on the embedded model. `--copy` measures instead
what a whole-stream copy costs in rows decoded (the price charges one row per
adapter.core.layout.COPY_CELLS_PER_ROW cells of a stream).

    python -m bench.kv_memory [--gguf PATH] [--threads N] [BUDGET ...]
    python -m bench.kv_memory --copy [--gguf PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from adapter.backends import cpu_backend
from adapter.core.engine import LlamaEngine
from adapter.core.layout import Copy
from adapter.kv_memory import MAX_STREAMS, KvBudget
from adapter.runtime import load_service
from adapter.settings import Settings
from bench.runner import DEFAULT_MODEL_CACHE
from model_build.embedded import fetch_embedded_model


def measure(gguf: Path, budget: str, threads: int) -> dict[str, object]:
    """Load the service once with this budget, in this process, and say what it cost."""
    started = time.perf_counter()
    service = load_service(
        Settings(gguf_path=gguf, threads=threads, kv_memory=KvBudget.parse(budget))
    )
    seconds = time.perf_counter() - started
    status = Path("/proc/self/status").read_text().splitlines()
    peak = int(next(line for line in status if line.startswith("VmHWM")).split()[1]) * 1024
    plan = service.engine.memory
    service.close(5)
    return {
        "budget": budget,
        "streams": plan.streams,
        "stream_cells": plan.stream_cells,
        "cache_mib": round(plan.bytes / (1 << 20), 1),
        "load_seconds": round(seconds, 2),
        "peak_mib": round(peak / (1 << 20), 1),
        "peak_vs_gguf": round(peak / gguf.stat().st_size, 2),
    }


def copy_cost(gguf: Path, stream_cells: int, threads: int, repeats: int = 8) -> dict[str, float]:
    """Median seconds of a whole-stream copy (a copy, then a two-row decode, less the same
    decode without a copy) and of one row of a 512-row prompt, and their ratio."""
    engine = LlamaEngine(
        gguf,
        stream_cells=stream_cells,
        max_branches=MAX_STREAMS - 1,
        threads=threads,
        n_gpu_layers=0,
        weight_buffers="auto",
        cpu=cpu_backend(None),
    )
    try:
        vocab = engine.vocab.n_vocab - 3  # plain tokens: any id past the first few

        def tokens(count: int, offset: int) -> list[int]:
            return [3 + (offset + index) % vocab for index in range(count)]

        prompt = tokens(300, 0)
        engine.score([prompt])
        source = next(seq for seq, tokens in enumerate(engine.cache.held) if len(tokens))
        copied, plain = [], []
        targets = [seq for seq in range(MAX_STREAMS) if seq != source][: 2 * repeats]
        for index, target in enumerate(targets):
            started = time.perf_counter()
            if index < repeats:
                engine.take(Copy(source, target, len(prompt)))  # runs before the next decode
                engine.decode_tokens(target, [*prompt, 5, 6], len(prompt))
                copied.append(time.perf_counter() - started)
            else:
                engine.decode_tokens(target, [5, 6], 0)
                plain.append(time.perf_counter() - started)
        engine.reset()
        row = timed_score(engine, tokens(512, 7)) / 512
    finally:
        engine.close()
    copy = statistics.median(copied) - statistics.median(plain)
    return {
        "stream_cells": engine.stream_cells,
        "copy_seconds": copy,
        "row_seconds": row,
        "copy_rows": copy / row,
    }


def timed_score(engine: LlamaEngine, prompt: list[int]) -> float:
    started = time.perf_counter()
    engine.score([prompt])
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("budgets", nargs="*", default=["auto", "3.5GiB"])
    parser.add_argument("--gguf", type=Path, help="default: the embedded model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one budget
    parser.add_argument("--copy", action="store_true", help="a whole-stream copy, in rows")
    args = parser.parse_args(argv)
    gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
    if args.copy:
        for cells in (1024, 4097):
            cost = copy_cost(gguf, cells, args.threads)
            print(
                f"a {cost['stream_cells']:.0f}-cell stream: copy {cost['copy_seconds'] * 1000:.1f}"
                f" ms, a row {cost['row_seconds'] * 1000:.2f} ms: {cost['copy_rows']:.1f} rows "
                f"({cost['stream_cells'] / cost['copy_rows']:.0f} cells a row)"
            )
        return
    if args.one:
        print(json.dumps(measure(gguf, args.one, args.threads)))
        return
    for budget in args.budgets:
        child = [sys.executable, "-m", "bench.kv_memory", "--gguf", str(gguf)]
        child += ["--threads", str(args.threads), "--one", budget]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"SEMIF_KV_MEMORY={budget}: {figures['streams']} streams of "
            f"{figures['stream_cells']} cells, {figures['cache_mib']} MiB; load "
            f"{figures['load_seconds']} s; peak {figures['peak_mib']} MiB = "
            f"{figures['peak_vs_gguf']} x the GGUF"
        )


if __name__ == "__main__":
    main()
