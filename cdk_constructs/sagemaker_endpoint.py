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
transform jobs (`role.allow_batch_transform`). A real-time endpoint may instead serve its
model as an inference component (`InferenceComponentHosting`), whose copies scale to
zero and whose instances follow them. The props are in
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
    InferenceComponentHosting,
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
_ComponentDeployment = sagemaker.CfnInferenceComponent.InferenceComponentDeploymentConfigProperty
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

    `inference_component` hosts the model as `AWS::SageMaker::InferenceComponent` instead:
    the variant names no model and lets SageMaker manage its instances (from none up), the
    config carries what a model otherwise gives the endpoint (the role, network isolation,
    the VPC), the start-up timeouts move to the component, and updates roll out through the
    component's own DeploymentConfig with the rollback alarms: a new model, image or
    environment changes the component, not the endpoint config, so an endpoint
    DeploymentConfig would never see them. Not with a shadow (ShadowProductionVariants
    name a model per variant) or an asynchronous endpoint. On GPU pools the variant keeps
    its InstancePools and the component one Specification for all of them (SageMaker's
    developer guide: the same model and resources on every pool type), so its copy asks
    what the smallest pool type offers and a GPU (`InferenceComponentHosting.accelerators`).
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
        inference_component: InferenceComponentHosting | None = None,
    ) -> None:
        super().__init__(scope, construct_id)
        if inference_component is not None:
            require(
                shadow is None and async_inference is None,
                f"{endpoint_name}: an inference component with a shadow variant or an "
                "asynchronous config; SageMaker hosts inference components on real-time "
                "variants without a model of their own",
            )
            require(
                (inference_component.accelerators > 0) == isinstance(placement, GpuPlacement),
                f"{endpoint_name}: an inference component asking "
                f"{inference_component.accelerators} GPUs of a {type(placement).__name__}; "
                "a copy on GPU pools needs a GPU (NumberOfAcceleratorDevicesRequired), one on "
                "a CPU type none",
            )
        require(
            len(rollback_alarms) <= MAX_ROLLBACK_ALARMS,
            f"{endpoint_name}: {len(rollback_alarms)} rollback alarms; SageMaker takes at "
            f"most {MAX_ROLLBACK_ALARMS}",
        )
        require(
            rollout is not None or not rollback_alarms,
            f"{endpoint_name}: rollback alarms need a rollout (its DeploymentConfig)",
        )
        if rollout is not None and inference_component is None:
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
        hosted = inference_component is not None
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "Config",
            production_variants=[
                _production_variant(
                    variant_name=VARIANT_NAME,
                    model_name=None if hosted else self.model.attr_model_name,
                    placement=placement,
                    initial_instance_count=initial_instance_count,
                    weight=1.0,
                    startup_timeout_seconds=None if hosted else startup_timeout_seconds,
                    routing=routing,
                    managed_scaling=None
                    if inference_component is None
                    else inference_component.managed_instance_scaling(),
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
            # Hosting components, the endpoint itself runs as the role and in the network
            # the model would otherwise give it.
            execution_role_arn=self.role.role_arn if hosted else None,
            enable_network_isolation=True if hosted else None,
            vpc_config=None if network is None or not hosted else _endpoint_vpc(network),
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
            if rollout is None or hosted
            else rollout.deployment_config([alarm.alarm_name for alarm in rollback_alarms]),
        )
        self.endpoint.node.add_dependency(self.log_group)
        self.inference_component: sagemaker.CfnInferenceComponent | None = None
        if inference_component is not None:
            self.inference_component = self._inference_component(
                inference_component,
                startup_timeout_seconds=startup_timeout_seconds,
                deployment_config=None
                if rollout is None
                else rollout.inference_component_deployment_config(
                    [alarm.alarm_name for alarm in rollback_alarms]
                ),
            )
        if async_inference is not None:
            self.role.allow_async_inference(async_inference)

    @property
    def inference_component_name(self) -> str | None:
        """The component's fixed name (None: the variant serves its model itself)."""
        component = self.inference_component
        return None if component is None else component.inference_component_name

    def _inference_component(
        self,
        hosting: InferenceComponentHosting,
        *,
        startup_timeout_seconds: int,
        deployment_config: _ComponentDeployment | None,
    ) -> sagemaker.CfnInferenceComponent:
        """The model as one component of the endpoint's variant, on `hosting`'s copies."""
        component = sagemaker.CfnInferenceComponent
        resource = component(
            self,
            "InferenceComponent",
            inference_component_name=hosting.component_name,
            endpoint_name=self.endpoint.attr_endpoint_name,
            variant_name=VARIANT_NAME,
            specification=component.InferenceComponentSpecificationProperty(
                model_name=self.model.attr_model_name,
                startup_parameters=component.InferenceComponentStartupParametersProperty(
                    model_data_download_timeout_in_seconds=startup_timeout_seconds,
                    container_startup_health_check_timeout_in_seconds=startup_timeout_seconds,
                ),
                compute_resource_requirements=hosting.compute_resource_requirements(),
            ),
            runtime_config=component.InferenceComponentRuntimeConfigProperty(
                copy_count=hosting.initial_copy_count
            ),
            deployment_config=deployment_config,
        )
        resource.node.add_dependency(self.log_group)
        return resource

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


def _endpoint_vpc(network: NetworkSettings) -> sagemaker.CfnEndpointConfig.VpcConfigProperty:
    return sagemaker.CfnEndpointConfig.VpcConfigProperty(
        subnets=list(network.subnet_ids), security_group_ids=list(network.security_group_ids)
    )


def _production_variant(
    *,
    variant_name: str,
    model_name: str | None,
    placement: Placement,
    initial_instance_count: int,
    weight: float,
    startup_timeout_seconds: int | None,
    routing: Routing | None,
    managed_scaling: sagemaker.CfnEndpointConfig.ManagedInstanceScalingProperty | None = None,
) -> sagemaker.CfnEndpointConfig.ProductionVariantProperty:
    """A fixed CPU instance type, or ordered GPU pools + CUDA AMI: never both. Without a
    model (an inference component brings it, and its start-up timeouts) and with
    `managed_scaling`, the variant is a home for components."""
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
        managed_instance_scaling=managed_scaling,
    )
