"""One CloudWatch dashboard per decision endpoint, named like the endpoint.

It shows what SageMaker counts at the front door (invocations, errors, latency, requests in
the container, instances), the state of every alarm on the endpoint, and the container's own
signals (queue, batch fill, prefix hit ratio, abstention rate) as PromQL. Those signals reach
CloudWatch through detailed observability's OpenTelemetry path, where only PromQL reads
them, and a dashboard body has no documented PromQL widget (aws-cdk-lib has none either), so
the dashboard lists each query with the endpoint's label filled in, ready for Query Studio;
the two signal alarms evaluate theirs and show their state next to the others.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import Duration
from aws_cdk import aws_cloudwatch as cloudwatch
from constructs import Construct

from cdk_constructs.endpoint_operations import (
    INSTANCE_NAMESPACE,
    INVOCATION_NAMESPACE,
    PERIOD,
    SIGNAL_WINDOW,
    endpoint_selector,
)
from cdk_constructs.sagemaker_endpoint import VARIANT_NAME

WIDTH = 24  # a dashboard row
GRAPH_WIDTH = 8
GRAPH_HEIGHT = 6


def container_queries(endpoint_name: str) -> dict[str, str]:
    """The PromQL for the operator's questions about one endpoint's container, by title."""
    window = SIGNAL_WINDOW

    def rate(metric: str, *matchers: str) -> str:
        return f"sum(rate({metric}{endpoint_selector(endpoint_name, *matchers)}[{window}]))"

    where = endpoint_selector(endpoint_name)
    reused = rate("semif_prompt_tokens_total", 'source="reused"')
    read = rate("semif_prompt_tokens_total", 'source=~"reused|evaluated"')
    choices = rate("semif_questions_total", 'kind="choice"')
    return {
        "Requests waiting for the worker": f"sum(semif_queue_depth{where})",
        "Requests admitted and not yet answered": f"sum(semif_in_flight_requests{where})",
        "p95 queue wait (seconds)": (
            "histogram_quantile(0.95, sum by (le) "
            f"(rate(semif_queue_wait_seconds_bucket{where}[{window}])))"
        ),
        "Batch fill (requests per pass)": (
            f"{rate('semif_pass_requests_sum')} / {rate('semif_pass_requests_count')}"
        ),
        "Prefix hit ratio (reused / input tokens)": f"{reused} / {read}",
        "Abstention rate (of choice questions)": f"{rate('semif_abstentions_total')} / {choices}",
        "503s a second, by cause": (
            f"sum by (cause) (rate(semif_unavailable_total{where}[{window}]))"
        ),
    }


class DecisionDashboard(Construct):
    """The dashboard `endpoint_name` gets: three graphs of SageMaker's own metrics, an
    instance count, the alarms' states, and the container's PromQL."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        alarms: Sequence[cloudwatch.IAlarm],
    ) -> None:
        super().__init__(scope, construct_id)
        dimensions = {"EndpointName": endpoint_name, "VariantName": VARIANT_NAME}

        def metric(
            namespace: str, name: str, statistic: str, label: str, period: Duration = PERIOD
        ) -> cloudwatch.Metric:
            return cloudwatch.Metric(
                namespace=namespace,
                metric_name=name,
                dimensions_map=dimensions,
                statistic=statistic,
                period=period,
                label=label,
            )

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
        queries = container_queries(endpoint_name)
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
        self.dashboard = cloudwatch.Dashboard(
            self,
            "Dashboard",
            dashboard_name=endpoint_name,
            widgets=[[traffic, latency, instances], [alarm_states], [notes]],
        )
