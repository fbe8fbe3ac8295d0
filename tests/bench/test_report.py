"""`semif-bench-report`: goal verdicts, and a smoke run of the whole report on real servers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from statistics import median

import pytest

from bench.concurrency import (
    ConcurrencyRun,
    Plan,
    Probe,
    Reply,
    Sample,
    summarize_client_level,
    summarize_level,
)
from bench.concurrency import HeadOfLine as Wait
from bench.peer_server import cached_llama_server
from bench.report import (
    Figure,
    Goal,
    concurrency_figures,
    overload_figures,
    parse_args,
    round_ratios,
)
from bench.runner import finite

REPO = Path(__file__).resolve().parents[2]
FIGURES = (
    "adapter_overhead",
    "shared_state_speedup",
    "shared_state_vs_limit",
    "prefix_reuse",
    "cold_start",
    "peak_memory",
    "peer",
    "concurrency_goodput_c8",
    "concurrency_fairness_c8",
    "concurrency_vs_limit",
    "concurrency_vs_serial",
    "concurrency_client_goodput_c8",
    "concurrency_client_failure_time_c8",
    "head_of_line_queue",
    "head_of_line_latency",
)
# Counts that may be 0 in a good run (no call failed); every other figure is positive.
MAY_BE_ZERO = ("concurrency_client_failure_time_c8",)
# The smoke run uses llama-server only when a full run has built it (minutes of compiling).
LLAMA_SERVER_FIGURES = ("peer_throughput_c4", "peer_p95_c4")
OFFLINE_FIGURES = ("offline_vs_limit", "offline_vs_online")
# --smoke: one option count, 32 (bench.report.SMOKE.option_counts).
BRANCH_FIGURES = ("option_tree_32", "branches_request_thread_mean", "branches_request_thread_pmi")
STREAM_FIGURES = ("stream_first_decision",)


def test_goals_and_verdicts() -> None:
    at_most = Figure("k", "t", 1.2, "ours", 1.0, "limit", "seconds", Goal("<=", 1.10))
    assert at_most.ratio == pytest.approx(1.2)
    assert at_most.verdict == "MISS"
    at_least = Figure("k", "t", 6.0, "separate", 1.0, "shared", "seconds", Goal(">=", 5.0))
    assert at_least.verdict == "PASS"
    assert Figure("k", "t", 2.0, "a", 1.0, "b", "bytes").verdict == "-"
    assert "= 1.200  (goal <= 1.1) MISS" in at_most.line()
    assert (
        "a 2.0 MiB / b 1.0 MiB = 2.000"
        in Figure("k", "t", 2 * 2**20, "a", 2**20, "b", "bytes").line()
    )


def test_one_noisy_round_cannot_fail_a_paired_figure() -> None:
    """Three rounds of singles, each forward measured in turn with its invocation; in the
    second round the server side ran 60 % slow. Pooled p50s of prompts this unlike fail the
    figure; the median of the rounds' own ratios does not."""
    forward = [0.2, 0.3, 0.4, 0.5] * 3
    invocations = [f * 1.05 for f in forward]
    invocations[4:8] = [f * 1.6 for f in forward[4:8]]
    ratios = round_ratios(invocations, forward, 3)
    assert ratios == pytest.approx((1.05, 1.6, 1.05))
    pooled = Figure("k", "t", median(invocations), "ours", median(forward), "limit", "seconds")
    assert pooled.ratio > 1.10
    figure = replace(pooled, goal=Goal("<=", 1.10), round_ratios=ratios)
    assert figure.ratio == pytest.approx(1.05)
    assert figure.verdict == "PASS"
    assert "median of the rounds' ratios (1.050, 1.600, 1.050) = 1.050" in figure.line()
    assert figure.as_json()["round_ratios"] == pytest.approx([1.05, 1.6, 1.05])
    assert round_ratios(invocations, forward, 1) == ()  # one round: p50 / p50


def overload_run(
    failed: int, queue_seconds: float, long_status: int = 200, fail_after: float = 31.0
) -> ConcurrencyRun:
    plan = Plan((1,), 1, (), 1, 1, 1, client_level=64, head_of_line_decisions=64)
    run = ConcurrencyRun(plan=plan)
    run.client = summarize_client_level(
        64,
        [Sample(0.0, fail_after, Reply(503, attempts=12)) for _ in range(failed)]
        + [Sample(0.0, 20.0, Reply(200)) for _ in range(100 - failed)],
    )
    long = Probe(long_status, 0.0, 40.0, scoring_seconds=39.0, passes=13, error="x")
    small = Probe(200, 1.0, queue_seconds + 3.0, queue_seconds=queue_seconds, input_tokens=117)
    run.head_of_line = Wait(64, long, small)
    return run


def test_overload_figures_hold_failures_and_the_wait_to_their_goals() -> None:
    run = overload_run(failed=60, queue_seconds=2.0, fail_after=0.5)
    figures = {f.key: f for f in overload_figures(run)}
    assert list(figures) == [
        "concurrency_client_failure_time_c64",
        "head_of_line_queue",
        "head_of_line_latency",
    ]
    failures = figures["concurrency_client_failure_time_c64"]
    assert failures.ratio == pytest.approx(0.5 / 30)  # against the client's 30 s budget
    assert failures.verdict == "PASS"  # most calls fail, but at once: no goal on the share
    assert failures.details["failure_fraction"] == pytest.approx(0.6)
    queue, latency = figures["head_of_line_queue"], figures["head_of_line_latency"]
    assert queue.reference == pytest.approx(3.0)  # one pass: 39 s over 13 passes
    assert queue.ratio == pytest.approx(2 / 3)
    assert queue.verdict == "PASS"
    assert latency.ratio == pytest.approx(5 / 3)
    assert latency.verdict == "PASS"
    assert queue.details["long_passes"] == 13
    # Calls failing after the budget (31 s), or a wait of 4 passes (first come, first
    # served), miss.
    missed = {f.key: f.verdict for f in overload_figures(overload_run(6, queue_seconds=12.0))}
    assert set(missed.values()) == {"MISS"}
    # A long request that failed gives no pass to count in: no 6e figure, never a guess.
    keys = [f.key for f in overload_figures(overload_run(0, 2.0, long_status=503))]
    assert keys == ["concurrency_client_failure_time_c64"]
    # A small decision the project's client finally gave up on: its latency figure is a
    # MISS however short the time to fail, and it had no queue wait to show.
    gave_up = overload_run(0, 2.0)
    assert gave_up.head_of_line is not None
    small = Probe(503, 1.0, 6.0, error="gave up after 6 attempts", attempts=6)
    gave_up.head_of_line = Wait(64, gave_up.head_of_line.long, small)
    (_, latency) = overload_figures(gave_up)
    assert (latency.key, latency.ratio, latency.verdict) == ("head_of_line_latency", 2.0, "MISS")
    assert latency.failure == "the small decision got 503: gave up after 6 attempts"
    assert latency.line().endswith(
        "MISS - failed: the small decision got 503: gave up after 6 attempts"
    )
    # --overload-only: no levels were run, the overload figures still come out.
    only = overload_run(0, 2.0)
    assert [f.key for f in concurrency_figures(only)] == [f.key for f in overload_figures(only)]
    saved = json.loads(json.dumps(finite(only.as_json()), allow_nan=False))
    assert saved["limit"]["decisions_per_second"] is None  # no limit was measured
    assert saved["client"]["failure_fraction"] == 0
    assert saved["head_of_line"]["pass_seconds"] == 3.0


def level_at(clients: int, per_second: float) -> list[Sample]:
    """A level of `clients` closed-loop clients answering 10 decisions at `per_second`."""
    return [Sample(i / per_second, 1 / per_second, Reply(200), i % clients) for i in range(10)]


def test_goodput_is_read_against_the_compare_level_before_and_after_the_sweep() -> None:
    """Figures 6a and 6d divide by the mean of the compare level's two runs, so drift over
    the sweep lands on both sides; 6d's project client is held to the same goodput."""
    plan = Plan((1, 16, 64), 16, (), 1, 1, 1, client_level=64)
    run = ConcurrencyRun(plan=plan)
    run.ours["distinct"] = {
        n: summarize_level(n, level_at(n, rate)) for n, rate in ((1, 0.5), (16, 1.0), (64, 0.81))
    }
    run.compare_again = summarize_level(16, level_at(16, 0.8))
    run.client = summarize_client_level(64, level_at(64, 0.8))
    figures = {f.key: f for f in concurrency_figures(run)}
    goodput = figures["concurrency_goodput_c64"]
    assert goodput.reference == pytest.approx(0.9)
    assert goodput.ratio == pytest.approx(0.9)
    assert goodput.verdict == "PASS"
    assert goodput.details["compare_runs_decisions_per_second"] == pytest.approx([1.0, 0.8])
    client = figures["concurrency_client_goodput_c64"]
    assert client.ratio == pytest.approx(0.8 / 0.9)
    assert client.verdict == "MISS"
    assert figures["concurrency_client_failure_time_c64"].measured == 0.0  # none failed


@pytest.mark.slow
def test_smoke_report_writes_every_figure(tmp_path: Path) -> None:
    command = [
        str(Path(sys.executable).parent / "semif-bench-report"),
        "--smoke",
        "--out",
        str(tmp_path),
    ]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((tmp_path / "bench-report.json").read_text())
    assert report["schema"] == "semif-bench-report/1"
    assert report["run"]["model"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with_llama_server = cached_llama_server() is not None
    # Figure 6e is read unless the long request itself failed (on a busy machine its two
    # passes can outlast the 50 s request timeout), and then the report says why. A small
    # decision refused until its client gave up has no queue wait: a MISS, no 6e queue.
    check = report["concurrency"]["head_of_line"]
    wait = report["figures"].get("head_of_line_latency", {}).get("details", {})
    if check["problem"] is not None:
        assert check["problem"] in run.stdout
        assert check["long"]["status"] != 200 or check["long"]["passes"] < 2
    skipped = (
        ("head_of_line_queue", "head_of_line_latency")
        if check["problem"] is not None
        else ("head_of_line_queue",)
        if wait["small_status"] != 200
        else ()
    )
    expected = tuple(key for key in FIGURES if key not in skipped)
    assert (
        tuple(report["figures"])
        == expected
        + (LLAMA_SERVER_FIGURES if with_llama_server else ())
        + OFFLINE_FIGURES
        + BRANCH_FIGURES
        + STREAM_FIGURES
    )
    for key, figure in report["figures"].items():
        for field in ("measured", "reference", "ratio"):
            assert isinstance(figure[field], float), (key, field)
            assert math.isfinite(figure[field]), (key, field)
            assert figure[field] >= 0 if key in MAY_BE_ZERO else figure[field] > 0, (key, field)
        assert figure["ratio"] == pytest.approx(figure["measured"] / figure["reference"])
        assert figure["verdict"] in ("PASS", "MISS", "-")
        assert figure["title"] in run.stdout
    assert report["figures"]["peak_memory"]["reference"] == 98_362_432
    assert report["figures"]["peer"]["details"]["same_prompt_tokens"] is True
    # The follow-up re-evaluates only its suffix, the shared request its prefix once.
    reuse = report["figures"]["prefix_reuse"]["details"]
    for evaluated, total in zip(reuse["evaluated_tokens"], reuse["input_tokens"], strict=True):
        assert 0 < evaluated < total / 2
    shared = report["figures"]["shared_state_speedup"]["details"]["server_timing"]
    assert 0 < shared["evaluated_tokens"] < shared["input_tokens"]
    assert (tmp_path / "bench-report-latency.png").read_bytes().startswith(b"\x89PNG")
    # Concurrency: at 8 clients the default queue answers every client, each at least once
    # (no refusals to time); every level sent what it planned.
    goodput = report["figures"]["concurrency_goodput_c8"]["details"]
    assert goodput["non_200"] == 0
    assert goodput["refusal_seconds"] is None
    assert goodput["ok_per_client_min_max"][0] >= 1
    fairness = report["figures"]["concurrency_fairness_c8"]
    assert (fairness["measured"], fairness["reference"]) == (8, 8)
    assert goodput["needs_decisions_per_second"] == 8 / goodput["queue_timeout_seconds"]
    assert goodput["limit_decisions_per_second"] > 0
    assert goodput["ok_past_invocation_limit"] == 0
    # The project's client made every planned call; the long request spanned several passes.
    client = report["figures"]["concurrency_client_goodput_c8"]
    assert client["details"]["calls"] == 16
    assert client["details"]["attempts_per_call"]["p50"] >= 1
    assert len(goodput["compare_runs_decisions_per_second"]) == 2  # before and after
    if wait:
        assert wait["long_passes"] >= 2
        assert wait["small_sent_after_seconds"] >= 1.0
        assert wait["small_status"] != 200 or wait["small_prompt_tokens"] < 200
    assert "project client, 8 clients" in run.stdout
    concurrency = report["concurrency"]
    for workload in ("distinct", "mix"):
        levels = concurrency["ours"][workload]
        assert [level["clients"] for level in levels] == [1, 4, 8]
        assert [level["requests"] for level in levels] == [4, 8, 16]
        assert all(level["queue_seconds"] is not None for level in levels)
    assert concurrency["limit"]["prompts"] == 8
    assert concurrency["limit"]["engine_calls"] == 2
    if with_llama_server:
        peer = report["figures"]["peer_throughput_c4"]["details"]
        assert peer["same_prompt_tokens"] is True
        assert 0 <= peer["share_with_all_options_in_top_tokens"] <= 1
    else:
        assert concurrency["peer_skipped"] == "--smoke and no llama-server built yet"
    assert (tmp_path / "bench-report-concurrency.png").read_bytes().startswith(b"\x89PNG")
    # Offline: every line of the file answered on both paths (3 states x 3 questions).
    offline = report["offline"]
    assert offline["lines"] == 9
    assert offline["batch_errors"] == 0
    assert offline["details"]["batch_statuses"] == {"200": 9}
    # Streamed: every streamed result was the whole answer's (else the figure says it failed).
    assert report["figures"]["stream_first_decision"]["failure"] is None


def test_run_selection_flags_that_contradict_are_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert parse_args(["--concurrency-only"]).concurrency_only
    for flags in (["--concurrency-only", "--no-concurrency"], ["--tiny-hybrid", "--gguf", "x"]):
        with pytest.raises(SystemExit):
            parse_args(flags)
    assert "drop" in capsys.readouterr().err
