"""The prop types a `SageMakerEndpoint` takes, each validated when it is built.

Where the variant runs (`CpuPlacement`, `GpuPlacement`), the optional VPC
(`NetworkSettings`), the blue/green update policy (`Rollout`), the published metrics
(`Observability`), the router (`PrefixAwareRouting`, `LeastOutstandingRouting`), the
asynchronous mode (`AsyncInference`) and the model as an inference component on instances
SageMaker starts and stops itself (`InferenceComponentHosting`). They live apart from the
construct, which reads them, so an environment's config (`stacks/config.py`) builds and
checks them without it. The limits are SageMaker's (botocore's service model), so a bad
value fails `cdk synth` rather than the deploy.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import aws_sagemaker as sagemaker
from aws_cdk import aws_sns as sns

from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.validation import looks_like_placeholder, require, require_instance_type

_MAX_POOLS = 5
_MIN_PROVISION_TIMEOUT_S = 300
_MAX_PROVISION_TIMEOUT_S = 3600
_SUBNET = re.compile(r"^subnet-([0-9a-f]{8}|[0-9a-f]{17})$")
_SECURITY_GROUP = re.compile(r"^sg-([0-9a-f]{8}|[0-9a-f]{17})$")
_VPC = re.compile(r"^vpc-([0-9a-f]{8}|[0-9a-f]{17})$")
# A family with local NVMe instance storage: `d` after the generation (c6id, m5d, r5dn, g4dn).
_INSTANCE_STORAGE_FAMILY = re.compile(r"^ml\.[a-z]+\d+[a-z]*d[a-z]*\.")
# botocore's sagemaker service model: WaitInterval/TerminationWait 0..3600;
# MaximumExecutionTimeout 600..28800; CapacitySize.Value >= 1.
_MAX_WAIT_S = 3600
_EXECUTION_TIMEOUT_S = (600, 28800)
# botocore and CloudFormation: MetricsConfig.MetricPublishFrequencyInSeconds, and
# PrefixAwareRoutingConfig's PrefixLength and ConcurrencyThreshold ranges.
METRIC_PUBLISH_SECONDS = (10, 30, 60, 120, 180, 240, 300)
PREFIX_LENGTH_BYTES = (1024, 65536)
CONCURRENCY_THRESHOLD = (1, 1024)
# RoutingConfig.RoutingStrategy values (botocore `RoutingStrategy`).
PREFIX_AWARE = "PREFIX_AWARE"
LEAST_OUTSTANDING_REQUESTS = "LEAST_OUTSTANDING_REQUESTS"
# botocore: AsyncInferenceClientConfig.MaxConcurrentInvocationsPerInstance.
ASYNC_INVOCATIONS_PER_INSTANCE = (1, 1000)
# botocore: ProductionVariant.VariantName (ModelVariantName), at most 63 characters.
_VARIANT_NAME = re.compile(r"^[a-zA-Z0-9](?:[-a-zA-Z0-9]{0,61}[a-zA-Z0-9])?$")
# botocore: InferenceComponentComputeResourceRequirements' NumberOfCpuCores (>= 0.25) and
# MemoryInMb (>= 128); ManagedInstanceScalingMaxInstanceCount (>= 1).
_MIN_COPY_CORES = 0.25
_MIN_COPY_MEMORY_MIB = 128
# A key prefix in the artifact bucket: relative, ending in "/", no wildcard or odd characters.
_KEY_PREFIX = re.compile(r"^(?:[a-z0-9][a-z0-9._-]*/)+$")


def require_key_prefix(prefix: str, what: str) -> str:
    """`batch/input/`: the exact prefix a grant ends in `*` after, so no wildcard inside."""
    require(
        bool(_KEY_PREFIX.fullmatch(prefix)),
        f"{what}: {prefix!r} is not a key prefix (lowercase segments, each ending in '/')",
    )
    return prefix


@dataclass(frozen=True, kw_only=True)
class CpuPlacement:
    """One fixed CPU instance type; its volume is encrypted with the artifact key, except on
    a type with local NVMe instance storage (`*d.*`), where SageMaker rejects a volume key
    and encrypts the instance storage itself."""

    instance_type: str

    def __post_init__(self) -> None:
        require_instance_type(self.instance_type, "cpu.instance_type")

    @property
    def has_instance_storage(self) -> bool:
        return bool(_INSTANCE_STORAGE_FAMILY.match(self.instance_type))


@dataclass(frozen=True, kw_only=True)
class GpuPlacement:
    """Ordered GPU instance pools (priority = position) and the CUDA-capable AMI.

    Pools are placement fallbacks, not load balancing: SageMaker picks one type per variant.
    """

    instance_pools: tuple[str, ...]
    provision_timeout_seconds: int
    inference_ami_version: str

    def __post_init__(self) -> None:
        pools = self.instance_pools
        require(
            1 <= len(pools) <= _MAX_POOLS,
            f"gpu.instance_pools: {len(pools)} types given; SageMaker takes 1..{_MAX_POOLS}",
        )
        for index, instance_type in enumerate(pools):
            require_instance_type(instance_type, f"gpu.instance_pools[{index}]")
        require(
            len(set(pools)) == len(pools),
            f"gpu.instance_pools: {list(pools)} repeats a type; each type needs one priority",
        )
        require(
            _MIN_PROVISION_TIMEOUT_S <= self.provision_timeout_seconds <= _MAX_PROVISION_TIMEOUT_S,
            f"gpu.provision_timeout_seconds: {self.provision_timeout_seconds} is outside "
            f"{_MIN_PROVISION_TIMEOUT_S}..{_MAX_PROVISION_TIMEOUT_S}",
        )
        require(
            bool(self.inference_ami_version),
            "gpu.inference_ami_version: required; the CUDA 13 DLC needs a driver >= 580 AMI",
        )


Placement = CpuPlacement | GpuPlacement


@dataclass(frozen=True, kw_only=True)
class NetworkSettings:
    """Optional VPC placement for the SageMaker models (subnets + security groups, and the
    VPC id that scopes the ENI permissions further). Opt-in: no environment ships ids, and
    a placeholder id (`subnet-0123456789abcdef0`, `sg-00000000`) is refused."""

    subnet_ids: tuple[str, ...]
    security_group_ids: tuple[str, ...]
    vpc_id: str | None = None

    def __post_init__(self) -> None:
        require(bool(self.subnet_ids), "network.subnet_ids: give at least one subnet")
        require(
            bool(self.security_group_ids),
            "network.security_group_ids: give at least one security group",
        )
        checks = [("subnet_ids", _SUBNET, subnet) for subnet in self.subnet_ids]
        checks += [("security_group_ids", _SECURITY_GROUP, sg) for sg in self.security_group_ids]
        if self.vpc_id is not None:
            checks.append(("vpc_id", _VPC, self.vpc_id))
        for name, pattern, value in checks:
            require(bool(pattern.fullmatch(value)), f"network.{name}: bad id {value!r}")
            require(
                not looks_like_placeholder(value.split("-", 1)[1]),
                f"network.{name}: {value!r} is a placeholder; give your own ids "
                "(-c subnet_ids=... -c security_group_ids=...) or leave network unset",
            )


class TrafficShift(enum.Enum):
    """How a blue/green update moves traffic (botocore `TrafficRoutingConfigType`)."""

    ALL_AT_ONCE = "ALL_AT_ONCE"
    CANARY = "CANARY"
    LINEAR = "LINEAR"


class StepUnit(enum.Enum):
    """What a canary or linear step counts (botocore `CapacitySizeType`)."""

    INSTANCE_COUNT = "INSTANCE_COUNT"
    CAPACITY_PERCENT = "CAPACITY_PERCENT"


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """The blue/green update policy: traffic shift, baking time, rollback window.

    CANARY moves `step` first, waits `wait_interval_seconds`, then the rest; LINEAR moves
    `step` at a time. SageMaker's rules: a canary is at most 50 % of the variant's
    instances, a linear step 10..50 %; an instance-count step is checked against the
    variant's instance count by `check_capacity`.
    """

    traffic: TrafficShift = TrafficShift.ALL_AT_ONCE
    step_unit: StepUnit | None = None
    step: int | None = None
    wait_interval_seconds: int = 300
    termination_wait_seconds: int = 300
    maximum_execution_timeout_seconds: int | None = None

    def __post_init__(self) -> None:
        stepped = self.traffic is not TrafficShift.ALL_AT_ONCE
        require(
            stepped == (self.step is not None) == (self.step_unit is not None),
            f"rollout: {self.traffic.value} {'needs' if stepped else 'takes no'} step and "
            "step_unit",
        )
        for name in ("wait_interval_seconds", "termination_wait_seconds"):
            value = getattr(self, name)
            require(0 <= value <= _MAX_WAIT_S, f"rollout.{name}: {value} is outside 0..3600")
        timeout = self.maximum_execution_timeout_seconds
        low, high = _EXECUTION_TIMEOUT_S
        require(
            timeout is None or low <= timeout <= high,
            f"rollout.maximum_execution_timeout_seconds: {timeout} is outside {low}..{high}",
        )
        if self.step is not None and self.step_unit is StepUnit.CAPACITY_PERCENT:
            low_percent = 10 if self.traffic is TrafficShift.LINEAR else 1
            require(
                low_percent <= self.step <= 50,
                f"rollout.step: {self.step} % is outside {low_percent}..50 for "
                f"{self.traffic.value}",
            )
        require(self.step is None or self.step >= 1, f"rollout.step: {self.step} < 1")

    def check_capacity(self, instance_count: int, what: str) -> None:
        """An instance-count step must fit the variant (canary <= 50 %, linear 10..50 %)."""
        if self.step_unit is not StepUnit.INSTANCE_COUNT or self.step is None:
            return
        percent = 100 * self.step / instance_count
        low = 10 if self.traffic is TrafficShift.LINEAR else 0
        require(
            low <= percent <= 50,
            f"{what}: a {self.traffic.value} step of {self.step} instance(s) is {percent:.0f} % "
            f"of {instance_count}; SageMaker needs {max(low, 1)}..50 %",
        )

    def deployment_config(
        self, alarm_names: Sequence[str]
    ) -> sagemaker.CfnEndpoint.DeploymentConfigProperty:
        endpoint = sagemaker.CfnEndpoint
        step = (
            None
            if self.step is None or self.step_unit is None
            else endpoint.CapacitySizeProperty(type=self.step_unit.value, value=self.step)
        )
        return endpoint.DeploymentConfigProperty(
            blue_green_update_policy=endpoint.BlueGreenUpdatePolicyProperty(
                traffic_routing_configuration=endpoint.TrafficRoutingConfigProperty(
                    type=self.traffic.value,
                    wait_interval_in_seconds=self.wait_interval_seconds,
                    canary_size=step if self.traffic is TrafficShift.CANARY else None,
                    linear_step_size=step if self.traffic is TrafficShift.LINEAR else None,
                ),
                termination_wait_in_seconds=self.termination_wait_seconds,
                maximum_execution_timeout_in_seconds=self.maximum_execution_timeout_seconds,
            ),
            auto_rollback_configuration=endpoint.AutoRollbackConfigProperty(
                alarms=[endpoint.AlarmProperty(alarm_name=name) for name in alarm_names]
            )
            if alarm_names
            else None,
        )

    def inference_component_deployment_config(
        self, alarm_names: Sequence[str]
    ) -> sagemaker.CfnInferenceComponent.InferenceComponentDeploymentConfigProperty:
        """The same bake, timeout and rollback alarms for an inference component, whose
        updates roll one copy at a time (RollingUpdatePolicy) instead of shifting traffic
        between fleets: a rollout that shifts traffic (canary, linear) has no meaning there,
        so only ALL_AT_ONCE is taken. A rollback brings the old copies back all at once
        (RollbackMaximumBatchSize unset: 100 %, SageMaker's blue/green rollback)."""
        require(
            self.traffic is TrafficShift.ALL_AT_ONCE,
            f"rollout: {self.traffic.value} on an inference component, which updates in "
            "rolling batches of one copy; give ALL_AT_ONCE",
        )
        component = sagemaker.CfnInferenceComponent
        return component.InferenceComponentDeploymentConfigProperty(
            rolling_update_policy=component.InferenceComponentRollingUpdatePolicyProperty(
                maximum_batch_size=component.InferenceComponentCapacitySizeProperty(
                    type="COPY_COUNT", value=1
                ),
                wait_interval_in_seconds=self.wait_interval_seconds,
                maximum_execution_timeout_in_seconds=self.maximum_execution_timeout_seconds,
            ),
            auto_rollback_configuration=component.AutoRollbackConfigurationProperty(
                alarms=[component.AlarmProperty(alarm_name=name) for name in alarm_names]
            )
            if alarm_names
            else None,
        )


@dataclass(frozen=True, kw_only=True)
class Observability:
    """The endpoint config's MetricsConfig, set explicitly: detailed observability on, so
    SageMaker scrapes the container's Prometheus metrics from `/metrics` on port 8080 and
    publishes them every `publish_frequency_seconds`. That path is SageMaker's default for a
    bring-your-own container and where the adapter serves them; CloudFormation's
    AWS::SageMaker::Model has no ContainerMetricsConfig to name another (CreateModel has)."""

    publish_frequency_seconds: int = 60

    def __post_init__(self) -> None:
        require(
            self.publish_frequency_seconds in METRIC_PUBLISH_SECONDS,
            f"metrics.publish_frequency_seconds: {self.publish_frequency_seconds} is not one "
            f"of {list(METRIC_PUBLISH_SECONDS)}",
        )

    def metrics_config(self) -> sagemaker.CfnEndpointConfig.MetricsConfigProperty:
        return sagemaker.CfnEndpointConfig.MetricsConfigProperty(
            enable_detailed_observability=True,
            metric_publish_frequency_in_seconds=self.publish_frequency_seconds,
        )


@dataclass(frozen=True, kw_only=True)
class PrefixAwareRouting:
    """The variant's RoutingConfig PREFIX_AWARE: requests whose first `prefix_length_bytes`
    agree go to the same instance until it has `concurrency_threshold` requests in flight."""

    prefix_length_bytes: int
    concurrency_threshold: int

    def __post_init__(self) -> None:
        low, high = PREFIX_LENGTH_BYTES
        require(
            low <= self.prefix_length_bytes <= high,
            f"routing.prefix_length_bytes: {self.prefix_length_bytes} is outside {low}..{high}",
        )
        low, high = CONCURRENCY_THRESHOLD
        require(
            low <= self.concurrency_threshold <= high,
            f"routing.concurrency_threshold: {self.concurrency_threshold} is outside {low}..{high}",
        )

    def routing_config(self) -> sagemaker.CfnEndpointConfig.RoutingConfigProperty:
        return sagemaker.CfnEndpointConfig.RoutingConfigProperty(
            routing_strategy=PREFIX_AWARE,
            prefix_aware_routing_config=sagemaker.CfnEndpointConfig.PrefixAwareRoutingConfigProperty(
                prefix_length=self.prefix_length_bytes,
                concurrency_threshold=self.concurrency_threshold,
            ),
        )


@dataclass(frozen=True)
class LeastOutstandingRouting:
    """The variant's RoutingConfig LEAST_OUTSTANDING_REQUESTS: each request goes to the
    instance with the fewest requests in flight. Requests here differ in cost by orders of
    magnitude (one decision beside a shared-state batch, a short chat beside a long one),
    which SageMaker's default, RANDOM, ignores: it piles requests onto a busy instance."""

    def routing_config(self) -> sagemaker.CfnEndpointConfig.RoutingConfigProperty:
        return sagemaker.CfnEndpointConfig.RoutingConfigProperty(
            routing_strategy=LEAST_OUTSTANDING_REQUESTS
        )


Routing = PrefixAwareRouting | LeastOutstandingRouting


@dataclass(frozen=True, kw_only=True)
class AsyncInference:
    """The endpoint config's AsyncInferenceConfig, in the model's bucket and key.

    InvokeEndpointAsync names a request object under `input_prefix` (the caller uploads it
    there); SageMaker reads it as the endpoint's role, queues it, and writes the answer
    under `output_prefix`, or the error under `failure_prefix`, both encrypted with the
    model's key, then publishes the outcome to `success_topic` or `error_topic`.
    `invocations_per_instance` is how many requests SageMaker hands one instance at once
    (`ClientConfig.MaxConcurrentInvocationsPerInstance`); the others wait in its queue.
    """

    input_prefix: str
    output_prefix: str
    failure_prefix: str
    success_topic: sns.ITopic
    error_topic: sns.ITopic
    invocations_per_instance: int

    def __post_init__(self) -> None:
        for name in ("input_prefix", "output_prefix", "failure_prefix"):
            require_key_prefix(getattr(self, name), f"async.{name}")
        low, high = ASYNC_INVOCATIONS_PER_INSTANCE
        require(
            low <= self.invocations_per_instance <= high,
            f"async.invocations_per_instance: {self.invocations_per_instance} is outside "
            f"{low}..{high}",
        )

    def config(
        self, model: ModelArtifact
    ) -> sagemaker.CfnEndpointConfig.AsyncInferenceConfigProperty:
        endpoint_config = sagemaker.CfnEndpointConfig
        return endpoint_config.AsyncInferenceConfigProperty(
            output_config=endpoint_config.AsyncInferenceOutputConfigProperty(
                s3_output_path=model.s3_uri(self.output_prefix),
                s3_failure_path=model.s3_uri(self.failure_prefix),
                kms_key_id=model.key.key_arn,
                notification_config=endpoint_config.AsyncInferenceNotificationConfigProperty(
                    success_topic=self.success_topic.topic_arn,
                    error_topic=self.error_topic.topic_arn,
                ),
            ),
            client_config=endpoint_config.AsyncInferenceClientConfigProperty(
                max_concurrent_invocations_per_instance=self.invocations_per_instance
            ),
        )


@dataclass(frozen=True, kw_only=True)
class ShadowVariant:
    """A shadow production variant of an endpoint (the config's ShadowProductionVariants):
    its own model (`model` served with `environment`) on `instance_count` instances of
    `placement`. SageMaker copies `sampling_percentage` % of the requests the production
    variant answers to it and discards its answers, so callers never see them; its
    metrics carry its own `variant_name`.

    The share is the shadow's InitialVariantWeight against the production variant's 1.0,
    as SageMaker's shadow tests set it (`weight`).
    """

    variant_name: str
    model: ModelArtifact
    environment: Mapping[str, str]
    placement: Placement
    instance_count: int
    sampling_percentage: int

    def __post_init__(self) -> None:
        require(
            bool(_VARIANT_NAME.fullmatch(self.variant_name)),
            f"shadow.variant_name: {self.variant_name!r} is not a SageMaker variant name",
        )
        require(
            self.instance_count >= 1,
            f"shadow.instance_count: {self.instance_count} must be >= 1",
        )
        require(
            1 <= self.sampling_percentage <= 100,
            f"shadow.sampling_percentage: {self.sampling_percentage} is outside 1..100",
        )

    @property
    def weight(self) -> float:
        return self.sampling_percentage / 100


@dataclass(frozen=True, kw_only=True)
class InferenceComponentHosting:
    """Serve the model as an inference component (`component_name`, fixed so scaling and
    alarms can name it) on a variant whose instances SageMaker starts and stops itself
    (ManagedInstanceScaling, between 0 and `max_instance_count`), so the endpoint can hold
    no instance at all while the component has no copy.

    One copy asks `cpu_cores` and `memory_mib` of an instance (ComputeResourceRequirements:
    what SageMaker places copies by; `NumberOfCpuCoresRequired`, `MinMemoryRequiredInMb`)
    and `accelerators` GPUs (none on CPU; on GPU pools one, of whichever pool type SageMaker
    started, so the cores and memory are what the smallest type offers). A deploy starts
    `initial_copy_count` copies;
    scaling (`InferenceComponentAutoscaling`) moves the count afterwards, down to zero.
    """

    component_name: str
    cpu_cores: float
    memory_mib: int
    max_instance_count: int
    initial_copy_count: int = 1
    accelerators: int = 0

    def __post_init__(self) -> None:
        require(
            bool(_VARIANT_NAME.fullmatch(self.component_name)),
            f"inference_component.component_name: {self.component_name!r} is not a "
            "SageMaker inference component name (letters, digits, inner hyphens, at most 63)",
        )
        require(
            self.cpu_cores >= _MIN_COPY_CORES,
            f"inference_component.cpu_cores: {self.cpu_cores:g} < {_MIN_COPY_CORES:g}",
        )
        require(
            self.memory_mib >= _MIN_COPY_MEMORY_MIB,
            f"inference_component.memory_mib: {self.memory_mib} < {_MIN_COPY_MEMORY_MIB}",
        )
        require(
            1 <= self.initial_copy_count <= self.max_instance_count,
            f"inference_component: need 1 <= initial_copy_count ({self.initial_copy_count}) "
            f"<= max_instance_count ({self.max_instance_count}); one copy fills an instance",
        )
        require(
            self.accelerators >= 0,
            f"inference_component.accelerators: {self.accelerators} < 0",
        )

    def managed_instance_scaling(
        self,
    ) -> sagemaker.CfnEndpointConfig.ManagedInstanceScalingProperty:
        """The variant's instances follow the copies, down to none: SageMaker starts one
        when a copy has nowhere to go and stops one that holds no copy."""
        return sagemaker.CfnEndpointConfig.ManagedInstanceScalingProperty(
            status="ENABLED", min_instance_count=0, max_instance_count=self.max_instance_count
        )

    def compute_resource_requirements(
        self,
    ) -> sagemaker.CfnInferenceComponent.InferenceComponentComputeResourceRequirementsProperty:
        return (
            sagemaker.CfnInferenceComponent.InferenceComponentComputeResourceRequirementsProperty(
                number_of_cpu_cores_required=self.cpu_cores,
                min_memory_required_in_mb=self.memory_mib,
                number_of_accelerator_devices_required=self.accelerators or None,
            )
        )
