"""A SageMaker real-time endpoint: execution role, model, endpoint config, endpoint.

Model and endpoint-config names are left to CloudFormation, so a changed image, artifact
or setting creates new ones and the endpoint moves to them (then the old ones are deleted).
The endpoint name is fixed per environment so its log group, alarms and scaling target
can name it.
"""

from __future__ import annotations

from collections.abc import Mapping

from aws_cdk import RemovalPolicy, Stack, Token
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3 as s3
from aws_cdk import aws_sagemaker as sagemaker
from constructs import Construct

from cdk_constructs.nag import acknowledge
from stacks.config import CpuPlacement, GpuPlacement, NetworkSettings, require_digest_image

VARIANT_NAME = "AllTraffic"
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


def endpoint_log_group_name(endpoint_name: str) -> str:
    return f"/aws/sagemaker/Endpoints/{endpoint_name}"


class SageMakerEndpoint(Construct):
    """Serve `image_uri` with the artifact at `bucket/object_key` on `placement`.

    The role may read only that object (decrypting with `key` via S3), pull only
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
        bucket: s3.IBucket,
        object_key: str,
        key: kms.IKey,
        environment: Mapping[str, str],
        placement: CpuPlacement | GpuPlacement,
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
        self.model_data_url = f"s3://{bucket.bucket_name}/{object_key}"
        self.log_group = logs.LogGroup(
            self,
            "Logs",
            log_group_name=endpoint_log_group_name(endpoint_name),
            retention=logs.RetentionDays.THREE_MONTHS,
            removal_policy=removal_policy,
        )
        self.role = self._execution_role(
            repository=repository, bucket=bucket, object_key=object_key, key=key, network=network
        )
        self.model = sagemaker.CfnModel(
            self,
            "Model",
            execution_role_arn=self.role.role_arn,
            enable_network_isolation=True,
            primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(
                image=image_uri,
                model_data_url=self.model_data_url,
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
            kms_key_id=key.key_arn if isinstance(placement, CpuPlacement) else None,
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
        bucket: s3.IBucket,
        object_key: str,
        key: kms.IKey,
        network: NetworkSettings | None,
    ) -> iam.Role:
        role = iam.Role(
            self,
            "ExecutionRole",
            assumed_by=iam.ServicePrincipal("sagemaker.amazonaws.com"),
            description=f"SageMaker execution role of {self.endpoint_name}",
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["s3:GetObject"], resources=[bucket.arn_for_objects(object_key)]
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt"],
                resources=[key.key_arn],
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
    placement: CpuPlacement | GpuPlacement,
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
