"""What the adapter decides, as Prometheus metrics: `GET /metrics`, which SageMaker scrapes.

For endpoint configurations with detailed observability (the default since June 2026),
SageMaker scrapes a bring-your-own container's Prometheus metrics from `/metrics` on port
8080 (its default path, which CloudFormation's model resource cannot change) and publishes
them to CloudWatch. The per-request log line says the same things one request at a time;
these are their sums and distributions, so an operator can answer from a dashboard: how
many requests and errors, how long they wait, how full the passes are, how much of each
prompt came from a resident prefix, and whether the model still answers with the option
letters.

Conventions: names carry their unit (`_seconds`, `_tokens`), counters end in `_total` in the
exposition, and every label has a small fixed set of values (an API name, a status code, a
429 or 503 cause, a question kind, an option-order mode): never a request id, a state or an
option id. The registry is the app's own, not the process-global default, so two apps in one
process (the tests) never share counts. Every series is exposed with the label `variant`
(SEMIF_VARIANT, the SageMaker variant serving) where one is set: a shadow candidate's
instances publish under the same endpoint name, and the primary's alarms must not read them
(cdk_constructs.endpoint_operations.endpoint_selector).

Threads: the counters are thread-safe (prometheus_client locks each); they are written on the
event loop (a call's outcome), on request threads (a question's readout) and on the worker
(a pass), and read on the event loop when scraped. Nothing here touches the engine: the
gauges read the queue's length and the in-flight count, both plain integers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

# The APIs a call can be (label `api`; "lines": a JSON Lines body, adapter.lines); "unknown"
# when it failed before its body named one.
APIS = ("decision", "systemone", "chat", "lines", "unknown")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MASS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class _Labelled:
    """A registry's series, each with one more label (a collector for the exposition)."""

    def __init__(self, inner: CollectorRegistry, name: str, value: str) -> None:
        self._inner, self._name, self._value = inner, name, value

    def collect(self) -> Iterator[Metric]:
        for family in self._inner.collect():
            family.samples = [
                sample._replace(labels={**sample.labels, self._name: self._value})
                for sample in family.samples
            ]
            yield family

    def describe(self) -> list[Metric]:
        return []  # nothing to check for clashes: the inner registry already did


class Metrics:
    """The adapter's metrics and the one place each is recorded from."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._exposed = self.registry  # label_variant
        registry = self.registry
        self.requests = Counter(
            "semif_requests",
            "Calls answered, by API and HTTP status (499: the client left first)",
            ["api", "status"],
            registry=registry,
        )
        self.request_seconds = Histogram(
            "semif_request_duration_seconds",
            "Time from a call's arrival to its answer, by API",
            ["api"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.queue_seconds = Histogram(
            "semif_queue_wait_seconds",
            "Time a scoring request waited in the queue before its first pass",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # Load and failure apart, as the answers keep them (adapter.errors): the alarms page on
        # the second only.
        self.refused = Counter(
            "semif_refused",
            "429 answers (load: come back later) by cause (queue_full, overloaded, "
            "queue_timeout, deadline)",
            ["cause"],
            registry=registry,
        )
        self.unavailable = Counter(
            "semif_unavailable",
            "503 answers (the server cannot answer) by cause (loading, unhealthy, stopping, "
            "capacity)",
            ["cause"],
            registry=registry,
        )
        self.pass_seconds = Histogram(
            "semif_pass_duration_seconds",
            "Time of one scoring pass (one engine call over the prompts that rode in it)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.pass_requests = Histogram(
            "semif_pass_requests",
            "Requests that shared one scoring pass",
            buckets=COUNT_BUCKETS,
            registry=registry,
        )
        self.pass_prompts = Histogram(
            "semif_pass_prompts",
            "Prompts scored in one pass",
            buckets=COUNT_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "semif_prompt_tokens",
            "Prompt tokens of scoring passes: evaluated (decoded), reused (taken from a "
            "resident prefix), pad (decoded again only for the exact path)",
            ["source"],
            registry=registry,
        )
        self.questions = Counter(
            "semif_questions",
            "Questions scored, by kind (choice, noul, score, multi_label) and option-order mode",
            ["kind", "option_order"],
            registry=registry,
        )
        self.lines = Counter(
            "semif_lines",
            "JSON Lines answered, by the status of each line's answer",
            ["status"],
            registry=registry,
        )
        self.audit_records = Counter(
            "semif_audit_records",
            "Decision audit records written (SEMIF_AUDIT, adapter.audit)",
            registry=registry,
        )
        self.audit_dropped = Counter(
            "semif_audit_dropped",
            "Decision audit records dropped: the writer's queue was full or the log failed",
            registry=registry,
        )
        self.abstentions = Counter(
            "semif_abstentions",
            "Decisions answered as abstained (min_confidence, min_allowed_token_mass)",
            registry=registry,
        )
        self.allowed_token_mass = Histogram(
            "semif_allowed_token_mass",
            "Probability the model gave the option labels at the answer position, by kind",
            ["kind"],
            buckets=MASS_BUCKETS,
            registry=registry,
        )
        self.chat_tokens = Counter(
            "semif_chat_tokens",
            "Chat completion tokens: prompt and completion",
            ["kind"],
            registry=registry,
        )
        self.model_load_seconds = Gauge(
            "semif_model_load_seconds",
            "Seconds the model took to load and pass its start-up probes",
            registry=registry,
        )
        self.queue_depth = Gauge(
            "semif_queue_depth", "Requests waiting for the worker", registry=registry
        )
        self.in_flight = Gauge(
            "semif_in_flight_requests", "Requests admitted and not yet answered", registry=registry
        )

    def watch(self, *, queue_depth: Callable[[], float], in_flight: Callable[[], float]) -> None:
        """Read the two gauges from the runtime when scraped (never stale, never locked)."""
        self.queue_depth.set_function(queue_depth)
        self.in_flight.set_function(in_flight)

    def observe_call(self, api: str, status: int, seconds: float, log: Mapping[str, Any]) -> None:
        """One answered call, from the fields of its log line (adapter.http.answer)."""
        label = api if api in APIS else "unknown"
        self.requests.labels(label, str(status)).inc()
        self.request_seconds.labels(label).observe(seconds)
        for field, counter in (("refused", self.refused), ("unavailable", self.unavailable)):
            cause = log.get(field)
            if isinstance(cause, str):
                counter.labels(cause).inc()
        queued = log.get("queue_seconds")
        if isinstance(queued, int | float):
            self.queue_seconds.observe(queued)
        if label == "chat" and status == 200:
            self.chat_tokens.labels("prompt").inc(log.get("input_tokens", 0))
            self.chat_tokens.labels("completion").inc(log.get("output_tokens", 0))

    def observe_pass(
        self, *, requests: int, prompts: int, evaluated: int, reused: int, pad: int, seconds: float
    ) -> None:
        """One scoring pass (the scheduler's worker)."""
        self.pass_seconds.observe(seconds)
        self.pass_requests.observe(requests)
        self.pass_prompts.observe(prompts)
        self.prompt_tokens.labels("evaluated").inc(evaluated)
        self.prompt_tokens.labels("reused").inc(reused)
        self.prompt_tokens.labels("pad").inc(pad)

    def observe_question(self, kind: str, option_order: str, allowed_token_mass: float) -> None:
        """One question's readout (every API scores its options through the service)."""
        self.questions.labels(kind, option_order).inc()
        self.allowed_token_mass.labels(kind).observe(allowed_token_mass)

    def label_variant(self, variant: str | None) -> None:
        """Expose every series with `variant="<variant>"` (None: as recorded)."""
        self._exposed = self.registry
        if variant is not None:
            self._exposed = CollectorRegistry(auto_describe=False)
            self._exposed.register(_Labelled(self.registry, "variant", variant))

    def exposition(self) -> tuple[bytes, str]:
        """The metrics in Prometheus' text format, and its content type."""
        return generate_latest(self._exposed), CONTENT_TYPE_LATEST
