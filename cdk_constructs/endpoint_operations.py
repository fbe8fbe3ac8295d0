"""What keeps an endpoint healthy once deployed: target-tracking scaling and alarms.

Every alarm notifies the environment's topic when it fires and when it clears. The alarms
name the endpoint by its fixed name, so they exist before it, and some of them are the
endpoint's automatic-rollback alarms during a blue/green update. Those read failures and
model regressions only, never load: the 5XX rate (the adapter answers load with a 429),
and the model's scoring speed and letter mass from its own `/metrics`. Latency is not
alarmed on: under admission control a request's queue wait is part of `ModelLatency` by
design, and the adapter's own deadline already bounds it (a shadow variant's alarms, which
page only, do watch it: there it says whether the candidate keeps up, `EndpointAlarms`).
An asynchronous endpoint scales
on its queue instead, down to zero instances, rolls back on failed invocations, and alarms
on the age of its oldest queued request (`AsyncEndpointAutoscaling`, `AsyncEndpointAlarms`).
A real-time endpoint whose model is an inference component scales its copies instead, down
to zero after an idle spell and up again from a refused call, and pages when a wake-up
takes longer than a start should (`ScaleToZero`, `InferenceComponentAutoscaling`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
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
    """When an endpoint's metric alarms fire: the 5XX rate (failures only, since load is a
    429) and the instances' health. No latency threshold: see the module docstring."""

    five_xx_rate_percent: float = 1.0
    max_memory_utilization_percent: float = 90.0
    max_disk_utilization_percent: float = 90.0
    max_gpu_memory_utilization_percent: float = 90.0  # GPU placements only

    def __post_init__(self) -> None:
        for name in (
            "five_xx_rate_percent",
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
# How long a rollback alarm takes to fire once a regression starts, which a blue/green
# update's bake (`Rollout.wait_interval_seconds`, the only time SageMaker watches the alarms)
# must cover: a metric alarm needs DATAPOINTS_TO_ALARM breaching minutes, and SageMaker's
# one-minute metrics reach CloudWatch up to about two minutes late; a PromQL alarm needs its
# pending period, one evaluation and one publication of the container's metrics.
METRIC_DELAY_SECONDS = 120
METRIC_ALARM_SECONDS = DATAPOINTS_TO_ALARM * int(PERIOD.to_seconds()) + METRIC_DELAY_SECONDS
PROMQL_PENDING = Duration.minutes(5)


def promql_alarm_seconds(publish_frequency_seconds: int) -> int:
    """How long a PromQL rollback alarm takes to fire when the container's metrics are
    published every `publish_frequency_seconds` (MetricsConfig)."""
    return int(PROMQL_PENDING.to_seconds() + PERIOD.to_seconds()) + publish_frequency_seconds


def variant_target(
    scope: Construct, endpoint: SageMakerEndpoint, *, min_capacity: int, max_capacity: int
) -> appscaling.ScalableTarget:
    """The variant's instance count as an Application Auto Scaling target (id `Target`)."""
    return _sagemaker_target(
        scope,
        resource_id=f"endpoint/{endpoint.endpoint_name}/variant/{endpoint.variant_name}",
        dimension="sagemaker:variant:DesiredInstanceCount",
        min_capacity=min_capacity,
        max_capacity=max_capacity,
        scaled=endpoint.endpoint,
    )


def _sagemaker_target(
    scope: Construct,
    *,
    resource_id: str,
    dimension: str,
    min_capacity: int,
    max_capacity: int,
    scaled: Construct,
) -> appscaling.ScalableTarget:
    """A SageMaker scalable target (id `Target`), registered once `scaled` exists."""
    target = appscaling.ScalableTarget(
        scope,
        "Target",
        service_namespace=appscaling.ServiceNamespace.SAGEMAKER,
        resource_id=resource_id,
        scalable_dimension=dimension,
        min_capacity=min_capacity,
        max_capacity=max_capacity,
    )
    # Application Auto Scaling uses its service-linked role for SageMaker; the role the L2
    # construct creates would be unused, so it is removed.
    cfn_target = target.node.default_child
    assert isinstance(cfn_target, appscaling.CfnScalableTarget)
    cfn_target.add_property_deletion_override("RoleARN")
    target.node.try_remove_child("Role")
    # The variant (or component) must exist before Application Auto Scaling can register it.
    target.node.add_dependency(scaled)
    return target


def track_concurrency(
    target: appscaling.ScalableTarget, metric: appscaling.PredefinedMetric, value: float
) -> None:
    """Target tracking (`Tracking`) of `value` requests in flight per instance or copy:
    out within a minute, in after 5 quiet ones."""
    target.scale_to_track_metric(
        "Tracking",
        predefined_metric=metric,
        target_value=value,
        scale_in_cooldown=Duration.minutes(5),
        scale_out_cooldown=Duration.minutes(1),
    )


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
        track_concurrency(self.target, CONCURRENCY_METRIC, target_concurrency)


class EndpointAlarms(Construct):
    """5XX rate and instance health (memory, disk, and GPU memory on GPU placements) for
    one variant (`variant_name`, the production one unless named), each with alarm and OK
    actions on `topic`.

    With GPU instance pools SageMaker adds an `InstanceType` dimension, so the alarms are
    repeated for each pool type next to the variant-wide set; the types not chosen stay
    without data, which counts as not breaching. `rollback_alarms` are the 5XX alarms (one
    per pool type with pools, whose metrics carry InstanceType, else the variant's): a
    failure, never load, since the adapter answers load with 429.

    `max_latency_seconds` adds a `ModelLatency` p90 alarm, for a shadow variant: its answers
    reach no caller, so only its metrics say whether it would keep up with the traffic it
    shadows (a shadow's alarms page and never roll anything back).

    `inference_component_name`: the model is that inference component, whose invocation
    metrics SageMaker publishes under `InferenceComponentName` (with pools, per pool type
    under `InferenceComponentName` and `InstanceType` too), so the 5XX rate (still the
    rollback alarm, now of the component's rolling updates) reads those; the instances'
    health stays the variant's (per pool type with pools).
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
        variant_name: str = VARIANT_NAME,
        max_latency_seconds: float | None = None,
        inference_component_name: str | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        require(
            max_latency_seconds is None or max_latency_seconds > 0,
            f"alarms max_latency_seconds: {max_latency_seconds} must be > 0",
        )
        self.alarms: list[cloudwatch.Alarm] = []
        self.rollback_alarms: list[cloudwatch.Alarm] = []
        base = {"EndpointName": endpoint_name, "VariantName": variant_name}
        variant = "" if variant_name == VARIANT_NAME else f" of variant {variant_name}"
        for instance_type in (None, *instance_types):
            dimensions = base if instance_type is None else {**base, "InstanceType": instance_type}
            label = variant if instance_type is None else f"{variant} on {instance_type}"
            prefix = "Variant" if instance_type is None else instance_type.replace(".", "")
            latency = (
                []
                if max_latency_seconds is None
                else [_latency_check(dimensions, max_latency_seconds)]
            )
            failures, *health = _threshold_alarms(
                self,
                prefix,
                label,
                [
                    _five_xx_check(
                        dimensions
                        if inference_component_name is None
                        else component_dimensions(inference_component_name, instance_type),
                        thresholds.five_xx_rate_percent,
                    ),
                    *_health_checks(dimensions, thresholds, gpu),
                    *latency,
                ],
            )
            self.alarms += [failures, *health]
            if (instance_type is None) == (not instance_types):
                self.rollback_alarms.append(failures)
        _notify(self.alarms, topic)


def sagemaker_metric(
    namespace: str,
    name: str,
    dimensions: Mapping[str, str],
    statistic: str,
    label: str | None = None,
) -> cloudwatch.Metric:
    """One of SageMaker's metrics, a minute at a time (alarms and dashboards alike)."""
    return cloudwatch.Metric(
        namespace=namespace,
        metric_name=name,
        dimensions_map=dict(dimensions),
        statistic=statistic,
        period=PERIOD,
        label=label,
    )


def _notify(alarms: Sequence[cloudwatch.AlarmBase], topic: sns.ITopic) -> None:
    """Alarm and OK actions on `topic`: whoever it reaches hears both."""
    action = cloudwatch_actions.SnsAction(topic)
    for alarm in alarms:
        alarm.add_alarm_action(action)
        alarm.add_ok_action(action)


def component_dimensions(
    inference_component_name: str, instance_type: str | None = None
) -> dict[str, str]:
    """The dimensions of an inference component's metrics (AWS/SageMaker's invocation
    metrics, `/aws/sagemaker/InferenceComponents`' utilization), narrowed to its copies on
    one pool type by `instance_type` (the combination SageMaker publishes with pools)."""
    dimensions = {"InferenceComponentName": inference_component_name}
    if instance_type is not None:
        dimensions["InstanceType"] = instance_type
    return dimensions


def _five_xx_check(dimensions: dict[str, str], percent: float) -> Check:
    """The share of invocations the container answered 5XX (no invocations: 0)."""

    error_rate = cloudwatch.MathExpression(
        expression="IF(invocations > 0, 100 * FILL(errors, 0) / invocations, 0)",
        using_metrics={
            name: sagemaker_metric(INVOCATION_NAMESPACE, metric, dimensions, "Sum")
            for name, metric in (("errors", "Invocation5XXErrors"), ("invocations", "Invocations"))
        },
        period=PERIOD,
        label="5XX error rate (%)",
    )
    return ("5xx", "5XX error rate (%)", error_rate, percent)


def _latency_check(dimensions: dict[str, str], seconds: float) -> Check:
    """The 90th percentile of the container's answer time (`ModelLatency`, microseconds)."""
    return (
        "Latency",
        "ModelLatency p90 (microseconds)",
        sagemaker_metric(INVOCATION_NAMESPACE, "ModelLatency", dimensions, "p90"),
        seconds * 1_000_000,
    )


def _health_checks(
    dimensions: dict[str, str], thresholds: AlarmThresholds, gpu: bool
) -> list[Check]:
    """The instances' memory and disk (and GPU memory on GPU placements), from the metrics
    SageMaker publishes as the endpoint's role."""

    def metric(name: str) -> cloudwatch.Metric:
        return sagemaker_metric(INSTANCE_NAMESPACE, name, dimensions, "Maximum")

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
# and no instance runs; the age of the oldest queued request (seconds). And its failed
# invocations (dimensions EndpointName and VariantName; an asynchronous endpoint publishes
# no `Invocations`, so no 5XX rate): any cause, the container's error answer, a timeout,
# the request not read from S3 or the answer not written.
BACKLOG_PER_INSTANCE_METRIC = "ApproximateBacklogSizePerInstance"
BACKLOG_WITHOUT_CAPACITY_METRIC = "HasBacklogWithoutCapacity"
OLDEST_REQUEST_AGE_METRIC = "ApproximateAgeOfOldestRequest"
FAILED_INVOCATIONS_METRIC = "InvocationFailures"
# SageMaker's example policy for asynchronous endpoints: scale in after 10 quiet minutes,
# out again after 5.
ASYNC_SCALE_IN_COOLDOWN = Duration.minutes(10)
ASYNC_SCALE_OUT_COOLDOWN = Duration.minutes(5)


def _queue_metric(endpoint_name: str, name: str, statistic: str) -> cloudwatch.Metric:
    return sagemaker_metric(INVOCATION_NAMESPACE, name, {"EndpointName": endpoint_name}, statistic)


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
        self.wake_alarm = _wake_from_zero(
            self,
            "BacklogWithoutCapacity",
            target=self.target,
            description=f"{name}: requests wait and no instance runs; start one",
            metric=_queue_metric(name, BACKLOG_WITHOUT_CAPACITY_METRIC, "Average"),
            aggregation=appscaling.MetricAggregationType.AVERAGE,
            startup_seconds=startup_seconds,
        )


def _wake_from_zero(
    scope: Construct,
    alarm_id: str,
    *,
    target: appscaling.ScalableTarget,
    description: str,
    metric: cloudwatch.IMetric,
    aggregation: appscaling.MetricAggregationType,
    startup_seconds: int,
) -> cloudwatch.Alarm:
    """+1 capacity (step policy `FromZero`) as soon as `metric` reads 1 for a minute, the
    way out of zero that target tracking cannot take (it has nothing to divide by there).
    Its cooldown is the start-up timeout: the alarm stays in ALARM while the first
    instance or copy starts, and a second +1 then would start another for the same need."""
    from_zero = appscaling.StepScalingAction(
        scope,
        "FromZero",
        scaling_target=target,
        adjustment_type=appscaling.AdjustmentType.CHANGE_IN_CAPACITY,
        metric_aggregation_type=aggregation,
        cooldown=Duration.seconds(startup_seconds),
    )
    from_zero.add_adjustment(adjustment=1, lower_bound=0)
    alarm = cloudwatch.Alarm(
        scope,
        alarm_id,
        alarm_description=description,
        metric=metric,
        threshold=1,
        comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
        evaluation_periods=1,
        treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
    )
    alarm.add_alarm_action(cloudwatch_actions.ApplicationScalingAction(from_zero))
    return alarm


# An inference component's invocation metrics (AWS/SageMaker, dimension
# InferenceComponentName): calls refused because the component has no copy, its calls, and
# the requests per copy target tracking reads; and one utilization metric of each copy
# (/aws/sagemaker/InferenceComponents), whose samples a minute count the copies running.
NO_CAPACITY_METRIC = "NoCapacityInvocationFailures"
COMPONENT_NAMESPACE = "/aws/sagemaker/InferenceComponents"
COPY_SAMPLE_METRIC = "CPUUtilizationNormalized"
# Target tracking on the high-resolution per-copy concurrency scales in only after 15
# minutes of readings below target (90 ten-second points, Application Auto Scaling's own
# scale-in alarm), and an idle component reads 0: past 15 minutes it reaches zero copies
# first, so a longer idle period could never be the one that applies.
MAX_IDLE_MINUTES = 15
# An instance to start before the copy's own start (the component's start-up timeouts),
# and the minute the wake alarm and its policy take. On instance pools SageMaker may spend
# up to the variant's VariantInstanceProvisionTimeoutInSeconds falling back across them.
INSTANCE_START_MINUTES = 5
_METRICS = appscaling.PredefinedMetric
CONCURRENCY_PER_COPY_METRIC = (
    _METRICS.SAGEMAKER_INFERENCE_COMPONENT_CONCURRENT_REQUESTS_PER_COPY_HIGH_RESOLUTION
)


@dataclass(frozen=True, kw_only=True)
class ScaleToZero:
    """Serve the model as an inference component that scales to zero copies (and the
    endpoint to zero instances) once no call has come for `idle_minutes`, and back to one
    copy when a call finds none."""

    idle_minutes: int = 10

    def __post_init__(self) -> None:
        require(
            1 <= self.idle_minutes <= MAX_IDLE_MINUTES,
            f"scale_to_zero.idle_minutes: {self.idle_minutes} is outside 1..{MAX_IDLE_MINUTES}; "
            f"target tracking's own scale-in takes an idle component to zero after "
            f"{MAX_IDLE_MINUTES} minutes",
        )


def wake_minutes(startup_seconds: int, *, provision_seconds: int = 0) -> int:
    """How long a wake-up from zero may take: the alarm and its policy, an instance's
    start (on instance pools as long as `provision_seconds`, the provisioning timeout
    across them, where that is longer), then the copy's model download and health check
    (`startup_seconds`)."""
    instance = max(INSTANCE_START_MINUTES, math.ceil(provision_seconds / 60))
    return 1 + instance + math.ceil(startup_seconds / 60)


class InferenceComponentAutoscaling(Construct):
    """Scale `endpoint`'s inference component between zero and `max_copies` copies (the
    variant's managed instance scaling follows: no copy, no instance).

    While calls come, target tracking keeps `target_concurrency` requests per copy
    (`SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution`: the per-copy
    counterpart of the variant metric the instance-based endpoint tracks, published every
    10 s). After `settings.idle_minutes` without a call a step policy (`ToZero`) sets zero
    copies; its alarm adds the calls refused for lack of capacity to the calls answered,
    so a wake-up in progress is never taken for idleness. At zero a call is refused
    (`NoCapacityInvocationFailures`), and a step policy adds one copy (`FromZero`). A
    wake-up that takes longer than `wake_minutes` pages (`NotWaking`, in `alarms`). On
    instance pools both that bound and the wake-up policy's cooldown include
    `provision_seconds`, the variant's provisioning timeout: a fallback to a lower-priority
    pool type is a slow start, not a failure, and a second copy asked meanwhile would only
    wait for capacity beside the first.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint: SageMakerEndpoint,
        settings: ScaleToZero,
        max_copies: int,
        target_concurrency: float,
        startup_seconds: int,
        topic: sns.ITopic,
        provision_seconds: int = 0,
    ) -> None:
        super().__init__(scope, construct_id)
        component = endpoint.inference_component
        require(
            component is not None and component.inference_component_name is not None,
            f"{endpoint.endpoint_name}: scaling copies needs an inference component",
        )
        assert component is not None
        assert component.inference_component_name is not None
        require(max_copies >= 1, f"inference component max_copies: {max_copies} < 1")
        require(
            target_concurrency > 0,
            f"inference component target_concurrency: {target_concurrency} must be > 0",
        )
        name = component.inference_component_name
        dimensions = component_dimensions(name)

        def metric(metric_name: str) -> cloudwatch.Metric:
            return sagemaker_metric(INVOCATION_NAMESPACE, metric_name, dimensions, "Sum")

        self.target = _sagemaker_target(
            self,
            resource_id=f"inference-component/{name}",
            dimension="sagemaker:inference-component:DesiredCopyCount",
            min_capacity=0,
            max_capacity=max_copies,
            scaled=component,
        )
        track_concurrency(self.target, CONCURRENCY_PER_COPY_METRIC, target_concurrency)
        self.wake_alarm = _wake_from_zero(
            self,
            "NoCapacity",
            target=self.target,
            description=f"{name}: a call found no copy; start one",
            metric=metric(NO_CAPACITY_METRIC),
            aggregation=appscaling.MetricAggregationType.MAXIMUM,
            # On pools the copy may wait that long for an instance of some pool type.
            startup_seconds=startup_seconds + provision_seconds,
        )
        to_zero = appscaling.StepScalingAction(
            self,
            "ToZero",
            scaling_target=self.target,
            adjustment_type=appscaling.AdjustmentType.EXACT_CAPACITY,
            metric_aggregation_type=appscaling.MetricAggregationType.MAXIMUM,
            cooldown=Duration.minutes(settings.idle_minutes),
        )
        to_zero.add_adjustment(adjustment=0, upper_bound=0)
        calls = cloudwatch.MathExpression(
            expression="FILL(answered, 0) + FILL(refused, 0)",
            using_metrics={
                "answered": metric("Invocations"),
                "refused": metric(NO_CAPACITY_METRIC),
            },
            period=PERIOD,
            label="calls, answered or refused for lack of capacity",
        )
        self.idle_alarm = cloudwatch.Alarm(
            self,
            "Idle",
            alarm_description=f"{name}: no call for {settings.idle_minutes} minutes; "
            "stop every copy",
            metric=calls,
            threshold=0,
            comparison_operator=cloudwatch.ComparisonOperator.LESS_THAN_OR_EQUAL_TO_THRESHOLD,
            evaluation_periods=settings.idle_minutes,
            datapoints_to_alarm=settings.idle_minutes,
            # No datapoint at all is the idlest minute there is.
            treat_missing_data=cloudwatch.TreatMissingData.BREACHING,
        )
        self.idle_alarm.add_alarm_action(cloudwatch_actions.ApplicationScalingAction(to_zero))
        minutes = wake_minutes(startup_seconds, provision_seconds=provision_seconds)
        not_waking = cloudwatch.Alarm(
            self,
            "NotWaking",
            alarm_description=f"{name}: calls refused for lack of capacity in each of "
            f"{minutes} minutes; a wake-up takes at most that long (instance start, model "
            "download, health check)",
            metric=metric(NO_CAPACITY_METRIC),
            threshold=1,
            comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
            evaluation_periods=minutes,
            datapoints_to_alarm=minutes,
            treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
        )
        self.alarms = [not_waking]
        _notify(self.alarms, topic)


class AsyncEndpointAlarms(Construct):
    """An asynchronous endpoint's alarms, each with alarm and OK actions on `topic`: failed
    invocations in 3 of 5 minutes (its rollback alarm: a failure, whatever its cause); the
    oldest queued request older than `max_oldest_request_age_seconds` (the queue is not
    draining: too few instances, or none starting); and the instances' memory and disk (and
    GPU memory). Not the 5XX rate or model latency: an invocation here is a whole file
    whose latency is minutes by design, and SageMaker publishes no `Invocations` for it.

    The age alarm pages but does not roll back: it cannot fire within a bake of minutes
    (its threshold is half an hour), and when it is already firing at a deploy the queue is
    stuck, which is what that deploy may be fixing.
    """

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
        variant = {"EndpointName": endpoint_name, "VariantName": VARIANT_NAME}
        checks: list[Check] = [
            (
                "Failures",
                "InvocationFailures a minute",
                sagemaker_metric(INVOCATION_NAMESPACE, FAILED_INVOCATIONS_METRIC, variant, "Sum"),
                0.0,
            ),
            (
                "OldestRequest",
                "ApproximateAgeOfOldestRequest (seconds)",
                _queue_metric(endpoint_name, OLDEST_REQUEST_AGE_METRIC, "Maximum"),
                float(max_oldest_request_age_seconds),
            ),
            *_health_checks(variant, thresholds, gpu),
        ]
        self.alarms = _threshold_alarms(self, "", f" of {endpoint_name}", checks)
        self.rollback_alarms = self.alarms[:1]  # failed invocations
        _notify(self.alarms, topic)


# SageMaker's detailed observability labels every metric it publishes with the endpoint's
# name and each instance's EC2 id; a label name with dots is written quoted in PromQL.
ENDPOINT_LABEL = "aws.sagemaker.endpoint.name"
INSTANCE_LABEL = "@resource.host.id"
SIGNAL_WINDOW = "10m"
PROMQL_RECOVERY = Duration.minutes(5)


# The primary variant's series only: the adapter labels each series with the variant serving
# (SEMIF_VARIANT), and a shadow candidate's instances publish under the same endpoint name,
# so without this a slow candidate could fire the primary's rollback alarms. A series
# without the label (the llama.cpp DLC's, an image from before the label) is the primary's.
PRIMARY_SERIES = f'variant=~"{VARIANT_NAME}|"'


def endpoint_selector(endpoint_name: str, *matchers: str) -> str:
    """The PromQL label selector of one endpoint's primary series, narrowed by `matchers`
    (`'source="reused"'`)."""
    selected = (f'"{ENDPOINT_LABEL}"="{endpoint_name}"', PRIMARY_SERIES, *matchers)
    return "{" + ",".join(selected) + "}"


def signal_rate(endpoint_name: str, metric: str, *matchers: str, per_instance: bool = False) -> str:
    """`metric`'s rate a second over SIGNAL_WINDOW, summed over the endpoint, or per
    instance. Per instance, a canary or one bad instance is read on its own instead of
    diluted by the healthy rest; were the instance label ever missing, `by` would group
    everything into one series, which is the endpoint's sum: never an empty answer."""
    by = f' by ("{INSTANCE_LABEL}")' if per_instance else ""
    return f"sum{by} (rate({metric}{endpoint_selector(endpoint_name, *matchers)}[{SIGNAL_WINDOW}]))"


def unavailable_share(endpoint_name: str) -> str:
    """The share of calls answered 503: the adapter could not answer (loading, unhealthy,
    stopping, capacity). Failures."""
    return (
        f"{signal_rate(endpoint_name, 'semif_unavailable_total')} / "
        f"{signal_rate(endpoint_name, 'semif_requests_total')}"
    )


def refused_share(endpoint_name: str) -> str:
    """The share of calls answered 429: refused for load (queue full, overloaded, queue
    timeout, deadline), which the caller retries. A capacity signal, not a failure."""
    return (
        f"{signal_rate(endpoint_name, 'semif_refused_total')} / "
        f"{signal_rate(endpoint_name, 'semif_requests_total')}"
    )


# The rows the engine decoded in scoring passes: the adapter's evaluated prompt tokens.
DECODED_ROWS = ("semif_prompt_tokens_total", 'source="evaluated"')


def seconds_per_decoded_row(endpoint_name: str) -> str:
    """Seconds the engine spent per row it decoded in scoring passes, per instance: the
    model's own speed. Queue waits are not in it, so load does not raise it (fuller passes
    only lower it); a slower build, a wrong placement or a broken model does."""
    return (
        f"{signal_rate(endpoint_name, 'semif_pass_duration_seconds_sum', per_instance=True)} / "
        f"{signal_rate(endpoint_name, *DECODED_ROWS, per_instance=True)}"
    )


def median_allowed_token_mass(endpoint_name: str) -> str:
    """The median probability the model gives the option labels, per instance."""
    return (
        f'histogram_quantile(0.5, sum by (le, "{INSTANCE_LABEL}") '
        f"(rate(semif_allowed_token_mass_bucket{endpoint_selector(endpoint_name)}"
        f"[{SIGNAL_WINDOW}])))"
    )


def unavailable_query(endpoint_name: str, max_unavailable_percent: float) -> str:
    """The `Unavailable` alarm's query: series while the 503 share is above the limit."""
    return f"{unavailable_share(endpoint_name)} > {max_unavailable_percent / 100:g}"


def scoring_speed_query(endpoint_name: str, max_ms_per_decoded_row: float) -> str:
    """The `ScoringSpeed` alarm's query: the instances decoding slower than the limit."""
    return f"{seconds_per_decoded_row(endpoint_name)} > {max_ms_per_decoded_row / 1000:g}"


def letter_mass_query(endpoint_name: str, min_median_allowed_token_mass: float) -> str:
    """The `LetterMass` alarm's query: the instances whose median letter mass collapsed."""
    return f"{median_allowed_token_mass(endpoint_name)} < {min_median_allowed_token_mass:g}"


@dataclass(frozen=True, kw_only=True)
class DecisionSignalThresholds:
    """When the decision signals alarm, read from the adapter's own metrics (the container's
    `/metrics`, which SageMaker scrapes): the share of calls answered 503 (the server could
    not answer; load is a 429 and is not alarmed on), the seconds per decoded row above
    `max_ms_per_decoded_row` (the model scores slower than it should; choose a few times
    what the dashboard shows on a healthy endpoint, so it depends on the model and the
    hardware: the default suits a CPU, a GPU wants much less) and the median probability
    the model gives the option labels (a collapse means it stopped answering with them: a
    wrong model or template)."""

    max_unavailable_percent: float = 25.0
    max_ms_per_decoded_row: float = 50.0
    min_median_allowed_token_mass: float = 0.5

    def __post_init__(self) -> None:
        require(
            0 < self.max_unavailable_percent <= 100,
            f"signal_alarms.max_unavailable_percent: {self.max_unavailable_percent} is "
            "outside (0, 100]",
        )
        require(
            self.max_ms_per_decoded_row > 0,
            f"signal_alarms.max_ms_per_decoded_row: {self.max_ms_per_decoded_row} must be > 0",
        )
        require(
            0 < self.min_median_allowed_token_mass < 1,
            f"signal_alarms.min_median_allowed_token_mass: "
            f"{self.min_median_allowed_token_mass} is outside (0, 1)",
        )


class DecisionSignalAlarms(Construct):
    """Three PromQL alarms on a decision endpoint's container metrics (adapter/metrics.py),
    each with alarm and OK actions on `topic`; none fires without traffic. `rollback_alarms`
    are the model regressions, `ScoringSpeed` and `LetterMass`, per instance; `Unavailable`
    (503s, endpoint-wide) pages only, since the 5XX-rate alarm already rolls failures back.
    """

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

        def alarm(name: str, description: str, query: str) -> cloudwatch.PromQLAlarm:
            return cloudwatch.PromQLAlarm(
                self,
                name,
                alarm_description=f"{endpoint_name}: {description} for 5 minutes",
                query=query,
                evaluation_interval=PERIOD,
                pending_period=PROMQL_PENDING,
                recovery_period=PROMQL_RECOVERY,
            )

        unavailable = alarm(
            "Unavailable",
            f"more than {thresholds.max_unavailable_percent:g} % of calls answered 503 "
            "(loading, unhealthy, stopping, capacity: failures, not load)",
            unavailable_query(endpoint_name, thresholds.max_unavailable_percent),
        )
        self.rollback_alarms = [
            alarm(
                "ScoringSpeed",
                f"an instance took more than {thresholds.max_ms_per_decoded_row:g} ms per "
                "decoded row: the model scores slower than it should",
                scoring_speed_query(endpoint_name, thresholds.max_ms_per_decoded_row),
            ),
            alarm(
                "LetterMass",
                f"an instance's median allowed-token mass below "
                f"{thresholds.min_median_allowed_token_mass:g}: the model stopped answering "
                "with the option labels",
                letter_mass_query(endpoint_name, thresholds.min_median_allowed_token_mass),
            ),
        ]
        self.alarms = [unavailable, *self.rollback_alarms]
        _notify(self.alarms, topic)
