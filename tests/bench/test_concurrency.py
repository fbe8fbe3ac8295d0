"""The closed-loop clients, level summaries, peer answers and the concurrency workload."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.concurrency import (
    ConcurrencyRun,
    Level,
    PeerPrompt,
    Plan,
    Reply,
    Sample,
    closed_loop,
    format_levels,
    read_completion,
    send_decision,
    summarize_level,
    write_plot,
)
from bench.local import serve_model
from bench.peer_server import PeerBuildError, locked_pin
from bench.workload import concurrent_decisions

PLAN = Plan(
    levels=(1, 4, 16),
    compare_level=4,
    peer_levels=(4, 16),
    requests_per_client=3,
    min_requests=8,
    limit_repeats=1,
)


def test_closed_loop_keeps_each_client_to_one_request_at_a_time() -> None:
    """No more requests in flight than clients, every item sent exactly once, in order."""
    lock = threading.Lock()
    in_flight, most, seen = 0, 0, []

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
            seen.append(json.loads(request.content)["item"])
        time.sleep(0.01)
        with lock:
            in_flight -= 1
        return httpx.Response(200 if json.loads(request.content)["item"] % 5 else 503, json={})

    def send(http: httpx.Client, item: int) -> Reply:
        return Reply(http.post("/x", json={"item": item}).status_code)

    samples = closed_loop(
        "http://test", list(range(20)), 3, send, transport=httpx.MockTransport(handler)
    )
    assert most == 3
    assert sorted(seen) == list(range(20))
    assert [sample.reply.status for sample in samples][:6] == [503, 200, 200, 200, 200, 503]
    assert all(sample.seconds >= 0.01 for sample in samples)


def test_a_refused_client_waits_its_retry_after_before_sending_again() -> None:
    sent: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(time.monotonic())
        if len(sent) == 1:
            return httpx.Response(503, headers={"retry-after": "1"}, json={"error": "busy"})
        return httpx.Response(200, json={"timing": {}})

    samples = closed_loop(
        "http://test",
        concurrent_decisions(2, series=0, events=1),
        1,
        send_decision,
        transport=httpx.MockTransport(handler),
    )
    assert [sample.reply.status for sample in samples] == [503, 200]
    assert samples[0].reply.retry_after == 1.0
    assert sent[1] - sent[0] >= 1.0


def test_a_request_without_an_answer_is_status_zero() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    samples = closed_loop(
        "http://test", [1], 1, lambda http, _: Reply(http.get("/").status_code),
        transport=httpx.MockTransport(handler),
    )  # fmt: skip
    assert samples[0].reply.status == 0
    assert samples[0].reply.error == "ConnectError: refused"


def sample(started: float, seconds: float, status: int = 200, **reply: object) -> Sample:
    return Sample(started, seconds, Reply(status, **reply))  # type: ignore[arg-type]


def test_level_throughput_counts_answers_over_the_whole_wall_time() -> None:
    level = summarize_level(
        2,
        [
            sample(10.0, 1.0, queue_seconds=0.5, batch_requests=2),
            sample(10.0, 2.0, queue_seconds=0.1, batch_requests=2),
            sample(11.0, 3.0, status=503, error="queue full"),
            sample(12.0, 2.0, queue_seconds=0.3, batch_requests=1),
        ],
    )
    assert (level.requests, level.ok, level.non_200) == (4, 3, 1)
    assert level.non_200_statuses == {"503": 1}
    assert level.first_error == "queue full"
    assert level.wall_seconds == pytest.approx(4.0)  # 10.0 to 14.0, the error's end included
    assert level.decisions_per_second == pytest.approx(3 / 4)
    assert level.latency_seconds["p50"] == pytest.approx(2.0)  # answered requests only
    assert level.queue_seconds is not None
    assert level.queue_seconds["max"] == pytest.approx(0.5)
    assert level.batch_requests_mean == pytest.approx(5 / 3)
    assert level.batch_requests_max == 2
    assert level.share_with_all_options_in_top_tokens is None


def test_answers_after_the_invocation_limit_are_counted_apart() -> None:
    """A 200 after SageMaker's 60 s never reaches the caller: the level says how many."""
    level = summarize_level(
        3, [sample(0.0, 59.9), sample(0.0, 60.5), sample(0.0, 161.0), sample(0.0, 70.0, 503)]
    )
    assert level.ok == 3
    assert level.ok_past_invocation_limit == 2  # the 503 is a non-200, not counted twice


def test_older_servers_without_batch_fields_still_summarize() -> None:
    level = summarize_level(1, [sample(0.0, 1.0), sample(1.0, 1.0)])
    assert level.queue_seconds is None
    assert level.batch_requests_mean is None
    assert isinstance(level, Level)
    assert json.dumps(level.as_json())


def test_a_level_says_how_fast_refusals_came_and_how_evenly_clients_were_served() -> None:
    samples = [
        Sample(0.0, 1.0, Reply(200), client=0),
        Sample(0.0, 0.05, Reply(503), client=1),
        Sample(0.1, 0.15, Reply(503), client=1),
        Sample(1.0, 1.0, Reply(200), client=0),
        Sample(0.3, 2.0, Reply(200), client=1),
        Sample(0.0, 5.0, Reply(0, error="timeout"), client=2),  # no answer at all
    ]
    level = summarize_level(3, samples)
    assert level.ok_per_client == (0, 2)  # client 2 got nothing, client 0 two answers
    assert level.refusal_seconds is not None
    assert level.refusal_seconds["max"] == pytest.approx(0.15)  # 503s only, not the timeout
    assert summarize_level(1, [sample(0.0, 1.0)]).refusal_seconds is None


def test_a_level_with_no_answers_has_no_latency() -> None:
    level = summarize_level(1, [sample(0.0, 1.0, status=503)])
    assert level.decisions_per_second == 0
    assert math.isnan(level.latency_seconds["p95"])


def test_table_and_plot_cover_every_server_measured(tmp_path: Path) -> None:
    """Rows for every level of every server; a server without batch fields shows '-'."""

    def answered(clients: int) -> Level:
        return summarize_level(clients, [sample(0.0, 1.0, queue_seconds=0.2, batch_requests=3)])

    bare = summarize_level(4, [sample(0.0, 2.0)])
    run = ConcurrencyRun(plan=PLAN, limit_seconds=[2.0], limit_prompts=8)
    run.ours = {"distinct": {4: answered(4), 16: answered(16)}, "mix": {4: bare}}
    run.serial = bare
    lines = format_levels(run).splitlines()
    assert [line.split()[:3] for line in lines[2:]] == [
        ["ours,", "distinct", "4"],
        ["ours,", "distinct", "16"],
        ["ours,", "mix", "4"],
        ["ours,", "batching", "off"],
    ]
    # batch mean, answers past 60 s, 503 p95 (none), fewest-most answers per client
    assert lines[2].split()[-4:] == ["3.0", "0", "nan", "1-1"]
    assert lines[4].split()[-6:] == ["nan", "nan", "-", "0", "nan", "1-1"]
    assert run.limit_throughput == 4.0
    png = write_plot(run, tmp_path / "plot.png")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_send_decision_reads_batch_fields_with_defaults() -> None:
    bodies = iter([{"timing": {"queue_seconds": 0.25, "batch_requests": 7}}, {"result": {}}])

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/invocations"
        assert "decision" in json.loads(request.content)
        return httpx.Response(200, json=next(bodies))

    decision = concurrent_decisions(1, series=0, events=1)[0]
    with httpx.Client(base_url="http://test", transport=httpx.MockTransport(handler)) as http:
        assert send_decision(http, decision) == Reply(200, queue_seconds=0.25, batch_requests=7)
        assert send_decision(http, decision) == Reply(200)


def test_peer_coverage_needs_every_option_token_among_its_top_tokens() -> None:
    answer = {
        "completion_probabilities": [{"top_logprobs": [{"id": 49}, {"id": 50}, {"id": 7}]}],
        "tokens_evaluated": 3,
    }
    covered = read_completion(answer, PeerPrompt([1, 2, 3], frozenset({49, 50})))
    assert (covered.covers_options, covered.same_prompt) == (True, True)
    missing = read_completion(answer, PeerPrompt([1, 2], frozenset({49, 50, 51})))
    assert (missing.covers_options, missing.same_prompt) == (False, False)


def test_plan_sizes_and_series() -> None:
    assert [PLAN.requests(n) for n in PLAN.levels] == [8, 12, 48]
    assert PLAN.decisions("distinct", 4) == PLAN.decisions("distinct", 4)  # same for every server
    # No (workload, level) finds a state another one left in the server's cache.
    states = [
        {d.state for d in PLAN.decisions(workload, clients)}
        for workload in ("distinct", "mix")
        for clients in PLAN.levels
    ]
    assert sum(map(len, states)) == len(set().union(*states))
    with pytest.raises(ValueError, match="among the levels"):
        Plan((1, 4), 16, (), 1, 1, 1)


def test_concurrent_states_are_distinct_except_the_shared_quarter() -> None:
    distinct = concurrent_decisions(16, series=3, events=4)
    assert len({d.state for d in distinct}) == 16
    # Accounts differ throughout, not only in the header line.
    first, second = (str(d.state).splitlines() for d in distinct[:2])
    assert not set(first) & set(second)
    mix = concurrent_decisions(16, series=3, events=4, shared_every=4)
    hot = [d.state for index, d in enumerate(mix) if index % 4 == 0]
    assert len(set(hot)) == 1
    assert hot[0] not in {d.state for d in distinct}
    assert len({d.state for d in mix}) == 1 + 12
    assert len({d.question for d in mix if d.state == hot[0]}) == 4  # different questions


LOCK = """\
jmespath==1.1.0 \\
    --hash=sha256:{a}
llama-cpp-python==0.3.36 \\
    --hash=sha256:{b} \\
    --hash=sha256:{c}
    # via -r runtime.in
markupsafe==3.0.4 \\
    --hash=sha256:{a}
"""


def test_locked_pin_reads_version_and_every_hash() -> None:
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    pin = locked_pin(LOCK.format(a=a, b=b, c=c))
    assert pin.version == "0.3.36"
    assert pin.sha256 == {b, c}
    with pytest.raises(PeerBuildError, match="not pinned with hashes"):
        locked_pin("llama-cpp-python==0.3.36\n")


def test_the_project_lock_pins_the_installed_binding() -> None:
    import llama_cpp

    lock = Path(__file__).resolve().parents[2] / "requirements" / "runtime.txt"
    assert locked_pin(lock.read_text()).version == llama_cpp.__version__


def test_closed_loop_against_serve_on_the_tiny_model(tmp_path: Path, tiny_gguf: Path) -> None:
    """A live run: 3 clients against the real server process, every answer well-formed."""
    decisions = concurrent_decisions(6, series=1, events=1)
    with serve_model(tiny_gguf, log_dir=tmp_path, threads=2) as server:
        samples = closed_loop(server.base_url, decisions, 3, send_decision, timeout_s=60)
    level = summarize_level(3, samples)
    assert (level.requests, level.non_200) == (6, 0), level.first_error
    assert level.queue_seconds is not None  # every answer says how long it queued
