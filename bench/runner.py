"""`semif-bench-tasks`: send JevBench decision tasks to a server and score the answers.

Tasks go to a local server (`--url`, or `--local` to start `serve` on the embedded model)
or to a SageMaker endpoint (`--endpoint`), serially or from N concurrent clients. The
report is what a user needs to choose a model and an instance: valid answers, accuracy,
Brier score, top-label ECE, client latency percentiles and tokens per decision, as a
terminal table, a JSON file and a latency histogram. It also gives the coverage/accuracy
curve of abstention (`min_confidence` at each observed top probability) and the lowest
threshold whose answers reach `--target-accuracy`: chosen on these tasks, so pick it on
labelled decisions like the ones it will guard (docs/decision-quality.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

import numpy as np

from bench.local import serve_model
from bench.metrics import (
    Answer,
    accuracy,
    brier_score,
    latency_summary,
    top_label_ece,
    validate_answer,
)
from bench.tasks import SMOKE_TASKS, Task, load_tasks
from client.decision_client import DecisionClient, EndpointError, RetryPolicy
from model_build.calibration import NORMALIZATIONS, OPTION_ORDERS
from model_build.embedded import fetch_embedded_model

SCHEMA = "semif-bench-tasks/1"
SMOKE_TASK_COUNT = 4
DEFAULT_MODEL_CACHE = Path(".cache/models")
DEFAULT_TARGET_ACCURACY = 0.9
NO_POLICY: Mapping[str, Any] = MappingProxyType({})  # read with the server's defaults
# How the likelihood readout is asked for under each normalization (policy fields of a
# decision body), for the benchmarks that compare readings.
LIKELIHOOD_READINGS: dict[str, dict[str, str]] = {
    normalization: {"readout": "likelihood", "normalization": normalization}
    for normalization in NORMALIZATIONS
}


class Invoker(Protocol):
    """What the runner needs of a client (DecisionClient has it)."""

    def invoke(self, body: Mapping[str, Any]) -> Any: ...


def open_client(
    *, url: str | None, endpoint: str | None, region: str | None, timeout_s: float
) -> DecisionClient:
    """A client for a base URL or a SageMaker endpoint. Busy answers (429, 503) are retried
    quickly and patiently, up to `timeout_s`: with N concurrent clients against a server
    that admits one request at a time, waiting is part of the latency being measured."""
    retry = RetryPolicy(
        max_attempts=10_000, base_delay_s=0.02, max_delay_s=0.5, max_total_s=timeout_s
    )
    if url is not None:
        return DecisionClient.for_url(url, retry=retry, timeout_s=timeout_s)
    if endpoint is None:
        raise ValueError("give a URL or an endpoint name")
    return DecisionClient.for_endpoint(endpoint, region=region, retry=retry)


@dataclass(frozen=True)
class Outcome:
    """What one task got back, as the client saw it."""

    task: Task
    answer: Answer | None
    seconds: float
    input_tokens: int | None = None
    evaluated_tokens: int | None = None
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        top = self.answer.top[0] if self.answer else None
        return {
            "id": self.task.id,
            "family": self.task.family,
            "expected": self.task.expected,
            "answer": top,
            "valid": self.answer is not None,
            "correct": top == self.task.expected,
            "probabilities": dict(self.answer.probabilities) if self.answer else None,
            "seconds": self.seconds,
            "input_tokens": self.input_tokens,
            "evaluated_tokens": self.evaluated_tokens,
            "error": self.error,
        }


def read_answer(task: Task, response: Mapping[str, Any]) -> Outcome:
    """Turn a response body into an outcome; anything malformed is an invalid answer."""
    result = response.get("result")
    if not isinstance(result, Mapping):
        return Outcome(task, None, 0.0, error="response has no result object")
    answer = parse_answer(task.labels, result)
    timing = result.get("timing")
    return Outcome(
        task,
        answer,
        0.0,
        input_tokens=_int_or_none(result.get("input_tokens")),
        evaluated_tokens=_int_or_none(timing.get("evaluated_tokens"))
        if isinstance(timing, Mapping)
        else None,
        error=None if answer else "probabilities do not cover exactly the labels or sum to 1",
    )


def parse_answer(labels: Sequence[str], result: Mapping[str, Any]) -> Answer | None:
    """A result's distribution over `labels` (a multi-label result's probabilities, each
    option's own); None when it is malformed or is not one."""
    option_ids, probabilities = result.get("option_ids"), result.get("probabilities")
    if not isinstance(option_ids, list) or not isinstance(probabilities, list):
        return None
    try:
        return validate_answer(
            labels,
            [str(o) for o in option_ids],
            [float(p) for p in probabilities],
            distribution=result.get("kind", "choice") != "multi_label",
        )
    except (TypeError, ValueError):
        return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def run_task(client: Invoker, task: Task, policy: Mapping[str, Any] = NO_POLICY) -> Outcome:
    """Send one task (with `policy`: top-level fields such as `option_order`) and time it on
    the client, as a user's latency would be."""
    started = time.perf_counter()
    try:
        response = client.invoke({**task.body(), **policy})
    except EndpointError as error:
        seconds = time.perf_counter() - started
        return Outcome(task, None, seconds, error=f"{type(error).__name__}: {error}")
    return replace(read_answer(task, response), seconds=time.perf_counter() - started)


def run_tasks(
    client: Invoker,
    tasks: Sequence[Task],
    concurrency: int,
    policy: Mapping[str, Any] = NO_POLICY,
) -> list[Outcome]:
    """Serially for concurrency 1; otherwise N clients each take the next task."""
    if concurrency <= 1:
        return [run_task(client, task, policy) for task in tasks]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(lambda task: run_task(client, task, policy), tasks))


def _mean(values: Sequence[int | None]) -> float | None:
    known = [value for value in values if value is not None]
    return sum(known) / len(known) if known else None


def summarize(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """Every figure for one group of outcomes (all tasks, or one family)."""
    answers = [outcome.answer for outcome in outcomes]
    expected = [outcome.task.expected for outcome in outcomes]
    return {
        "tasks": len(outcomes),
        "valid": sum(answer is not None for answer in answers),
        "accuracy": accuracy(answers, expected),
        "brier": brier_score(answers, expected),
        "ece": top_label_ece(answers, expected),
        "latency_seconds": latency_summary([outcome.seconds for outcome in outcomes]),
        "input_tokens_per_decision": _mean([outcome.input_tokens for outcome in outcomes]),
        "evaluated_tokens_per_decision": _mean([o.evaluated_tokens for o in outcomes]),
    }


def summarize_by_family(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    families: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        families.setdefault(outcome.task.family, []).append(outcome)
    return {family: summarize(group) for family, group in families.items()}


def coverage_curve(outcomes: Sequence[Outcome]) -> list[dict[str, float]]:
    """What abstention keeps at each threshold: for each distinct top probability t, high
    to low, the answers with top >= t (what `min_confidence: t` answers), their share of
    all tasks (coverage; invalid answers are never kept) and their accuracy."""
    kept = sorted(
        ((o.answer.top[1], o.answer.top[0] == o.task.expected) for o in outcomes if o.answer),
        reverse=True,
    )
    points, correct = [], 0
    for count, (confidence, right) in enumerate(kept, start=1):
        correct += right
        if count == len(kept) or kept[count][0] < confidence:  # the last of equal confidences
            points.append(
                {
                    "threshold": confidence,
                    "coverage": count / len(outcomes),
                    "accuracy": correct / count,
                }
            )
    return points


def threshold_for(
    curve: Sequence[Mapping[str, float]], target: float
) -> Mapping[str, float] | None:
    """The point of widest coverage whose kept answers reach `target` accuracy, if any."""
    reaching = [point for point in curve if point["accuracy"] >= target]
    return max(reaching, key=lambda point: point["coverage"]) if reaching else None


T = TypeVar("T")


def timed(action: Callable[[], T]) -> tuple[T, float]:
    """What `action` returns, and the seconds it took (wall clock)."""
    started = time.perf_counter()
    value = action()
    return value, time.perf_counter() - started


def finite(value: Any) -> Any:
    """NaN/inf become null recursively, so the JSON report is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def _cell(value: float | None, scale: float = 1.0, digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value * scale:.{digits}f}"


def format_table(rows: Mapping[str, Mapping[str, Any]]) -> str:
    """One line per group: counts, quality, client latency in ms, tokens per decision."""
    header = (
        f"{'group':<12}{'tasks':>6}{'valid':>6}{'acc':>7}{'brier':>7}{'ece':>7}"
        f"{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}{'max ms':>9}{'tok/dec':>9}{'eval/dec':>9}"
    )
    lines = [header, "-" * len(header)]
    for name, row in rows.items():
        latency = row["latency_seconds"]
        lines.append(
            f"{name:<12}{row['tasks']:>6}{row['valid']:>6}"
            f"{_cell(row['accuracy']):>7}{_cell(row['brier']):>7}{_cell(row['ece']):>7}"
            + "".join(f"{_cell(latency[k], 1000, 1):>9}" for k in ("p50", "p95", "p99", "max"))
            + f"{_cell(row['input_tokens_per_decision'], digits=1):>9}"
            f"{_cell(row['evaluated_tokens_per_decision'], digits=1):>9}"
        )
    return "\n".join(lines)


def format_threshold(abstention: Mapping[str, Any]) -> str:
    """One line: the threshold that reaches the target accuracy, and what it keeps."""
    target, point = abstention["target_accuracy"], abstention["threshold"]
    if point is None:
        return f"abstention: no min_confidence reaches accuracy {target:g} on these tasks"
    return (
        f"abstention: min_confidence {point['threshold']:.3f} keeps {point['coverage']:.0%} "
        f"of decisions at accuracy {point['accuracy']:.3f} (target {target:g})"
    )


def write_histogram(series: Mapping[str, Sequence[float]], path: Path, title: str) -> Path:
    """A latency histogram (milliseconds) of one or more series, as PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    # One set of bin edges for every series, so their bars compare like for like.
    edges = np.histogram_bin_edges([s * 1000 for values in series.values() for s in values], 30)
    for label, seconds in series.items():
        axes.hist([s * 1000 for s in seconds], bins=edges.tolist(), alpha=0.6, label=label)
    axes.set_xlabel("client latency (ms)")
    axes.set_ylabel("decisions")
    axes.set_title(title)
    axes.legend()
    return save_figure(figure, path)


def save_figure(figure: Any, path: Path) -> Path:
    """Write a finished matplotlib figure as PNG and free it (every report plot)."""
    from matplotlib import pyplot

    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path


def build_report(
    outcomes: Sequence[Outcome],
    *,
    target: str,
    tasks_file: Path,
    concurrency: int,
    wall: float,
    target_accuracy: float = DEFAULT_TARGET_ACCURACY,
    option_order: str | None = None,
) -> dict[str, Any]:
    curve = coverage_curve(outcomes)
    report = {
        "schema": SCHEMA,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "target": target,
        "tasks_file": str(tasks_file),
        "concurrency": concurrency,
        "wall_seconds": wall,
        "decisions_per_second": len(outcomes) / wall if wall > 0 else None,
        "overall": summarize(outcomes),
        "families": summarize_by_family(outcomes),
        "option_order": option_order,
        "abstention": {
            "target_accuracy": target_accuracy,
            "threshold": threshold_for(curve, target_accuracy),
            "curve": curve,
        },
        "outcomes": [outcome.as_json() for outcome in outcomes],
    }
    finite_report: dict[str, Any] = finite(report)
    return finite_report


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    """What `target_client` reads: a running server (--url), a SageMaker endpoint, or a
    local `serve` (--local, --gguf, --threads); the timeout per request and the folder a
    local server logs to (--out)."""
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8080")
    target.add_argument("--endpoint", help="SageMaker endpoint name (uses AWS credentials)")
    target.add_argument("--local", action="store_true", help="start `serve` on the embedded model")
    parser.add_argument("--region", help="AWS region of --endpoint")
    parser.add_argument("--gguf", type=Path, help="with --local: serve this GGUF instead")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=Path(".cache/bench"), help="output folder")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="semif-bench-tasks", description=__doc__.splitlines()[0])
    add_target_arguments(parser)
    parser.add_argument("--tasks", type=Path, default=SMOKE_TASKS, help="JevBench JSONL file")
    parser.add_argument("--limit", type=int, help="only the first N tasks")
    parser.add_argument("--concurrency", type=int, default=1, help="concurrent clients")
    parser.add_argument("--smoke", action="store_true", help=f"first {SMOKE_TASK_COUNT} tasks")
    parser.add_argument(
        "--option-order", choices=OPTION_ORDERS, help="send this option_order (default: server's)"
    )
    parser.add_argument(
        "--target-accuracy",
        type=float,
        default=DEFAULT_TARGET_ACCURACY,
        help="report the min_confidence whose answers reach this accuracy",
    )
    args = parser.parse_args(argv)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if not 0 < args.target_accuracy <= 1:
        parser.error("--target-accuracy must be in (0, 1]")
    if args.smoke and args.limit is None:
        args.limit = SMOKE_TASK_COUNT
    return args


@contextmanager
def target_client(args: argparse.Namespace) -> Iterator[tuple[str, Invoker]]:
    """The client the run uses; with --local, a server that lives as long as the run."""
    if not args.local:
        target = args.url or f"sagemaker:{args.endpoint}"
        yield (
            target,
            open_client(
                url=args.url, endpoint=args.endpoint, region=args.region, timeout_s=args.timeout
            ),
        )
        return
    gguf = args.gguf or fetch_embedded_model(DEFAULT_MODEL_CACHE)
    with serve_model(gguf, log_dir=args.out, threads=args.threads) as server:
        client = open_client(
            url=server.base_url, endpoint=None, region=None, timeout_s=args.timeout
        )
        yield f"local:{gguf.name}", client


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    tasks = load_tasks(args.tasks)[: args.limit]
    with target_client(args) as (target, client):
        started = time.perf_counter()
        policy = {"option_order": args.option_order} if args.option_order else NO_POLICY
        outcomes = run_tasks(client, tasks, args.concurrency, policy)
        wall = time.perf_counter() - started
    report = build_report(
        outcomes,
        target=target,
        tasks_file=args.tasks,
        concurrency=args.concurrency,
        wall=wall,
        target_accuracy=args.target_accuracy,
        option_order=args.option_order,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / "bench-tasks.json"
    json_path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    png_path = write_histogram(
        {target: [outcome.seconds for outcome in outcomes]},
        args.out / "bench-tasks-latency.png",
        f"{len(outcomes)} decisions, concurrency {args.concurrency}",
    )
    print(f"{target}: {len(outcomes)} tasks from {args.tasks}, concurrency {args.concurrency}")
    print(format_table({**report["families"], "all": report["overall"]}))
    for outcome in outcomes:
        if outcome.error:
            print(f"  invalid {outcome.task.id}: {outcome.error}")
    print(format_threshold(report["abstention"]))
    print(f"JSON: {json_path}\nhistogram: {png_path}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
