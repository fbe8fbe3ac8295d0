"""The offline figures of `semif-bench-report`: `semif batch local` on a shuffled file of
many questions about many states, against the same lines sent as single online requests
from closed-loop clients, and against the limit measured in process in the same run.

- the limit: the server's own service in this process (`load_service` on its settings),
  each state's questions one shared-state request (`decisions.decide`), from a cleared
  cache, submitted as a JSON Lines body feeds its groups (adapter/lines.py: while the
  scheduler wants more work), so every pass is full: one batched request per state group,
  no HTTP, no JSON, no waiting on a client;
- offline: `run_local` (client/batch_local.py) with its defaults, the whole file, against a
  fresh `serve`;
- online: the same lines, one decision per request, from `online_clients` closed-loop
  clients (bench.concurrency.closed_loop), against another fresh `serve`.
Each phase runs alone (one computes at a time), each server from a cold cache, so neither
path finds the other's states resident.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapter.decisions import decide
from adapter.errors import BusyError
from adapter.lines import FEED_POLL_S, QUEUED_WAIT_S
from adapter.schema import Decision
from adapter.service import DecisionService
from adapter.settings import Settings
from bench.concurrency import closed_loop, send_decision, summarize_level
from bench.local import InProcessModel, serve_model, weight_buffers_setting
from bench.tasks import single_body
from bench.workload import account_state, shared_decisions
from client.batch_local import run_local
from client.decision_client import DecisionClient

# States far from every other phase's variants, so no cache holds them from elsewhere.
_VARIANT_BASE = 700_000


@dataclass(frozen=True)
class OfflinePlan:
    """How large the offline file is: `states` x `questions` single-decision lines."""

    states: int
    questions: int
    state_events: int  # ~30 tokens each
    online_clients: int = 16


@dataclass
class OfflineRun:
    plan: OfflinePlan
    lines: int = 0
    limit_seconds: float = 0.0
    batch_seconds: float = 0.0
    online_seconds: float = 0.0
    online_non_200: int = 0
    batch_errors: int = 0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def limit_per_second(self) -> float:
        return self.lines / self.limit_seconds

    @property
    def batch_per_second(self) -> float:
        """Decisions answered (an error line is none) a second."""
        return (self.lines - self.batch_errors) / self.batch_seconds

    @property
    def online_per_second(self) -> float:
        """Decisions answered a second: refused requests are none (goodput)."""
        return (self.lines - self.online_non_200) / self.online_seconds

    def as_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "decisions_per_second": {
                "limit": self.limit_per_second,
                "batch_local": self.batch_per_second,
                "online": self.online_per_second,
            },
        }


def offline_decisions(plan: OfflinePlan) -> list[list[Decision]]:
    """The questions about each state, state by state."""
    groups = []
    for index in range(plan.states):
        variant = _VARIANT_BASE + index
        state = account_state(plan.state_events, variant, variant * plan.state_events)
        asked = shared_decisions(state, plan.questions)
        groups.append([Decision(f"s{index}-{d.id}", d.state, d.question, d.options) for d in asked])
    return groups


def shuffled_lines(groups: list[list[Decision]]) -> list[Decision]:
    """Every question, in a seeded random order (a day's tickets do not come sorted)."""
    lines = [decision for group in groups for decision in group]
    random.Random(24).shuffle(lines)  # noqa: S311 - a fixed order, not a secret
    return lines


def measure_offline(
    gguf: Path, plan: OfflinePlan, *, log_dir: Path, threads: int, n_gpu_layers: int
) -> OfflineRun:
    groups = offline_decisions(plan)
    lines = shuffled_lines(groups)
    run = OfflineRun(plan, lines=len(lines))
    settings = Settings(
        gguf_path=gguf,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        weight_buffers=weight_buffers_setting(),
    )
    with InProcessModel(settings) as model:
        service = model.service
        decide(service, groups[0][:1], "single")  # untimed: first decodes page weights in
        service.engine.reset()
        started = time.perf_counter()
        RETRIES.clear()
        _feed(service, groups, settings.max_batch_requests)
        run.limit_seconds = time.perf_counter() - started
        run.details["limit_retries"] = dict(Counter(RETRIES))
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "offline.jsonl"
        source.write_text("".join(json.dumps(single_body(decision)) + "\n" for decision in lines))
        out = Path(scratch) / "answers.jsonl"
        with serve_model(
            gguf, log_dir=log_dir, threads=threads, n_gpu_layers=n_gpu_layers
        ) as server:
            _warm_up(server.base_url)
            with DecisionClient.for_url(server.base_url) as client:
                summary = run_local(client, source, out)
        run.batch_seconds = summary.seconds
        run.batch_errors = summary.errors
        run.details["batch_statuses"] = summary.statuses
    with serve_model(gguf, log_dir=log_dir, threads=threads, n_gpu_layers=n_gpu_layers) as server:
        _warm_up(server.base_url)
        level = summarize_level(
            plan.online_clients,
            closed_loop(server.base_url, lines, plan.online_clients, send_decision),
        )
    run.online_seconds = level.wall_seconds
    run.online_non_200 = level.non_200
    run.details.update(
        online_statuses=level.non_200_statuses, online_latency_seconds=level.latency_seconds
    )
    return run


def _feed(service: DecisionService, groups: list[list[Decision]], most: int) -> None:
    """Each group as one shared-state request, started while fewer than `most` are under
    way and the scheduler wants more work (as a JSON Lines body starts its groups)."""
    with ThreadPoolExecutor(max_workers=most) as pool:
        running: set[Future[dict[str, Any]]] = set()
        for group in groups:
            while running and (len(running) >= most or not service.wants_work()):
                done, running = wait(running, timeout=FEED_POLL_S, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()
            before = service.pressure
            started = pool.submit(_decide_in_turn, service, group)
            running.add(started)
            # Until it is queued (it renders first) the backlog does not count it.
            waited = time.monotonic() + QUEUED_WAIT_S
            while not started.done() and service.pressure == before:
                if time.monotonic() > waited:
                    break
                time.sleep(FEED_POLL_S)
        for future in running:
            future.result()


RETRIES: list[str] = []  # the limit's refusals and deadlines, by cause (this run's)


def _decide_in_turn(service: DecisionService, group: list[Decision]) -> dict[str, Any]:
    """The group as one shared-state request; refused for load, it comes back when told
    with its retry token, as a JSON Lines body's group does."""
    token: str | None = None
    while True:
        try:
            return decide(service, group, "shared", retry_token=token)
        except BusyError as error:
            # A group past its deadline is scored again (counted: it is work the limit
            # wasted, `limit_retries`), so the run measures the whole file.
            RETRIES.append(error.cause or "")
            token = error.extra.get("retry_token")
            time.sleep(error.retry_after)


def _warm_up(base_url: str) -> None:
    """One untimed decision about a state no phase asks about (a new process pages its
    weights in on its first decodes)."""
    warm = shared_decisions(account_state(2, _VARIANT_BASE - 1), 1)
    closed_loop(base_url, warm, 1, send_decision)
