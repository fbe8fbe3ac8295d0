"""The closed-loop clients, level summaries, peer answers and the concurrency workload."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from bench.concurrency import (
    ConcurrencyRun,
    HeadOfLine,
    Level,
    PeerPrompt,
    Plan,
    Probe,
    ProjectClient,
    Reply,
    Sample,
    closed_loop,
    fitted_count,
    format_levels,
    head_of_line,
    overload_lines,
    read_completion,
    read_probe,
    run_clients,
    send_decision,
    send_with_client,
    summarize_client_level,
    summarize_level,
    write_plot,
)
from bench.local import serve_model
from bench.peer_server import PeerBuildError, locked_pin
from bench.workload import MAX_MANY, concurrent_decisions, many_questions
from client.decision_client import (
    CUSTOM_ATTRIBUTES_HEADER,
    JSON,
    BusyError,
    RetryPolicy,
    UnreachableError,
)

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


def test_a_refused_client_brings_its_place_back_until_it_is_answered() -> None:
    """As a raw HTTP application would: the session's next request carries the refusal's
    retry token; an answer (or a refusal without a token) ends it."""
    script = [
        httpx.Response(429, headers={"retry-after": "0"}, json={"retry_token": "place-1"}),
        httpx.Response(200, json={"timing": {}}),
        httpx.Response(429, headers={"retry-after": "0"}, json={"error": "busy"}),
        httpx.Response(200, json={"timing": {}}),
    ]
    brought: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        brought.append(request.headers.get(CUSTOM_ATTRIBUTES_HEADER))
        return script[len(brought) - 1]

    closed_loop(
        "http://test",
        concurrent_decisions(4, series=0, events=1),
        1,
        send_decision,
        transport=httpx.MockTransport(handler),
    )
    assert brought == [None, "semif-retry-token=place-1", None, None]


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
        Sample(0.0, 0.05, Reply(429), client=1),
        Sample(0.1, 0.15, Reply(429), client=1),
        Sample(1.0, 1.0, Reply(200), client=0),
        Sample(0.3, 2.0, Reply(200), client=1),
        Sample(0.0, 5.0, Reply(0, error="timeout"), client=2),  # no answer at all
    ]
    level = summarize_level(3, samples)
    assert level.ok_per_client == (0, 2)  # client 2 got nothing, client 0 two answers
    assert level.clients_answered == 2
    assert level.refusal_seconds is not None
    assert level.refusal_seconds["max"] == pytest.approx(0.15)  # 429s only, not the timeout
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


def test_a_closed_loop_of_64_clients_over_capacity_answers_no_5xx(
    tmp_path: Path, tiny_gguf: Path
) -> None:
    """The report's overload level (64 closed-loop clients) against a server that cannot
    hold them (a queue of 8, a 1 s queue timeout): the load is refused with 429s, which
    SageMaker counts as 4XX, never with a 5XX that the rollback and paging alarms read as
    failure; every refusal tells the client when to come back."""
    decisions = concurrent_decisions(256, series=2, events=1)
    settings = {"SEMIF_MAX_QUEUE": "8", "SEMIF_QUEUE_TIMEOUT_S": "1"}
    with serve_model(tiny_gguf, log_dir=tmp_path, threads=2, settings=settings) as server:
        samples = closed_loop(server.base_url, decisions, 64, send_decision, timeout_s=60)
    statuses = Counter(sample.reply.status for sample in samples)
    assert set(statuses) == {200, 429}, statuses
    assert all(s.reply.retry_after is not None for s in samples if s.reply.status == 429)


# -- overload as an application sees it (figures 6d and 6e) -------------------------------

OVERLOAD_PLAN = Plan(
    levels=(1, 4),
    compare_level=4,
    peer_levels=(),
    requests_per_client=2,
    min_requests=4,
    limit_repeats=1,
    client_level=3,
    head_of_line_decisions=20,
)


def test_many_questions_are_distinct_prompts_about_one_state() -> None:
    decisions = many_questions("the state", MAX_MANY)
    assert MAX_MANY == 64
    assert {d.state for d in decisions} == {"the state"}
    assert len({d.question for d in decisions}) == 64  # each its own suffix
    assert len({d.id for d in decisions}) == 64
    assert decisions[0].options == decisions[16].options  # the same question, another team
    for count in (0, 65):
        with pytest.raises(ValueError, match=r"1\.\.64"):
            many_questions("s", count)


def test_overload_checks_use_states_no_level_uses() -> None:
    levels = set().union(
        *(
            {d.state for d in OVERLOAD_PLAN.decisions(workload, clients)}
            for workload in ("distinct", "mix")
            for clients in OVERLOAD_PLAN.levels
        )
    )
    calls = OVERLOAD_PLAN.client_decisions()
    assert len(calls) == OVERLOAD_PLAN.requests(3) == 6
    long, small = OVERLOAD_PLAN.head_of_line()
    assert len(long) == 20
    assert len({d.state for d in long}) == 1
    assert long[0].state != small.state
    assert len(str(long[0].state)) > 3 * len(str(small.state))  # a long state, a small one
    fresh = {d.state for d in calls} | {long[0].state, small.state}
    assert not fresh & levels
    assert len({d.state for d in calls}) == len(calls)
    unplanned = Plan((1,), 1, (), 1, 1, 1)
    assert unplanned.client_decisions() == []
    with pytest.raises(ValueError, match="at least one client"):
        Plan((1,), 1, (), 1, 1, 1, client_level=0)


class ScriptedTransport:
    """A transport answering from a script: an exception is raised, anything else returned."""

    def __init__(self, *script: object) -> None:
        self.script = list(script)
        self.closed = False

    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> object:
        assert content_type == JSON
        assert "decision" in json.loads(body)
        answer = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def wait_until_ready(self, timeout_s: float, progress: object = None) -> dict[str, object]:
        return {}

    def describe(self) -> str:
        return "scripted"

    def close(self) -> None:
        self.closed = True


NO_WAIT = RetryPolicy(retry_after_jitter_s=0.0, max_attempts=3)
DECISION = concurrent_decisions(1, series=0, events=1)[0]


def test_the_project_client_retries_busy_answers_and_counts_its_attempts() -> None:
    busy = BusyError(503, "busy: overloaded", retry_after_s=0.0)
    answer = {"timing": {"queue_seconds": 0.5}}
    retrying = ProjectClient(ScriptedTransport(busy, busy, answer), retry=NO_WAIT)
    assert send_with_client(retrying, DECISION) == Reply(200, queue_seconds=0.5, attempts=3)
    assert ProjectClient(ScriptedTransport(answer)).client.retry == RetryPolicy()  # as shipped
    # The counter starts again for every call.
    assert send_with_client(retrying, DECISION) == Reply(200, queue_seconds=0.5, attempts=1)


def test_a_call_the_client_gives_up_on_is_a_final_failure() -> None:
    busy = BusyError(503, "busy: overloaded", retry_after_s=0.0)
    gave_up = send_with_client(ProjectClient(ScriptedTransport(busy), retry=NO_WAIT), DECISION)
    assert (gave_up.status, gave_up.attempts) == (503, 3)
    assert str(gave_up.error).startswith("gave up after 3 attempts")
    assert gave_up.retry_after is None  # the client did the waiting; the loop must not
    down = UnreachableError(0, "cannot reach it")
    unreachable = send_with_client(ProjectClient(ScriptedTransport(down)), DECISION)
    assert (unreachable.status, unreachable.attempts, unreachable.error) == (
        0,
        1,
        "cannot reach it",
    )


def test_project_clients_in_a_closed_loop_each_use_their_own_client() -> None:
    opened: list[ProjectClient] = []

    def connect() -> ProjectClient:
        opened.append(ProjectClient(ScriptedTransport({"timing": {}})))
        return opened[-1]

    samples = run_clients(concurrent_decisions(5, series=0, events=1), 2, connect, send_with_client)
    assert [s.reply.status for s in samples] == [200] * 5
    assert len(opened) == 2
    assert all(caller.counter.inner.closed for caller in opened)  # type: ignore[attr-defined]


def call(seconds: float, status: int = 200, attempts: int = 1, client: int = 0) -> Sample:
    return Sample(0.0, seconds, Reply(status, attempts=attempts), client)


def test_client_level_counts_final_failures_and_their_time() -> None:
    level = summarize_client_level(
        2,
        [
            call(1.0),
            call(12.0, attempts=5),
            call(30.5, status=503, attempts=20, client=1),
            call(2.0, status=0, client=1),  # no answer at all: a failure too
            call(3.0, client=1),
        ],
    )
    assert level.failure_fraction == pytest.approx(2 / 5)
    assert level.final_failure_statuses == {"503": 1, "0": 1}
    assert level.final_failure_seconds is not None
    assert level.final_failure_seconds["max"] == pytest.approx(30.5)
    assert level.final_failure_seconds["p50"] == pytest.approx(16.25)
    assert level.retried_calls == 2
    assert level.attempts["max"] == 20
    assert level.level.latency_seconds["max"] == pytest.approx(12.0)  # answered calls only
    assert level.level.ok_per_client == (1, 2)
    assert json.dumps(level.as_json())
    none_failed = summarize_client_level(1, [call(1.0)])
    assert none_failed.final_failure_seconds is None
    assert none_failed.failure_fraction == 0


SHARED_TIMING = {"queue_seconds": 0.01, "scoring_seconds": 39.0, "passes": 13, "input_tokens": 9000}
SHARED_ANSWER = {"results": [], "timing": SHARED_TIMING}


def test_probes_read_the_servers_timing_with_defaults() -> None:
    long = read_probe(200, 5.0, 40.0, SHARED_ANSWER)
    assert (long.passes, long.scoring_seconds, long.input_tokens) == (13, 39.0, 9000)
    single = read_probe(
        200, 6.0, 4.0, {"result": {"input_tokens": 117}, "timing": {"queue_seconds": 2.0}}
    )
    assert (single.queue_seconds, single.input_tokens, single.passes) == (2.0, 117, None)
    refused = read_probe(503, 6.0, 0.1, '{"error": "busy"}')
    assert (refused.status, refused.error, refused.queue_seconds) == (
        503,
        '{"error": "busy"}',
        None,
    )
    assert read_probe(200, 0.0, 1.0, {}).passes is None  # an older server: no timing


def check(long: Probe, small: Probe) -> HeadOfLine:
    return HeadOfLine(64, long, small)


def test_head_of_line_is_read_in_passes_of_the_long_request() -> None:
    long = read_probe(200, 5.0, 40.0, SHARED_ANSWER)
    small = Probe(200, 6.0, 4.5, queue_seconds=2.0, input_tokens=117)
    good = check(long, small)
    assert good.pass_seconds == pytest.approx(3.0)
    assert good.delay_seconds == pytest.approx(1.0)
    assert good.problem() is None
    assert json.dumps(good.as_json())
    one_pass = read_probe(200, 5.0, 3.0, {"timing": {**SHARED_TIMING, "passes": 1}})
    assert (
        check(one_pass, small).problem() == "the long request took one pass: nothing to wait behind"
    )
    failed = check(Probe(503, 5.0, 50.0, error="deadline"), small)
    assert failed.pass_seconds is None
    assert failed.problem() == "the long request got 503: deadline"
    # A small decision that finally failed is measured (a MISS), not unreadable.
    assert check(long, Probe(503, 6.0, 25.0, error="gave up", attempts=6)).problem() is None
    untimed = check(long, Probe(200, 6.0, 1.0))
    assert "no timing" in str(untimed.problem())


class Clocked(ScriptedTransport):
    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> object:
        self.sent = time.perf_counter()
        return super().post(body, retry_token, content_type)


SMALL_ANSWER = {"result": {"input_tokens": 117}, "timing": {"queue_seconds": 0.2}}


def _head_of_line(
    handler: Callable[[httpx.Request], httpx.Response], small: Callable[[], ProjectClient]
) -> HeadOfLine:
    """The overload plan's head-of-line probe, 0.1 s apart, against `handler`."""
    long, decision = OVERLOAD_PLAN.head_of_line()
    return head_of_line(
        "http://test",
        long,
        decision,
        0.1,
        transport=httpx.MockTransport(handler),
        small_client=small,
    )


def test_head_of_line_sends_the_small_decision_while_the_long_one_runs() -> None:
    sizes: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sizes.append(len(json.loads(request.content)["decisions"]))
        time.sleep(0.4)
        return httpx.Response(200, json=SHARED_ANSWER)

    busy = BusyError(503, "busy: overloaded", retry_after_s=0.0)
    small_client = Clocked(busy, SMALL_ANSWER)
    started = time.perf_counter()
    result = _head_of_line(handler, lambda: ProjectClient(small_client, retry=NO_WAIT))
    assert 0.1 <= small_client.sent - started < 0.4  # while the long one was in
    assert sizes == [20]
    assert (result.decisions, result.planned) == (20, 20)
    assert (result.long.passes, result.small.queue_seconds) == (13, 0.2)
    assert result.small.attempts == 2  # refused once, retried by the project's client
    assert result.delay_seconds >= 0.1
    assert result.long.seconds >= 0.4
    assert small_client.closed


OVER_BUDGET = (
    '{"error":"decisions: the request needs about 97 s of scoring at this model\'s measured '
    'speed; a request may take 50 s (SEMIF_REQUEST_TIMEOUT_S); send fewer or shorter decisions"}'
)


def test_a_long_request_over_the_servers_budget_is_resent_smaller() -> None:
    assert fitted_count(64, OVER_BUDGET) == 16  # 64 * 0.5 * 50 / 97
    assert fitted_count(3, OVER_BUDGET) is None  # one question would not span passes
    assert fitted_count(64, '{"error": "the request costs 20000 tokens"}') is None
    sizes: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sizes.append(len(json.loads(request.content)["decisions"]))
        if sizes[-1] > 10:
            return httpx.Response(400, text=OVER_BUDGET)
        time.sleep(0.2)
        return httpx.Response(200, json=SHARED_ANSWER)

    result = _head_of_line(handler, lambda: ProjectClient(ScriptedTransport(SMALL_ANSWER)))
    assert sizes == [20, 5]  # 20 * 0.5 * 50 / 97, then it fits
    assert (result.decisions, result.planned, result.long.status) == (5, 20, 200)
    assert result.delay_seconds >= 0.1  # from the send that was scored


LATE_OVER_BUDGET = OVER_BUDGET.replace("this model's measured speed", "its first passes' speed")


def test_a_long_request_found_over_budget_after_its_first_pass_is_measured_again_smaller() -> None:
    """The server's 400 may come after the long request's first pass (its own speed), when
    the small decision was already sent: both are sent again, the long one resized."""
    sizes: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sizes.append(len(json.loads(request.content)["decisions"]))
        time.sleep(0.2)  # past the 0.1 s delay: the small decision goes out meanwhile
        if sizes[-1] > 10:
            return httpx.Response(400, text=LATE_OVER_BUDGET)
        return httpx.Response(200, json=SHARED_ANSWER)

    small_client = ScriptedTransport(SMALL_ANSWER, SMALL_ANSWER)
    result = _head_of_line(handler, lambda: ProjectClient(small_client))
    assert sizes == [20, 5]
    assert (result.decisions, result.long.status, result.small.status) == (5, 200, 200)
    assert result.delay_seconds >= 0.1


def test_overload_lines_state_failures_and_the_wait_in_passes() -> None:
    run = ConcurrencyRun(plan=OVERLOAD_PLAN)
    assert overload_lines(run) == []
    run.client = summarize_client_level(
        4, [call(1.0), call(20.0, status=503, attempts=9), call(3.0), call(2.0)]
    )
    long = read_probe(200, 5.0, 40.0, SHARED_ANSWER)
    run.head_of_line = check(long, Probe(200, 6.0, 4.5, queue_seconds=1.5, input_tokens=117))
    client, wait = overload_lines(run)
    assert client.startswith(
        "project client, 4 clients: 1 of 4 calls failed after retries (25.0 %)"
    )
    assert "time to a final failure p50 20.0 s" in client
    assert "13 passes of 3.00 s" in wait
    assert "queued 1.50 s (0.50 passes) and took 4.50 s (1.50 passes)" in wait
    run.head_of_line = check(Probe(503, 5.0, 50.0, error="deadline"), Probe(200, 6.0, 1.0))
    assert (
        overload_lines(run)[1] == "head of line: not measured (the long request got 503: deadline)"
    )
    assert format_levels(run).splitlines()[-2:] == overload_lines(run)
