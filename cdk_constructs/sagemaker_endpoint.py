"""A SageMaker real-time endpoint: execution role, model, endpoint config, endpoint.

Model and endpoint-config names are left to CloudFormation, so a changed image, artifact
or setting creates new ones and the endpoint moves to them (then the old ones are deleted).
The endpoint name is fixed per environment so its log group, alarms and scaling target
can name it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from aws_cdk import RemovalPolicy, Stack, Token
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.nag import acknowledge
from cdk_constructs.validation import require, require_digest_image, require_instance_type

VARIANT_NAME = "AllTraffic"
_MAX_POOLS = 5
_MIN_PROVISION_TIMEOUT_S = 300
_MAX_PROVISION_TIMEOUT_S = 3600
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_SECURITY_GROUP = re.compile(r"^sg-[0-9a-f]{8,17}$")
# ENI management for VPC-attached models; EC2 offers no resource-level scoping for these.
VPC_ACTIONS = (
    "ec2:CreateNetworkInterface",
    "ec2:CreateNetworkInterfacePermission",
    "ec2:DeleteNetworkInterface",
    "ec2:DeleteNetworkInterfacePermission",
    "ec2:DescribeDhcpOptions",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeSecurityGroups",
    "ec2:DescribeSubnets",
    "ec2:DescribeVpcs",
)


@dataclass(frozen=True, kw_only=True)
class CpuPlacement:
    """One fixed CPU instance type; its volume is encrypted with the artifact key."""

    instance_type: str

    def __post_init__(self) -> None:
        require_instance_type(self.instance_type, "cpu.instance_type")


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
    """Optional VPC placement for the SageMaker model (subnets + security groups)."""

    subnet_ids: tuple[str, ...]
    security_group_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        require(bool(self.subnet_ids), "network.subnet_ids: give at least one subnet")
        require(
            bool(self.security_group_ids),
            "network.security_group_ids: give at least one security group",
        )
        for subnet in self.subnet_ids:
            require(bool(_SUBNET.fullmatch(subnet)), f"network.subnet_ids: bad id {subnet!r}")
        for group in self.security_group_ids:
            require(
                bool(_SECURITY_GROUP.fullmatch(group)),
                f"network.security_group_ids: bad id {group!r}",
            )


def endpoint_log_group_name(endpoint_name: str) -> str:
    return f"/aws/sagemaker/Endpoints/{endpoint_name}"


class SageMakerEndpoint(Construct):
    """Serve `image_uri` with the `model` artifact on `placement`.

    The role may read only that object (decrypting with its key via S3), pull only
    `repository` (None for a public DLC image) and write only this endpoint's log group.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        image_uri: str,
        repository: ecr.IRepository | None,
        model: ModelArtifact,
        environment: Mapping[str, str],
        placement: Placement,
        initial_instance_count: int,
        startup_timeout_seconds: int,
        network: NetworkSettings | None,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        if not Token.is_unresolved(image_uri):  # a build output is checked by its build
            require_digest_image(image_uri, f"{endpoint_name} image")
        self.endpoint_name = endpoint_name
        self.variant_name = VARIANT_NAME
        self.image_uri = image_uri
        self.log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=endpoint_log_group_name(endpoint_name),
            retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=removal_policy,
        )
        self.role = self._execution_role(repository=repository, model=model, network=network)
        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=self.role.role_arn,
            enable_network_isolation=True,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image_uri,
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
        self.endpoint_config = sagemaker.CfnEndpointConfig(
            self,
            "Config",
            production_variants=[
                _production_variant(
                    model_name=self.model.attr_model_name,
                    placement=placement,
                    initial_instance_count=initial_instance_count,
                    startup_timeout_seconds=startup_timeout_seconds,
                )
            ],
            # Instances with local NVMe storage (every GPU pool type) reject a volume key.
            kms_key_id=model.key.key_arn if isinstance(placement, CpuPlacement) else None,
        )
        if isinstance(placement, GpuPlacement):
            acknowledge(
                self.endpoint_config,
                "AwsSolutions-SM2",
                "GPU pool instances (g4dn/g5/g6/g6e) have NVMe instance storage, which "
                "SageMaker encrypts itself and for which it rejects KmsKeyId.",
            )
        self.endpoint = sagemaker.CfnEndpoint(
            self,
            "Endpoint",
            endpoint_name=endpoint_name,
            endpoint_config_name=self.endpoint_config.attr_endpoint_config_name,
        )
        self.endpoint.node.add_dependency(self.log_group)

    def _execution_role(
        self,
        *,
        repository: ecr.IRepository | None,
        model: ModelArtifact,
        network: NetworkSettings | None,
    ) -> iam.Role:
        role = iam.Role(
            self,
            "ExecutionRole",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description=f"SageMaker execution role of {self.endpoint_name}",
        )
        role.add_to_policy(
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[model.object_arn])
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt"],
                resources=[model.key.key_arn],
                conditions={
                    "StringEquals": {"kms:ViaService": f"s3.{Stack.of(self).region}.amazonaws.com"}
                },
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[self.log_group.log_group_arn],
            )
        )
        # Actions AWS offers no resource-level scoping for; each adds its reason.
        unscoped: list[str] = []
        if repository is not None:
            role.add_to_policy(
                iam.PolicyStatement(
                    actions=[
                        "ecr:BatchCheckLayerAvailability",
                        "ecr:BatchGetImage",
                        "ecr:GetDownloadUrlForLayer",
                    ],
                    resources=[repository.repository_arn],
                )
            )
            role.add_to_policy(
                iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"])
            )
            unscoped.append(
                "ecr:GetAuthorizationToken has no resource-level permissions (it only issues "
                "a login token; image pulls are limited to the one adapter repository)"
            )
        if network is not None:
            role.add_to_policy(iam.PolicyStatement(actions=list(VPC_ACTIONS), resources=["*"]))
            unscoped.append(
                "the EC2 ENI actions SageMaker uses to attach the model to the configured "
                "subnets are not resource-scoped"
            )
        if unscoped:
            acknowledge(role, "AwsSolutions-IAM5[Resource::*]", "; ".join(unscoped) + ".")
        return role


def _production_variant(
    *,
    model_name: str,
    placement: Placement,
    initial_instance_count: int,
    startup_timeout_seconds: int,
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
    )
