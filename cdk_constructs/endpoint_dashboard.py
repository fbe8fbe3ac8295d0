"""One CloudWatch dashboard per endpoint, named like the endpoint.

It shows what SageMaker counts at the front door (invocations, errors, latency, requests in
the container, instances), the state of every alarm on the endpoint, and the container's own
signals as PromQL: the adapter's queue, batch fill, prefix hit ratio, scoring speed, 429s and
503s on a decision endpoint (`decision_queries`), llama-server's slots and token speeds on
the standard one (`standard_queries`). Those signals reach CloudWatch through detailed
observability's OpenTelemetry path, where only PromQL reads them, and a dashboard body has
no documented PromQL widget (aws-cdk-lib has none either), so the dashboard lists each query
with the endpoint's label filled in, ready for Query Studio; the PromQL alarms evaluate
theirs and show their state next to the others.

Latency is drawn here and alarmed on nowhere: under admission control a decision request's
queue wait is part of `ModelLatency` by design.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aws_cdk import aws_cloudwatch as cloudwatch
from constructs import Construct

from cdk_constructs.endpoint_operations import (
    COMPONENT_NAMESPACE,
    COPY_SAMPLE_METRIC,
    INSTANCE_NAMESPACE,
    INVOCATION_NAMESPACE,
    NO_CAPACITY_METRIC,
    SIGNAL_WINDOW,
    component_dimensions,
    endpoint_selector,
    median_allowed_token_mass,
    refused_share,
    sagemaker_metric,
    seconds_per_decoded_row,
    signal_rate,
    unavailable_share,
)
from cdk_constructs.sagemaker_endpoint import VARIANT_NAME

WIDTH = 24  # a dashboard row
GRAPH_WIDTH = 8
GRAPH_HEIGHT = 6


def _by_cause(endpoint_name: str, metric: str) -> str:
    return f"sum by (cause) (rate({metric}{endpoint_selector(endpoint_name)}[{SIGNAL_WINDOW}]))"


def decision_queries(endpoint_name: str) -> dict[str, str]:
    """The PromQL for the operator's questions about one decision endpoint's adapter, by
    title (the alarms' own expressions among them, so the dashboard reads what they read)."""
    name = endpoint_name
    where = endpoint_selector(name)
    reused = signal_rate(name, "semif_prompt_tokens_total", 'source="reused"')
    read = signal_rate(name, "semif_prompt_tokens_total", 'source=~"reused|evaluated"')
    choices = signal_rate(name, "semif_questions_total", 'kind="choice"')
    return {
        "Requests waiting for the worker": f"sum(semif_queue_depth{where})",
        "Requests admitted and not yet answered": f"sum(semif_in_flight_requests{where})",
        "p95 queue wait (seconds)": (
            "histogram_quantile(0.95, sum by (le) "
            f"(rate(semif_queue_wait_seconds_bucket{where}[{SIGNAL_WINDOW}])))"
        ),
        "Batch fill (requests per pass)": (
            f"{signal_rate(name, 'semif_pass_requests_sum')} / "
            f"{signal_rate(name, 'semif_pass_requests_count')}"
        ),
        "Seconds per decoded row, per instance (scoring speed; the ScoringSpeed alarm)": (
            seconds_per_decoded_row(name)
        ),
        "Median allowed-token mass, per instance (the LetterMass alarm)": (
            median_allowed_token_mass(name)
        ),
        "Prefix hit ratio (reused / input tokens)": f"{reused} / {read}",
        "Abstention rate (of choice questions)": (
            f"{signal_rate(name, 'semif_abstentions_total')} / {choices}"
        ),
        "Refused share (429: load, retried by the caller; a capacity signal, not paged)": (
            refused_share(name)
        ),
        "429s a second, by cause": _by_cause(name, "semif_refused_total"),
        "Unavailable share (503: failures; the Unavailable alarm)": unavailable_share(name),
        "503s a second, by cause": _by_cause(name, "semif_unavailable_total"),
    }


def standard_queries(endpoint_name: str) -> dict[str, str]:
    """The PromQL for llama-server's own metrics (`--metrics`, `llamacpp:*`) on the standard
    endpoint, by title: its slots, and its prompt and generation speeds per instance."""
    name = endpoint_name
    where = endpoint_selector(name)

    def per_token(seconds: str, tokens: str) -> str:
        return (
            f"{signal_rate(name, seconds, per_instance=True)} / "
            f"{signal_rate(name, tokens, per_instance=True)}"
        )

    return {
        "Requests in a slot (llamacpp:requests_processing)": (
            f"sum(llamacpp:requests_processing{where})"
        ),
        "Requests waiting for a slot (llamacpp:requests_deferred)": (
            f"sum(llamacpp:requests_deferred{where})"
        ),
        "Prompt tokens a second": signal_rate(name, "llamacpp:prompt_tokens_total"),
        "Generated tokens a second": signal_rate(name, "llamacpp:tokens_predicted_total"),
        "Seconds per prompt token, per instance": per_token(
            "llamacpp:prompt_seconds_total", "llamacpp:prompt_tokens_total"
        ),
        "Seconds per generated token, per instance": per_token(
            "llamacpp:tokens_predicted_seconds_total", "llamacpp:tokens_predicted_total"
        ),
    }


class EndpointDashboard(Construct):
    """The dashboard `endpoint_name` gets: three graphs of SageMaker's own metrics, an
    instance count, the alarms' states, and the container's PromQL (`queries`, by title).

    With `inference_component_name` (the model is that component, scaled to zero when
    idle) a row for its copies: how many run (the samples a minute of each copy's
    `CPUUtilizationNormalized`, one per copy), the calls refused for want of one
    (`NoCapacityInvocationFailures`: how long a wake-up took is the run of minutes with
    refusals), and the requests per copy its target tracking reads. On GPU pools
    (`instance_types`) the copies are counted per pool type too (`InstanceType`): which
    types the wake-ups found capacity on."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        alarms: Sequence[cloudwatch.IAlarm],
        queries: Mapping[str, str],
        inference_component_name: str | None = None,
        instance_types: Sequence[str] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        dimensions = {"EndpointName": endpoint_name, "VariantName": VARIANT_NAME}

        def metric(namespace: str, name: str, statistic: str, label: str) -> cloudwatch.Metric:
            return sagemaker_metric(namespace, name, dimensions, statistic, label)

        def graph(title: str, *metrics: cloudwatch.IMetric) -> cloudwatch.GraphWidget:
            return cloudwatch.GraphWidget(
                title=title, left=list(metrics), width=GRAPH_WIDTH, height=GRAPH_HEIGHT
            )

        traffic = graph(
            "Invocations and errors (a minute)",
            metric(INVOCATION_NAMESPACE, "Invocations", "Sum", "invocations"),
            metric(INVOCATION_NAMESPACE, "Invocation4XXErrors", "Sum", "4XX"),
            metric(INVOCATION_NAMESPACE, "Invocation5XXErrors", "Sum", "5XX"),
        )
        latency = graph(
            "Model latency (microseconds)",
            *(
                metric(INVOCATION_NAMESPACE, "ModelLatency", stat, stat)
                for stat in ("p50", "p95", "p99")
            ),
        )
        # Every instance publishes CPUUtilization once a minute, so the samples a minute
        # count the instances serving (0 while none reports).
        instances = graph(
            "Instances and requests in the container",
            metric(INSTANCE_NAMESPACE, "CPUUtilization", "SampleCount", "instances"),
            metric(
                INVOCATION_NAMESPACE,
                "ConcurrentRequestsPerModel",
                "Maximum",
                "requests in the container (max)",
            ),
        )
        alarm_states = cloudwatch.AlarmStatusWidget(
            title="Alarms", alarms=list(alarms), width=WIDTH, height=4
        )
        lines = [
            f"## The container's signals ({SIGNAL_WINDOW} windows)",
            "Paste a query into CloudWatch Query Studio (PromQL). The container serves them "
            "on `/metrics`; detailed observability publishes them.",
            "",
            *(f"- **{title}**: `{query}`" for title, query in queries.items()),
        ]
        notes = cloudwatch.TextWidget(
            markdown="\n".join(lines), width=WIDTH, height=2 + len(queries)
        )
        rows: list[list[cloudwatch.IWidget]] = [[traffic, latency, instances]]
        if inference_component_name is not None:
            copies = component_dimensions(inference_component_name)
            per_type = [
                sagemaker_metric(
                    COMPONENT_NAMESPACE,
                    COPY_SAMPLE_METRIC,
                    component_dimensions(inference_component_name, instance_type),
                    "SampleCount",
                    f"copies on {instance_type}",
                )
                for instance_type in instance_types
            ]
            rows.append(
                [
                    graph(
                        "Copies, and calls refused without one (wake-ups)",
                        sagemaker_metric(
                            COMPONENT_NAMESPACE, COPY_SAMPLE_METRIC, copies, "SampleCount", "copies"
                        ),
                        *per_type,
                        sagemaker_metric(
                            INVOCATION_NAMESPACE,
                            NO_CAPACITY_METRIC,
                            copies,
                            "Sum",
                            "calls refused: no copy (NoCapacityInvocationFailures)",
                        ),
                        sagemaker_metric(
                            INVOCATION_NAMESPACE,
                            "ConcurrentRequestsPerCopy",
                            copies,
                            "Maximum",
                            "requests per copy (max)",
                        ),
                    )
                ]
            )
        self.dashboard = cloudwatch.Dashboard(
            self,
            "Dashboard",
            dashboard_name=endpoint_name,
            widgets=[*rows, [alarm_states], [notes]],
        )
