"""What keeps an endpoint healthy once deployed: target-tracking scaling and alarms.

Every alarm notifies the environment's topic when it fires and when it clears. The alarms
name the endpoint by its fixed name, so they exist before it: the 5XX and latency alarms
are the endpoint's automatic-rollback alarms during a blue/green update. An asynchronous
endpoint scales on its queue instead, down to zero instances, and alarms on the age of its
oldest queued request (`AsyncEndpointAutoscaling`, `AsyncEndpointAlarms`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from aws_cdk import Duration
from aws_cdk import aws_applicationautoscaling as appscaling
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_sns as sns
from constructs import Construct

from cdk_constructs.sagemaker_endpoint import VARIANT_NAME, SageMakerEndpoint
from cdk_constructs.validation import require


@dataclass(frozen=True, kw_only=True)
class Autoscaling:
    """Target tracking bounds for an endpoint's variant (the target comes from the
    endpoint's own capacity, see `EndpointAutoscaling`)."""

    min_capacity: int
    max_capacity: int

    def __post_init__(self) -> None:
        require(
            1 <= self.min_capacity <= self.max_capacity,
            f"autoscaling: need 1 <= min_capacity ({self.min_capacity}) "
            f"<= max_capacity ({self.max_capacity})",
        )


@dataclass(frozen=True, kw_only=True)
class AlarmThresholds:
    """When an endpoint's alarms fire. Latency is SageMaker's ModelLatency (microseconds)."""

    five_xx_rate_percent: float = 1.0
    p95_model_latency_ms: int = 2000
    max_memory_utilization_percent: float = 90.0
    max_disk_utilization_percent: float = 90.0
    max_gpu_memory_utilization_percent: float = 90.0  # GPU placements only

    def __post_init__(self) -> None:
        require(
            0 < self.five_xx_rate_percent <= 100,
            f"alarms.five_xx_rate_percent: {self.five_xx_rate_percent} is outside (0, 100]",
        )
        require(
            self.p95_model_latency_ms > 0,
            f"alarms.p95_model_latency_ms: {self.p95_model_latency_ms} must be > 0",
        )
        for name in (
            "max_memory_utilization_percent",
            "max_disk_utilization_percent",
            "max_gpu_memory_utilization_percent",
        ):
            value = getattr(self, name)
            require(0 < value <= 100, f"alarms.{name}: {value} is outside (0, 100]")


# SageMaker's ConcurrentRequestsPerModel of an instance-based variant (inference components
# have their own per-copy metric): requests in the container, queued ones included, emitted
# every 10 s, so scale-out reacts in seconds rather than the minute of InvocationsPerInstance.
CONCURRENCY_METRIC = (
    appscaling.PredefinedMetric.SAGEMAKER_VARIANT_CONCURRENT_REQUESTS_PER_MODEL_HIGH_RESOLUTION
)
PERIOD = Duration.minutes(1)
EVALUATION_PERIODS = 5
DATAPOINTS_TO_ALARM = 3
INVOCATION_NAMESPACE = "AWS/SageMaker"
INSTANCE_NAMESPACE = "/aws/sagemaker/Endpoints"
# An alarm to make: construct id suffix, what it watches, the metric, the threshold.
Check = tuple[str, str, cloudwatch.IMetric, float]


def variant_target(
    scope: Construct, endpoint: SageMakerEndpoint, *, min_capacity: int, max_capacity: int
) -> appscaling.ScalableTarget:
    """The variant's instance count as an Application Auto Scaling target (id `Target`)."""
    target = appscaling.ScalableTarget(
        scope,
        "Target",
        service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
        resource_id=f"endpoint/{endpoint.endpoint_name}/variant/{endpoint.variant_name}",
        scalable_dimension="sagemaker:variant:DesiredInstanceCount",
        min_capacity=min_capacity,
        max_capacity=max_capacity,
    )
    # Application Auto Scaling uses its service-linked role for SageMaker; the role the L2
    # construct creates would be unused, so it is removed.
    cfn_target = target.node.default_child
    assert isinstance(cfn_target, appscaling.CfnScalableTarget)
    cfn_target.add_property_deletion_override("RoleARN")
    target.node.try_remove_child("Role")
    # The variant must exist before Application Auto Scaling can register it.
    target.node.add_dependency(endpoint.endpoint)
    return target


class EndpointAutoscaling(Construct):
    """Keep `target_concurrency` concurrent requests per instance, between min and max.

    Concurrency, not invocations per minute: what saturates a batching server is how many
    requests it holds at once, whatever they cost, and the metric counts queued requests, so
    the target can sit below the point where the queue starts to build.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint: SageMakerEndpoint,
        settings: Autoscaling,
        target_concurrency: float,
    ) -> None:
        super().__init__(scope, construct_id)
        require(
            target_concurrency > 0,
            f"autoscaling target_concurrency: {target_concurrency} must be > 0",
        )
        self.target = variant_target(
            self, endpoint, min_capacity=settings.min_capacity, max_capacity=settings.max_capacity
        )
        self.target.scale_to_track_metric(
            "Tracking",
            predefined_metric=CONCURRENCY_METRIC,
            target_value=target_concurrency,
            scale_in_cooldown=Duration.minutes(5),
            scale_out_cooldown=Duration.minutes(1),
        )


class EndpointAlarms(Construct):
    """5XX rate, p95 model latency and instance health (memory, disk, and GPU memory on GPU
    placements) for one variant, each with alarm and OK actions on `topic`.

    With GPU instance pools SageMaker adds an `InstanceType` dimension, so the alarms are
    repeated for each pool type next to the variant-wide set; the types not chosen stay
    without data, which counts as not breaching. `rollback_alarms` are the 5XX and latency
    alarms, for the endpoint's blue/green auto-rollback.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        thresholds: AlarmThresholds,
        topic: sns.ITopic,
        gpu: bool = False,
        instance_types: Sequence[str] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        self.alarms: list[cloudwatch.Alarm] = []
        self.rollback_alarms: list[cloudwatch.Alarm] = []
        base = {"EndpointName": endpoint_name, "VariantName": VARIANT_NAME}
        for instance_type in (None, *instance_types):
            dimensions = base if instance_type is None else {**base, "InstanceType": instance_type}
            label = "" if instance_type is None else f" on {instance_type}"
            prefix = "Variant" if instance_type is None else instance_type.replace(".", "")
            alarms = self._alarm_set(prefix, label, dimensions, thresholds, gpu)
            self.alarms += alarms
            # Rollback watches the per-type 5XX and latency alarms when there are pools (their
            # metrics carry InstanceType), else the variant's: 2 x at most 5 pools fits
            # SageMaker's 10 rollback alarms.
            if (instance_type is None) == (not instance_types):
                self.rollback_alarms += alarms[:2]  # 5XX rate and latency
        action = cloudwatch_actions.SnsAction(topic)
        for alarm in self.alarms:
            alarm.add_alarm_action(action)
            alarm.add_ok_action(action)

    def _alarm_set(
        self,
        prefix: str,
        label: str,
        dimensions: dict[str, str],
        thresholds: AlarmThresholds,
        gpu: bool,
    ) -> list[cloudwatch.Alarm]:
        def metric(namespace: str, name: str, statistic: str) -> cloudwatch.Metric:
            return cloudwatch.Metric(
                namespace=namespace,
                metric_name=name,
                dimensions_map=dimensions,
                statistic=statistic,
                period=PERIOD,
            )

        error_rate = cloudwatch.MathExpression(
            expression="IF(invocations > 0, 100 * FILL(errors, 0) / invocations, 0)",
            using_metrics={
                "errors": metric(INVOCATION_NAMESPACE, "Invocation5XXErrors", "Sum"),
                "invocations": metric(INVOCATION_NAMESPACE, "Invocations", "Sum"),
            },
            period=PERIOD,
            label="5XX error rate (%)",
        )
        checks: list[Check] = [
            ("5xx", "5XX error rate (%)", error_rate, thresholds.five_xx_rate_percent),
            (
                "Latency",
                "p95 ModelLatency (microseconds)",
                metric(INVOCATION_NAMESPACE, "ModelLatency", "p95"),
                thresholds.p95_model_latency_ms * 1000.0,
            ),
            *_health_checks(dimensions, thresholds, gpu),
        ]
        return _threshold_alarms(self, prefix, label, checks)


def _health_checks(
    dimensions: dict[str, str], thresholds: AlarmThresholds, gpu: bool
) -> list[Check]:
    """The instances' memory and disk (and GPU memory on GPU placements), from the metrics
    SageMaker publishes as the endpoint's role."""

    def metric(name: str) -> cloudwatch.Metric:
        return cloudwatch.Metric(
            namespace=INSTANCE_NAMESPACE,
            metric_name=name,
            dimensions_map=dimensions,
            statistic="Maximum",
            period=PERIOD,
        )

    checks: list[Check] = [
        (
            "Memory",
            "instance MemoryUtilization (%)",
            metric("MemoryUtilization"),
            thresholds.max_memory_utilization_percent,
        ),
        (
            "Disk",
            "instance DiskUtilization (%)",
            metric("DiskUtilization"),
            thresholds.max_disk_utilization_percent,
        ),
    ]
    if gpu:
        checks.append(
            (
                "GpuMemory",
                "instance GPUMemoryUtilization (%)",
                metric("GPUMemoryUtilization"),
                thresholds.max_gpu_memory_utilization_percent,
            )
        )
    return checks


def _threshold_alarms(
    scope: Construct, prefix: str, label: str, checks: Sequence[Check]
) -> list[cloudwatch.Alarm]:
    """One alarm per check, above its threshold in 3 of 5 minutes; no data is not breaching
    (an endpoint without traffic, or without instances, is not failing)."""
    return [
        cloudwatch.Alarm(
            scope,
            f"{prefix}{name}",
            alarm_description=f"{description}{label} above {threshold:g}",
            metric=alarm_metric,
            threshold=threshold,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_THRESHOLD,
            evaluation_periods=EVALUATION_PERIODS,
            datapoints_to_alarm=DATAPOINTS_TO_ALARM,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        for name, description, alarm_metric, threshold in checks
    ]


# SageMaker's queue metrics of an asynchronous endpoint (namespace AWS/SageMaker, dimension
# EndpointName only): requests queued or in progress per instance; 1 while requests wait
# and no instance runs; the age of the oldest queued request (seconds).
BACKLOG_PER_INSTANCE_METRIC = "ApproximateBacklogSizePerInstance"
BACKLOG_WITHOUT_CAPACITY_METRIC = "HasBacklogWithoutCapacity"
OLDEST_REQUEST_AGE_METRIC = "ApproximateAgeOfOldestRequest"
# SageMaker's example policy for asynchronous endpoints: scale in after 10 quiet minutes,
# out again after 5.
ASYNC_SCALE_IN_COOLDOWN = Duration.minutes(10)
ASYNC_SCALE_OUT_COOLDOWN = Duration.minutes(5)


def _queue_metric(endpoint_name: str, name: str, statistic: str) -> cloudwatch.Metric:
    return cloudwatch.Metric(
        namespace=INVOCATION_NAMESPACE,
        metric_name=name,
        dimensions_map={"EndpointName": endpoint_name},
        statistic=statistic,
        period=PERIOD,
    )


class AsyncEndpointAutoscaling(Construct):
    """Scale an asynchronous endpoint on its queue, between zero and `max_capacity`.

    Target tracking keeps `target_backlog_per_instance` queued requests per instance
    (`ApproximateBacklogSizePerInstance`, SageMaker's recommended metric) and scales in to
    zero once the queue is empty. At zero instances that metric has nothing to divide by,
    so a request arriving then would wait until the backlog passed the target; instead a
    step policy adds one instance as soon as `HasBacklogWithoutCapacity` reads 1 for a
    minute. Its cooldown is `startup_seconds` (the variant's start-up timeouts): while the
    first instance starts the alarm stays in ALARM, and a second +1 then would start a
    second instance for a backlog the first one will take. The requests wait in
    SageMaker's queue meanwhile.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint: SageMakerEndpoint,
        max_capacity: int,
        target_backlog_per_instance: float,
        startup_seconds: int,
    ) -> None:
        super().__init__(scope, construct_id)
        require(max_capacity >= 1, f"async autoscaling max_capacity: {max_capacity} < 1")
        require(
            target_backlog_per_instance > 0,
            f"async autoscaling target_backlog_per_instance: {target_backlog_per_instance} "
            "must be > 0",
        )
        name = endpoint.endpoint_name
        self.target = variant_target(self, endpoint, min_capacity=0, max_capacity=max_capacity)
        self.target.scale_to_track_metric(
            "Backlog",
            custom_metric=_queue_metric(name, BACKLOG_PER_INSTANCE_METRIC, "Average"),
            target_value=target_backlog_per_instance,
            scale_in_cooldown=ASYNC_SCALE_IN_COOLDOWN,
            scale_out_cooldown=ASYNC_SCALE_OUT_COOLDOWN,
        )
        from_zero = appscaling.StepScalingAction(
            self,
            "FromZero",
            scaling_target=self.target,
            adjustment_type=appscaling.AdjustmentType.CHANGE_IN_CAPACITY,
            metric_aggregation_type=appscaling.MetricAggregationType.AVERAGE,
            cooldown=Duration.seconds(startup_seconds),
        )
        from_zero.add_adjustment(adjustment=1, lower_bound=0)
        self.wake_alarm = cloudwatch.Alarm(
            self,
            "BacklogWithoutCapacity",
            alarm_description=f"{name}: requests wait and no instance runs; start one",
            metric=_queue_metric(name, BACKLOG_WITHOUT_CAPACITY_METRIC, "Average"),
            threshold=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            evaluation_periods=1,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        self.wake_alarm.add_alarm_action(cloudwatch_actions.ApplicationScalingAction(from_zero))


class AsyncEndpointAlarms(Construct):
    """An asynchronous endpoint's alarms, each with alarm and OK actions on `topic`: the
    oldest queued request older than `max_oldest_request_age_seconds` (the queue is not
    draining: too few instances, or none starting), and the instances' memory and disk (and
    GPU memory). Not 5XX rate or model latency: an invocation here is a whole file whose
    latency is minutes by design, and its failures go to the error topic."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        max_oldest_request_age_seconds: int,
        thresholds: AlarmThresholds,
        topic: sns.ITopic,
        gpu: bool = False,
    ) -> None:
        super().__init__(scope, construct_id)
        require(
            max_oldest_request_age_seconds > 0,
            f"async alarms max_oldest_request_age_seconds: {max_oldest_request_age_seconds} "
            "must be > 0",
        )
        checks: list[Check] = [
            (
                "OldestRequest",
                "ApproximateAgeOfOldestRequest (seconds)",
                _queue_metric(endpoint_name, OLDEST_REQUEST_AGE_METRIC, "Maximum"),
                float(max_oldest_request_age_seconds),
            ),
            *_health_checks(
                {"EndpointName": endpoint_name, "VariantName": VARIANT_NAME}, thresholds, gpu
            ),
        ]
        self.alarms = _threshold_alarms(self, "", f" of {endpoint_name}", checks)
        action = cloudwatch_actions.SnsAction(topic)
        for alarm in self.alarms:
            alarm.add_alarm_action(action)
            alarm.add_ok_action(action)


# SageMaker's detailed observability labels every metric it publishes with the endpoint's
# name; a label name with dots is written quoted in PromQL.
ENDPOINT_LABEL = "aws.sagemaker.endpoint.name"
SIGNAL_WINDOW = "10m"


def endpoint_selector(endpoint_name: str, *matchers: str) -> str:
    """The PromQL label selector of one endpoint's series, narrowed by `matchers`
    (`'source="reused"'`)."""
    return "{" + ",".join((f'"{ENDPOINT_LABEL}"="{endpoint_name}"', *matchers)) + "}"


@dataclass(frozen=True, kw_only=True)
class DecisionSignalThresholds:
    """When the decision signals alarm, read from the adapter's own metrics (the container's
    `/metrics`, which SageMaker scrapes): the share of calls answered 503 (overload, past
    what autoscaling catches up with) and the median probability the model gives the option
    labels (a collapse means it stopped answering with them: a wrong model or template)."""

    max_unavailable_percent: float = 25.0
    min_median_allowed_token_mass: float = 0.5

    def __post_init__(self) -> None:
        require(
            0 < self.max_unavailable_percent <= 100,
            f"signal_alarms.max_unavailable_percent: {self.max_unavailable_percent} is "
            "outside (0, 100]",
        )
        require(
            0 < self.min_median_allowed_token_mass < 1,
            f"signal_alarms.min_median_allowed_token_mass: "
            f"{self.min_median_allowed_token_mass} is outside (0, 1)",
        )


class DecisionSignalAlarms(Construct):
    """Two PromQL alarms on the decision endpoint's container metrics (adapter/metrics.py),
    each with alarm and OK actions on `topic`; neither fires without traffic."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        thresholds: DecisionSignalThresholds,
        topic: sns.ITopic,
    ) -> None:
        super().__init__(scope, construct_id)
        where = endpoint_selector(endpoint_name)
        share = thresholds.max_unavailable_percent / 100
        unavailable = (
            f"sum(rate(semif_unavailable_total{where}[{SIGNAL_WINDOW}])) / "
            f"sum(rate(semif_requests_total{where}[{SIGNAL_WINDOW}])) > {share:g}"
        )
        mass = (
            f"histogram_quantile(0.5, sum by (le) "
            f"(rate(semif_allowed_token_mass_bucket{where}[{SIGNAL_WINDOW}]))) "
            f"< {thresholds.min_median_allowed_token_mass:g}"
        )
        self.alarms = [
            cloudwatch.PromQLAlarm(
                self,
                name,
                alarm_description=description,
                query=query,
                evaluation_interval=PERIOD,
                pending_period=Duration.minutes(5),
                recovery_period=Duration.minutes(5),
            )
            for name, description, query in (
                (
                    "Unavailable",
                    f"{endpoint_name}: more than {thresholds.max_unavailable_percent:g} % of "
                    "calls answered 503 (overload, queue timeouts, deadlines) for 5 minutes",
                    unavailable,
                ),
                (
                    "LetterMass",
                    f"{endpoint_name}: median allowed-token mass below "
                    f"{thresholds.min_median_allowed_token_mass:g} for 5 minutes: the model "
                    "stopped answering with the option labels",
                    mass,
                ),
            )
        ]
        action = cloudwatch_actions.SnsAction(topic)
        for alarm in self.alarms:
            alarm.add_alarm_action(action)
            alarm.add_ok_action(action)
