"""`semif-bench-report`: goal verdicts, and a smoke run of the whole report on real servers."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peer_server import cached_llama_server
from bench.report import Figure, Goal

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
    "concurrency_vs_limit",
    "concurrency_vs_serial",
)
# The smoke run uses llama-server only when a full run has built it (minutes of compiling).
LLAMA_SERVER_FIGURES = ("peer_throughput_c4", "peer_p95_c4")


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
    assert tuple(report["figures"]) == FIGURES + (LLAMA_SERVER_FIGURES if with_llama_server else ())
    for key, figure in report["figures"].items():
        for field in ("measured", "reference", "ratio"):
            assert isinstance(figure[field], float), (key, field)
            assert math.isfinite(figure[field]), (key, field)
            assert figure[field] > 0, (key, field)
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
    assert goodput["needs_decisions_per_second"] == 8 / goodput["queue_timeout_seconds"]
    assert goodput["limit_decisions_per_second"] > 0
    assert goodput["ok_past_invocation_limit"] == 0
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
