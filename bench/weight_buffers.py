"""`semif-bench-weight-buffers`: what llama.cpp's extra weight buffers are worth on this CPU
and what `SEMIF_WEIGHT_BUFFERS=auto` keeps of them, measured in one run.

`plain` (no extra buffer type) against `all` (llama.cpp's default) prices the CPU_REPACK
speed-up, and `auto` is what the adapter loads. Where the CPU backend offers AMX, `auto`
turns every extra type off, CPU_REPACK included (adapter/weight_buffers.py: llama.cpp
cannot keep one and refuse the other), and `all` would crash, so it is not measured there.
The images and scripts/setup.sh give an AMX host a CPU backend built without AMX, which
offers CPU_REPACK alone; `--simulate-amx-host` reports this CPU as such a host (AMX on the
host, not in the backend), so `auto` decides here as it does there. The repack exists only
for the weight types it has kernels for (Q4_0, Q4_K, Q8_0, ...; not the embedded model's
Q4_1), so the embedded model is also requantized with llama.cpp's own quantizer into each
type asked for. For each type every setting is loaded in turn (the order reversed every
other round, so drift hits all alike), and each scores the same prompts from an empty
cache: every row is evaluated, as for a new state. Prints evaluated tokens/s (median over
rounds) and the ratios plain / all and auto / all per type.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

import llama_cpp

from adapter.backends import cpu_backend, load_backends
from adapter.core.engine import LlamaEngine
from adapter.weight_buffers import CpuBackend, WeightBuffers, choose_buffers
from bench.runner import DEFAULT_MODEL_CACHE
from model_build.embedded import fetch_embedded_model

# Quantization types llama.cpp can produce from the embedded model, by their file-type names.
FILE_TYPES = {
    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
}
SETTINGS: tuple[WeightBuffers, ...] = ("all", "plain", "auto")
PROMPTS = 4
PROMPT_TOKENS = 240  # 4 x 240 rows: one pass, as a new ~250-token state asked 4 questions
REPEATS = 3  # scored passes per load (the median is kept), after one warm-up pass
_TEXT = (
    "The customer reports that the invoice for March lists two charges for the same order, "
    "that the refund promised by the agent on the phone has not arrived, and that the "
    "account page now shows a balance the customer does not recognise. "
)


def requantized(source: Path, file_type: str, cache: Path) -> Path:
    """`source` requantized to `file_type` by llama.cpp (kept in `cache`; speed only: a
    model requantized from Q4_1 is no measure of quality)."""
    if file_type == "as-is":
        return source
    target = cache / f"{source.stem}.requantized-{file_type}.gguf"
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FILE_TYPES[file_type]
        params.allow_requantize = True
        scratch = target.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(str(source).encode(), str(scratch).encode(), params):
            raise SystemExit(f"llama.cpp could not quantize {source.name} to {file_type}")
        scratch.rename(target)
    return target


def measure(
    gguf: Path, setting: WeightBuffers, cpu: CpuBackend, threads: int
) -> tuple[float, dict[str, float]]:
    """Load under `setting`, decided from the report `cpu`, and score the prompts REPEATS
    times from an empty cache; the median evaluated tokens per second and where the weights
    landed."""
    engine = LlamaEngine(
        gguf,
        stream_cells=PROMPT_TOKENS + 16,
        max_branches=PROMPTS,
        threads=threads,
        n_gpu_layers=0,
        weight_buffers=setting,
        cpu=cpu,
    )
    try:
        body = engine.vocab.tokenize(_TEXT * 8)[:PROMPT_TOKENS]
        # Rotations: the same tokens, no common prefix, so every row is decoded.
        prompts = [body[index * 7 :] + body[: index * 7] for index in range(PROMPTS)]
        rates = []
        for index in range(REPEATS + 1):
            engine.reset()
            _, timing = engine.score(prompts)
            if index > 0:  # the first pass warms caches and the thread pool
                rates.append(timing.evaluated_tokens / timing.seconds)
        return statistics.median(rates), engine.weights.landed
    finally:
        engine.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF to measure (default: the embedded model)")
    parser.add_argument(
        "--types",
        default="as-is,Q4_0,Q4_K_M,Q8_0",
        help="comma-separated: as-is and/or " + ", ".join(FILE_TYPES),
    )
    parser.add_argument("--rounds", type=int, default=4, help="loads per setting and type")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    parser.add_argument(
        "--simulate-amx-host",
        action="store_true",
        help="report this CPU as an AMX host whose CPU backend was built without AMX",
    )
    args = parser.parse_args(argv)
    types = args.types.split(",")
    for name in types:
        if name != "as-is" and name not in FILE_TYPES:
            parser.error(f"--types: {name!r} is not as-is or one of {', '.join(FILE_TYPES)}")
    source = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
    load_backends(None)
    cpu = cpu_backend(None)
    if args.simulate_amx_host:
        cpu = dataclasses.replace(cpu, host_amx=True)
    auto = choose_buffers("auto", cpu)
    print(f"CPU backend: {cpu.describe()}; extra buffer types: {cpu.extra_buffer_types}")
    print(f"auto refuses: {', '.join(auto.refused) or 'none'} ({auto.reason})")
    settings = SETTINGS
    if not auto.use_extra:
        # `all` would load weights into AMX buffers and crash: it is not measured here.
        print("this CPU backend offers AMX: `all` is not measured (it crashes)")
        settings = ("plain", "auto")
    figures = {}
    for name in types:
        gguf = requantized(source, name, DEFAULT_MODEL_CACHE)
        rates: dict[str, list[float]] = {setting: [] for setting in settings}
        landed: dict[str, list[str]] = {}
        for round_index in range(args.rounds):
            order = settings if round_index % 2 == 0 else settings[::-1]
            for setting in order:
                rate, buffers = measure(gguf, setting, cpu, args.threads)
                rates[setting].append(rate)
                landed[setting] = sorted(buffers)
        medians = {setting: statistics.median(values) for setting, values in rates.items()}
        ratios = (
            {f"{setting}/all": medians[setting] / medians["all"] for setting in ("plain", "auto")}
            if "all" in medians
            else {}
        )
        figures[name] = {"tokens_per_second": rates, "weights_in": landed, "ratios": ratios}
        line = "  ".join(
            f"{setting} {medians[setting]:7.1f} tok/s (weights in {', '.join(landed[setting])})"
            for setting in settings
        )
        print("  ".join([f"{name:7s} {line}", *(f"{k} = {v:.3f}" for k, v in ratios.items())]))
    if args.out is not None:
        report = {
            "cpu_backend": cpu.library,
            "host_amx": cpu.host_amx,
            "cpu": dict(cpu.features),
            "auto_refuses": list(auto.refused),
            "figures": figures,
        }
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
