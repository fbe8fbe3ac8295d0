"""A SageMaker endpoint: execution role, model, endpoint config, endpoint.

Model and endpoint-config names are left to CloudFormation, so a changed image, artifact
or setting creates new ones and the endpoint moves to them (then the old ones are deleted).
The endpoint name is fixed per environment so its log group, alarms and scaling target
can name it. Updates keep the variant's current instance count and weight
(`RetainAllVariantProperties`, unless the endpoint asks for its config's own) and roll out
blue/green by the typed `Rollout` policy, rolling back automatically when one of the
endpoint's alarms fires. A real-time endpoint may carry a shadow variant (`ShadowVariant`):
a second model that SageMaker sends a copy of a share of the requests and whose answers
it discards. The same construct builds an asynchronous endpoint (`AsyncInference`):
requests and answers in S3, outcomes on SNS; and its role may be opened to batch
transform jobs (`role.allow_batch_transform`). The props are in
`endpoint_props.py`, the role and its grants in `execution_role.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from aws_cdk import RemovalPolicy
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from cdk_constructs.container_image import EcrImage
from cdk_constructs.endpoint_props import (
    AsyncInference,
    CpuPlacement,
    GpuPlacement,
    NetworkSettings,
    Observability,
    Placement,
    Rollout,
    Routing,
    ShadowVariant,
)
from cdk_constructs.execution_role import ExecutionRole
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.nag import acknowledge
from cdk_constructs.validation import require

VARIANT_NAME = "AllTraffic"
# botocore's sagemaker service model: AlarmList max 10.
MAX_ROLLBACK_ALARMS = 10


def endpoint_log_group_name(endpoint_name: str) -> str:
    return f"/aws/sagemaker/Endpoints/{endpoint_name}"


class SageMakerEndpoint(Construct):
    """Serve `image` (private ECR, by digest) with the `model` artifact on `placement`.

    `role` is its `ExecutionRole`: SageMaker for this account and region only, reading
    only the model object, pulling only the image's repository and writing only this
    endpoint's log group, until opened further. The log group has the fixed name SageMaker
    writes to, so it is never retained: a retained one would make the next deploy after a
    destroy fail with "already exists". `rollback_alarms` (created before the endpoint)
    roll a failing update back; `rollout` None leaves the update policy to SageMaker (no
    DeploymentConfig). `observability` sets the config's MetricsConfig (unset: SageMaker's
    defaults), `routing` the variant's RoutingConfig (unset: SageMaker's default router).
    `async_inference` makes it an asynchronous endpoint, its role allowed exactly the
    request, answer and failure prefixes and the two topics. `retain_variant_properties`
    False makes an update start the new config's own `initial_instance_count` instead of
    keeping the current count. `shadow` adds a shadow variant on the same role, network and
    routing: only under ShadowProductionVariants, so it never answers a caller, and
    neither `variant_name` (what scaling and alarms target) nor the rollback alarms are its.
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
        shadow: ShadowVariant | None = None,
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
        if shadow is not None:
            require(
                async_inference is None,
                f"{endpoint_name}: a shadow variant on an asynchronous endpoint; SageMaker "
                "runs shadow variants on real-time endpoints only",
            )
            require(
                shadow.variant_name != VARIANT_NAME,
                f"{endpoint_name}: the shadow variant needs a name of its own, not "
                f"{VARIANT_NAME!r}",
            )
        self.endpoint_name = endpoint_name
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
        self.role = ExecutionRole(
            self,
            "ExecutionRole",
            endpoint_name=endpoint_name,
            image=image,
            model=model,
            log_group=self.log_group,
            network=network,
            rollback_alarms=rollback_alarms,
        )
        self.model = self._model("Model", model, environment, network)
        self.shadow_model: sagemaker.CfnModel | None = None
        shadow_variants = None
        if shadow is not None:
            self.role.allow_model(shadow.model)
            self.shadow_model = self._model(
                "ShadowModel", shadow.model, shadow.environment, network
            )
            shadow_variants = [
                _production_variant(
                    variant_name=shadow.variant_name,
                    model_name=self.shadow_model.attr_model_name,
                    placement=shadow.placement,
                    initial_instance_count=shadow.instance_count,
                    weight=shadow.weight,
                    startup_timeout_seconds=startup_timeout_seconds,
                    routing=routing,
                )
            ]
        placements = [placement] if shadow is None else [placement, shadow.placement]
        volume_key = all(
            isinstance(each, CpuPlacement) and not each.has_instance_storage for each in placements
        )
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "Config",
            production_variants=[
                _production_variant(
                    variant_name=VARIANT_NAME,
                    model_name=self.model.attr_model_name,
                    placement=placement,
                    initial_instance_count=initial_instance_count,
                    weight=1.0,
                    startup_timeout_seconds=startup_timeout_seconds,
                    routing=routing,
                )
            ],
            shadow_production_variants=shadow_variants,
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
            self.role.allow_async_inference(async_inference)

    def _model(
        self,
        construct_id: str,
        model: ModelArtifact,
        environment: Mapping[str, str],
        network: NetworkSettings | None,
    ) -> sagemaker.CfnModel:
        """One SageMaker model of this endpoint: the image with `model`'s artifact and
        `environment`, network-isolated, run as the endpoint's role."""
        cfn_model = sagemaker.CfnModel(
            self,
            construct_id,
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
        cfn_model.node.add_dependency(self.role)
        if network is None:
            acknowledge(
                cfn_model,
                "AwsSolutions-SM1",
                "Network isolation is on: the container has no network at all, so a VPC "
                "adds nothing; environments that need one set `network` in the config.",
            )
        return cfn_model


def _production_variant(
    *,
    variant_name: str,
    model_name: str,
    placement: Placement,
    initial_instance_count: int,
    weight: float,
    startup_timeout_seconds: int,
    routing: Routing | None,
) -> sagemaker.CfnEndpointConfig.ProductionVariantProperty:
    """A fixed CPU instance type, or ordered GPU pools + CUDA AMI: never both."""
    cpu = placement if isinstance(placement, CpuPlacement) else None
    gpu = placement if isinstance(placement, GpuPlacement) else None
    return sagemaker.CfnEndpointConfig.ProductionVariantProperty(
        variant_name=variant_name,
        model_name=model_name,
        initial_instance_count=initial_instance_count,
        initial_variant_weight=weight,
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
