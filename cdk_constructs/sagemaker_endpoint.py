"""A SageMaker endpoint: execution role, model, endpoint config, endpoint.

Model and endpoint-config names are left to CloudFormation, so a changed image, artifact
or setting creates new ones and the endpoint moves to them (then the old ones are deleted).
The endpoint name is fixed per environment so its log group, alarms and scaling target
can name it. Updates keep the variant's current instance count and weight
(`RetainAllVariantProperties`, unless the endpoint asks for its config's own) and roll out
blue/green by the typed `Rollout` policy, rolling back automatically when one of the
endpoint's alarms fires. The same construct builds an asynchronous endpoint
(`AsyncInference`): requests and answers in S3, outcomes on SNS; and the role may be
opened to batch transform jobs (`allow_batch_transform`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from aws_cdk import ArnFormat, RemovalPolicy, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sagemaker as sagemaker
from aws_cdk import aws_sns as sns
from constructs import Construct

from cdk_constructs.container_image import EcrImage
from cdk_constructs.deploy_roles import service_principal
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.nag import acknowledge, nag_resource
from cdk_constructs.validation import looks_like_placeholder, require, require_instance_type

VARIANT_NAME = "AllTraffic"
_MAX_POOLS = 5
_MIN_PROVISION_TIMEOUT_S = 300
_MAX_PROVISION_TIMEOUT_S = 3600
_SUBNET = re.compile(r"^subnet-([0-9a-f]{8}|[0-9a-f]{17})$")
_SECURITY_GROUP = re.compile(r"^sg-([0-9a-f]{8}|[0-9a-f]{17})$")
_VPC = re.compile(r"^vpc-([0-9a-f]{8}|[0-9a-f]{17})$")
# A family with local NVMe instance storage: `d` after the generation (c6id, m5d, r5dn, g4dn).
_INSTANCE_STORAGE_FAMILY = re.compile(r"^ml\.[a-z]+\d+[a-z]*d[a-z]*\.")
# ENI actions for VPC-attached models. The Describe* actions and
# DeleteNetworkInterfacePermission take no resource or condition scoping; the others are
# limited to ENIs in the configured subnets (`ec2:Subnet`, and `ec2:Vpc` when given).
VPC_DESCRIBE_ACTIONS = (
    "ec2:DeleteNetworkInterfacePermission",
    "ec2:DescribeDhcpOptions",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeSecurityGroups",
    "ec2:DescribeSubnets",
    "ec2:DescribeVpcs",
)
VPC_ENI_ACTIONS = (
    "ec2:CreateNetworkInterface",
    "ec2:CreateNetworkInterfacePermission",
    "ec2:DeleteNetworkInterface",
)
VPC_ACTIONS = (*VPC_DESCRIBE_ACTIONS, *VPC_ENI_ACTIONS)
# botocore's sagemaker service model: AlarmList max 10; WaitInterval/TerminationWait 0..3600;
# MaximumExecutionTimeout 600..28800; CapacitySize.Value >= 1.
MAX_ROLLBACK_ALARMS = 10
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
# Where SageMaker writes a transform job's logs and instance metrics (fixed names, shared by
# every job of the account and region, so created by SageMaker rather than by a stack).
TRANSFORM_LOG_GROUP = "/aws/sagemaker/TransformJobs"
TRANSFORM_METRIC_NAMESPACE = "/aws/sagemaker/TransformJobs"
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


def endpoint_log_group_name(endpoint_name: str) -> str:
    return f"/aws/sagemaker/Endpoints/{endpoint_name}"


class SageMakerEndpoint(Construct):
    """Serve `image` (private ECR, by digest) with the `model` artifact on `placement`.

    The role may be assumed by SageMaker for this account and region only, may read only
    the model object (decrypting with its key via S3), pull only the image's repository and
    write only this endpoint's log group. The log group has the fixed name SageMaker
    writes to, so it is never retained: a retained one would make the next deploy after a
    destroy fail with "already exists". `rollback_alarms` (created before the endpoint)
    roll a failing update back; `rollout` None leaves the update policy to SageMaker (no
    DeploymentConfig). `observability` sets the config's MetricsConfig (unset: SageMaker's
    defaults), `routing` the variant's RoutingConfig (unset: SageMaker's default router).
    `async_inference` makes it an asynchronous endpoint, its role allowed exactly the
    request, answer and failure prefixes and the two topics. `retain_variant_properties`
    False makes an update start the new config's own `initial_instance_count` instead of
    keeping the current count.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        image: EcrImage,
        model: ModelArtifact,
        environment: Mapping[str, str],
        placement: Placement,
        initial_instance_count: int,
        startup_timeout_seconds: int,
        network: NetworkSettings | None,
        rollout: Rollout | None,
        rollback_alarms: Sequence[cloudwatch.IAlarm],
        log_key: kms.IKey,
        observability: Observability | None = None,
        routing: Routing | None = None,
        async_inference: AsyncInference | None = None,
        retain_variant_properties: bool = True,
    ) -> None:
        super().__init__(scope, construct_id)
        require(
            len(rollback_alarms) <= MAX_ROLLBACK_ALARMS,
            f"{endpoint_name}: {len(rollback_alarms)} rollback alarms; SageMaker takes at "
            f"most {MAX_ROLLBACK_ALARMS}",
        )
        require(
            rollout is not None or not rollback_alarms,
            f"{endpoint_name}: rollback alarms need a rollout (its DeploymentConfig)",
        )
        if rollout is not None:
            rollout.check_capacity(initial_instance_count, f"{endpoint_name} rollout")
        self.endpoint_name = endpoint_name
        self.artifact = model
        self.variant_name = VARIANT_NAME
        self.image = image
        self.image_uri = image.uri
        self.log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=endpoint_log_group_name(endpoint_name),
            retention=logs.RetentionDays.THREE_MONTHS,
            encryption_key=log_key,
            removal_policy=RemovalPolicy.DESTROY,  # fixed name: see the class doc
        )
        self.role = self._execution_role(
            image=image, model=model, network=network, rollback_alarms=rollback_alarms
        )
        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=self.role.role_arn,
            enable_network_isolation=True,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=self.image_uri,
                model_data_url=model.model_data_url,
                environment=dict(sorted(environment.items())),
            ),
            vpc_config=None
            if network is None
            else sagemaker.CfnModel.VpcConfigProperty(
                subnets=list(network.subnet_ids),
                security_group_ids=list(network.security_group_ids),
            ),
        )
        # SageMaker checks the role when it creates the model: policies first.
        self.model.node.add_dependency(self.role)
        if network is None:
            acknowledge(
                self.model,
                "AwsSolutions-SM1",
                "Network isolation is on: the container has no network at all, so a VPC "
                "adds nothing; environments that need one set `network` in the config.",
            )
        volume_key = isinstance(placement, CpuPlacement) and not placement.has_instance_storage
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "Config",
            production_variants=[
                _production_variant(
                    model_name=self.model.attr_model_name,
                    placement=placement,
                    initial_instance_count=initial_instance_count,
                    startup_timeout_seconds=startup_timeout_seconds,
                    routing=routing,
                )
            ],
            metrics_config=None if observability is None else observability.metrics_config(),
            async_inference_config=None
            if async_inference is None
            else async_inference.config(model),
            # Instances with local NVMe storage (every GPU pool type, CPU `*d.*` types)
            # reject a volume key.
            kms_key_id=model.key.key_arn if volume_key else None,
        )
        if not volume_key:
            acknowledge(
                self.endpoint_config,
                "AwsSolutions-SM2",
                "The instance types here (GPU pools g4dn/g5/g6/g6e, or a CPU type with local "
                "NVMe) have instance storage, which SageMaker encrypts itself and for which "
                "it rejects KmsKeyId.",
            )
        self.endpoint = sagemaker.CfnEndpoint(
            self,
            "Endpoint",
            endpoint_name=endpoint_name,
            endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
            # By default a deploy keeps the instance count autoscaling chose (and the weight).
            retain_all_variant_properties=retain_variant_properties,
            deployment_config=None
            if rollout is None
            else rollout.deployment_config([alarm.alarm_name for alarm in rollback_alarms]),
        )
        self.endpoint.node.add_dependency(self.log_group)
        if async_inference is not None:
            self._allow_async(async_inference)

    def allow_batch_transform(self, *, input_prefix: str, output_prefix: str) -> None:
        """Let transform jobs run on this model: a job reads its S3 input and writes its
        output as the model's execution role, so the role may list and read objects under
        `input_prefix`, write (multipart included) under `output_prefix`, and write the
        jobs' logs and instance metrics where SageMaker puts them."""
        stack = Stack.of(self)
        self.allow_prefixes(
            read=[require_key_prefix(input_prefix, "batch input_prefix")],
            write=[require_key_prefix(output_prefix, "batch output_prefix")],
            listed=True,
            purpose="a batch transform job",
        )

        def log_group(name: str) -> str:
            return stack.format_arn(
                service="logs",
                resource="log-group",
                resource_name=name,
                arn_format=ArnFormat.COLON_RESOURCE_NAME,
            )

        # CreateLogGroup authorizes against the group's own ARN; the stream actions against
        # its streams (`<group>:*`). Each statement names only what its actions need.
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogGroup"], resources=[log_group(TRANSFORM_LOG_GROUP)]
            )
        )
        streams = log_group(f"{TRANSFORM_LOG_GROUP}:*")
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[streams],
            )
        )
        acknowledge(
            self.role,
            f"AwsSolutions-IAM5[Resource::{nag_resource(stack, streams)}]",
            f"Transform jobs log to SageMaker's fixed group {TRANSFORM_LOG_GROUP}, one "
            "stream per job and instance, named by SageMaker when the job starts.",
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": TRANSFORM_METRIC_NAMESPACE}},
            )
        )

    def allow_prefixes(
        self,
        *,
        read: Sequence[str] = (),
        write: Sequence[str] = (),
        listed: bool = False,
        purpose: str,
    ) -> None:
        """Let SageMaker, as this role, read objects under the `read` prefixes of the model's
        bucket (and list them, `listed`, as an S3Prefix input needs) and write under `write`,
        with the model's key: decrypt and data keys through S3 only; `kms:Encrypt` as
        SageMaker asks of a role whose output names a KmsKeyId (it reveals nothing)."""
        stack = Stack.of(self)
        bucket_arn = self._bucket_arn()
        objects = {prefix: f"{bucket_arn}/{prefix}*" for prefix in (*read, *write)}
        if read:
            self.role.add_to_policy(
                iam.PolicyStatement(
                    actions=["s3:GetObject"], resources=[objects[prefix] for prefix in read]
                )
            )
        if read and listed:
            self.role.add_to_policy(
                iam.PolicyStatement(
                    actions=["s3:ListBucket"],
                    resources=[bucket_arn],
                    conditions={"StringLike": {"s3:prefix": [f"{prefix}*" for prefix in read]}},
                )
            )
        if write:
            self.role.add_to_policy(
                iam.PolicyStatement(
                    actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                    resources=[objects[prefix] for prefix in write],
                )
            )
        key = self.artifact.key.key_arn
        self.role.add_to_policy(
            iam.PolicyStatement(
                # A multipart upload to an SSE-KMS bucket decrypts its data key for each part.
                actions=["kms:Decrypt", *(["kms:GenerateDataKey"] if write else [])],
                resources=[key],
                conditions={"StringEquals": {"kms:ViaService": _via(stack, "s3")}},
            )
        )
        if write:
            self.role.add_to_policy(iam.PolicyStatement(actions=["kms:Encrypt"], resources=[key]))
        for prefix, resource in objects.items():
            acknowledge(
                self.role,
                f"AwsSolutions-IAM5[Resource::{nag_resource(stack, resource)}]",
                f"The objects of {purpose} under {prefix} are named by whoever submits it; "
                "the grant is limited to that one prefix of the artifact bucket.",
            )

    def _bucket_arn(self) -> str:
        """The model bucket's ARN; from another stack, as the explicit `Fn::ImportValue` of
        the export an automatic reference would use (the same export), so that cdk-nag's
        spelling of a prefix ARN is known here (`nag_resource`)."""
        bucket = self.artifact.bucket
        producer = Stack.of(bucket)
        if producer.node.path == Stack.of(self).node.path:
            return bucket.bucket_arn
        return producer.export_value(bucket.bucket_arn)

    def _allow_async(self, config: AsyncInference) -> None:
        """InvokeEndpointAsync's input (read), the answers and failures (written), and the
        two outcome topics (publish; their key through SNS only)."""
        stack = Stack.of(self)
        self.allow_prefixes(
            read=[config.input_prefix],
            write=[config.output_prefix, config.failure_prefix],
            purpose="an asynchronous invocation",
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["sns:Publish"],
                resources=[config.success_topic.topic_arn, config.error_topic.topic_arn],
            )
        )
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=[self.artifact.key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": _via(stack, "sns")}},
            )
        )

    def _execution_role(
        self,
        *,
        image: EcrImage,
        model: ModelArtifact,
        network: NetworkSettings | None,
        rollback_alarms: Sequence[cloudwatch.IAlarm],
    ) -> iam.Role:
        stack = Stack.of(self)
        role = iam.Role(
            self,
            "ExecutionRole",
            # Confused-deputy guard: only SageMaker acting for this account and region.
            assumed_by=service_principal(
                stack,
                "sagemaker.amazonaws.com",
                stack.format_arn(
                    service="sagemaker", resource="*", arn_format=ArnFormat.NO_RESOURCE_NAME
                ),
            ),
            description=f"SageMaker execution role of {self.endpoint_name}",
        )
        role.add_to_policy(
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[model.object_arn])
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt"],
                resources=[model.key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": _via(stack, "s3")}},
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[self.log_group.log_group_arn],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "ecr:BatchCheckLayerAvailability",
                    "ecr:BatchGetImage",
                    "ecr:GetDownloadUrlForLayer",
                ],
                resources=[image.repository_arn(self)],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"])
        )
        if rollback_alarms:
            # Blue/green auto-rollback: SageMaker reads the alarms as this role.
            role.add_to_policy(
                iam.PolicyStatement(
                    actions=["cloudwatch:DescribeAlarms"],
                    resources=[alarm.alarm_arn for alarm in rollback_alarms],
                )
            )
        # The instance metrics (memory, disk, GPU memory) the alarms watch are published as
        # this role, into SageMaker's namespace only.
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/Endpoints"}},
            )
        )
        # Actions AWS offers no resource-level scoping for; each adds its reason.
        unscoped = [
            "ecr:GetAuthorizationToken has no resource-level permissions (it only issues "
            "a login token; image pulls are limited to the one image repository)",
            "cloudwatch:PutMetricData has no resource-level permissions; it is limited to "
            "the /aws/sagemaker/Endpoints namespace by condition",
        ]
        if network is not None:
            self._allow_network(role, network)
            unscoped.append(
                "the EC2 Describe* actions and DeleteNetworkInterfacePermission SageMaker "
                "uses to attach the model to the configured subnets take no resource "
                "scoping; the ENI actions are limited to those subnets by condition"
            )
        acknowledge(role, "AwsSolutions-IAM5[Resource::*]", "; ".join(unscoped) + ".")
        return role

    def _allow_network(self, role: iam.Role, network: NetworkSettings) -> None:
        stack = Stack.of(self)

        def ec2_arn(resource: str, name: str) -> str:
            return stack.format_arn(
                service="ec2",
                resource=resource,
                resource_name=name,
                arn_format=ArnFormat.SLASH_RESOURCE_NAME,
            )

        role.add_to_policy(iam.PolicyStatement(actions=list(VPC_DESCRIBE_ACTIONS), resources=["*"]))
        subnets = [ec2_arn("subnet", subnet) for subnet in network.subnet_ids]
        conditions: dict[str, dict[str, object]] = {"ArnEquals": {"ec2:Subnet": subnets}}
        if network.vpc_id is not None:
            conditions["ArnEquals"]["ec2:Vpc"] = ec2_arn("vpc", network.vpc_id)
        interfaces = ec2_arn("network-interface", "*")
        role.add_to_policy(
            iam.PolicyStatement(
                actions=list(VPC_ENI_ACTIONS),
                resources=[interfaces],
                conditions=conditions,
            )
        )
        acknowledge(
            role,
            f"AwsSolutions-IAM5[Resource::{nag_resource(stack, interfaces)}]",
            "SageMaker creates the model's network interfaces, so their ids are not known; "
            "the statement is limited to interfaces in the configured subnets (ec2:Subnet, "
            "ec2:Vpc conditions).",
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["ec2:CreateNetworkInterface"],
                resources=[
                    *subnets,
                    *(ec2_arn("security-group", group) for group in network.security_group_ids),
                ],
            )
        )


def _via(stack: Stack, service: str) -> str:
    """`kms:ViaService` of `service` in this region: the key used only through it."""
    return f"{service}.{stack.region}.{stack.url_suffix}"


def _production_variant(
    *,
    model_name: str,
    placement: Placement,
    initial_instance_count: int,
    startup_timeout_seconds: int,
    routing: Routing | None,
) -> sagemaker.CfnEndpointConfig.ProductionVariantProperty:
    """A fixed CPU instance type, or ordered GPU pools + CUDA AMI: never both."""
    cpu = placement if isinstance(placement, CpuPlacement) else None
    gpu = placement if isinstance(placement, GpuPlacement) else None
    return sagemaker.CfnEndpointConfig.ProductionVariantProperty(
        variant_name=VARIANT_NAME,
        model_name=model_name,
        initial_instance_count=initial_instance_count,
        initial_variant_weight=1.0,
        container_startup_health_check_timeout_in_seconds=startup_timeout_seconds,
        model_data_download_timeout_in_seconds=startup_timeout_seconds,
        instance_type=cpu.instance_type if cpu else None,
        instance_pools=None
        if gpu is None
        else [
            sagemaker.CfnEndpointConfig.InstancePoolProperty(
                instance_type=instance_type, priority=priority
            )
            for priority, instance_type in enumerate(gpu.instance_pools, start=1)
        ],
        variant_instance_provision_timeout_in_seconds=gpu.provision_timeout_seconds
        if gpu
        else None,
        inference_ami_version=gpu.inference_ami_version if gpu else None,
        routing_config=None if routing is None else routing.routing_config(),
    )
