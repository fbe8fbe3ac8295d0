"""The measuring half of `scripts/gpu-check.sh run`: checks, figures, one JSON, one PNG.

Runs after the binding is built and the model generated. Order matters on a lent machine:
the start check first (if the GPU backend or offload is wrong nothing else means
anything), then the correctness checks, then the figures. Exits 1 when a check failed;
a figure that misses its goal is reported, never an error (as `semif-bench-report`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from adapter.settings import Settings
from bench.local import ServerStartError, serve_model, weight_buffers_setting
from bench.report import Figure, Samples
from bench.runner import finite, open_client, write_histogram
from bench.workload import account_state, shared_decisions
from scripts.gpu import checks
from scripts.gpu.figures import ROUNDS, SHARED, SINGLE_TOKENS, Sizes, measure, size_workload

SCHEMA = "semif-gpu-check/1"
BUDGET_SECONDS = 540  # issue 14: everything on the machine, build included, in 9 minutes
_CHECK_VARIANT = 50  # the prefix-reuse checks' own state, cached by nothing else


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--n-gpu-layers", type=int, default=-1, help="0 for a CPU run")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--out", type=Path, default=Path(".cache/gpu-check"))
    parser.add_argument("--phase", action="append", default=[], metavar="NAME=SECONDS",
                        help="a timed step of the shell script, for the JSON")  # fmt: skip
    parser.add_argument("--started", type=float, help="epoch seconds when the script began")
    return parser.parse_args(argv)


def _command_output(*command: str) -> list[str] | None:
    if shutil.which(command[0]) is None:
        return None
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] or None


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    return {
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "threads": args.threads,
        "n_gpu_layers": args.n_gpu_layers,
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_path": str(Path(llama_cpp.__file__).parent),
        "gpu": _command_output(
            "nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"
        ),
        "model": {"file": args.gguf.name, "bytes": args.gguf.stat().st_size},
        "phases_seconds": {
            name: float(seconds) for name, _, seconds in (p.partition("=") for p in args.phase)
        },
    }


def run_checks(args: argparse.Namespace, found: checks.CheckList) -> Sizes | None:
    """The correctness checks; returns the workload sizes when the model started."""
    settings = Settings(
        model_dir=args.gguf.parent, gguf_path=args.gguf,
        threads=args.threads, n_gpu_layers=args.n_gpu_layers,
        weight_buffers=weight_buffers_setting(),
    )  # fmt: skip
    service, started = checks.start(settings)
    found.results.append(started)
    if service is None:
        return None
    try:
        sizes = size_workload(service)
        shared = shared_decisions(account_state(sizes.state_events), SHARED)
        first, second = shared_decisions(account_state(sizes.state_events, _CHECK_VARIANT), 2)
        found.run("labels", partial(checks.labels, service))
        found.run("engine_shared_state", partial(checks.shared_state, service, shared))
        alone = found.results[-1].detail.get("probabilities", [])
        found.run("engine_prefix_reuse", partial(checks.prefix_reuse, service, first, second))
    finally:
        service.engine.close()  # free the device before servers load the model again
    options = {"log_dir": args.out / "logs", "threads": args.threads}
    try:
        with serve_model(args.gguf, n_gpu_layers=args.n_gpu_layers, **options) as server:
            client = open_client(url=server.base_url, endpoint=None, region=None, timeout_s=600)
            found.run("http_ping", partial(checks.http_ping, server.base_url, args.n_gpu_layers))
            found.run(
                "http_shared_state",
                partial(checks.http_shared_state, client, shared, args.n_gpu_layers, alone),
            )
            found.run("http_prefix_reuse", partial(checks.http_prefix_reuse, client, first, second))
    except ServerStartError as error:
        found.results.append(checks.Check("http_start", False, error=str(error)))
    return sizes


def table(found: checks.CheckList, figures: list[Figure]) -> str:
    """The short terminal summary: every check, then every figure with its goal."""
    lines = [f"{'check':<22}result"]
    for check in found.results:
        lines.append(f"{check.name:<22}{'PASS' if check.passed else 'FAIL ' + str(check.error)}")
    if figures:
        lines.append("")
        lines.append(f"{'figure':<44}{'measured':>11}{'reference':>11}{'ratio':>8}  goal")
        for figure in figures:
            scale, unit = (2**20, "MiB") if figure.unit == "bytes" else (1e-3, "ms")
            goal = f"{figure.goal} {figure.verdict}" if figure.goal else "-"
            lines.append(
                f"{figure.title:<44}{figure.measured / scale:>8.1f} {unit}"
                f"{figure.reference / scale:>8.1f} {unit}{figure.ratio:>8.3f}  {goal}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report: dict[str, Any] = {"schema": SCHEMA, "run": environment(args)}
    found = checks.CheckList()
    sizes = run_checks(args, found)
    figures: list[Figure] = []
    samples = Samples()
    if sizes is not None and found.results[0].passed:
        started = time.perf_counter()
        figures, samples = measure(
            args.gguf, sizes, threads=args.threads,
            n_gpu_layers=args.n_gpu_layers, log_dir=args.out / "logs", rounds=args.rounds,
        )  # fmt: skip
        report["run"]["phases_seconds"]["figures"] = time.perf_counter() - started
    if args.started is not None:
        report["run"]["total_seconds"] = time.time() - args.started
        report["run"]["budget_seconds"] = BUDGET_SECONDS
    report["run"]["load_average_at_end"] = os.getloadavg()
    report["sizes"] = asdict(sizes) if sizes is not None else None
    report["checks"] = [asdict(check) for check in found.results]
    report["figures"] = {figure.key: figure.as_json() for figure in figures}
    report["samples"] = {k: v for k, v in asdict(samples).items() if k != "single_texts"}
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "gpu-check.json"
    json_path.write_text(json.dumps(finite(report), indent=2, allow_nan=False) + "\n")
    print(table(found, figures))
    if figures:
        series = {
            "raw forward": samples.single_forward,
            "serve, no prefix reuse": samples.single_invocations,
            "serve, prefix reuse": samples.single_invocations_with_reuse,
        }
        title = f"~{SINGLE_TOKENS}-token decisions, n_gpu_layers {args.n_gpu_layers}"
        print(f"histogram: {write_histogram(series, args.out / 'gpu-check-latency.png', title)}")
    total = report["run"].get("total_seconds")
    if total is not None:
        print(f"total {total:.0f} s on this machine (budget {BUDGET_SECONDS} s)")
    print(f"JSON: {json_path}")
    sys.exit(0 if found.passed else 1)


if __name__ == "__main__":
    main()
