"""What SEMIF_KV_MEMORY buys on a model: streams, cache size, load time and peak memory.

Each budget is loaded in a fresh process (peak memory is per process): the service as the
server builds it (`load_service`), then one line of figures. The defaults compare `auto`
with a budget that holds all 32 streams, on the embedded model.

    python -m bench.kv_memory [--gguf PATH] [--threads N] [BUDGET ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from adapter.kv_memory import KvBudget
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("budgets", nargs="*", default=["auto", "3.5GiB"])
    parser.add_argument("--gguf", type=Path, help="default: the embedded model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one budget
    args = parser.parse_args(argv)
    gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
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
