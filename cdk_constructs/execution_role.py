"""The SageMaker execution role of one endpoint, and the grants it may be opened to.

SageMaker acts as this role whenever it runs the endpoint's model: to start it (pull the
image, read the model object, write the logs and instance metrics, read the rollback
alarms, attach the model to a VPC), to serve an asynchronous invocation, and to run a
batch transform job on the model. Each grant family is a method here, scoped to the one
image, object, log group, bucket prefixes and topics it needs, with the cdk-nag
acknowledgment of each wildcard beside the grant that makes it; `SageMakerEndpoint` only
decides which families its endpoint gets.
"""

from __future__ import annotations

from collections.abc import Sequence

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from constructs import Construct

from cdk_constructs.container_image import EcrImage
from cdk_constructs.deploy_roles import service_principal
from cdk_constructs.endpoint_props import AsyncInference, NetworkSettings, require_key_prefix
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.nag import acknowledge, nag_resource

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
# Where SageMaker writes a transform job's logs and instance metrics (fixed names, shared by
# every job of the account and region, so created by SageMaker rather than by a stack).
TRANSFORM_LOG_GROUP = "/aws/sagemaker/TransformJobs"
TRANSFORM_METRIC_NAMESPACE = "/aws/sagemaker/TransformJobs"


class ExecutionRole(iam.Role):
    """The role SageMaker assumes for this account and region only, to run `model` in
    `image` (private ECR): it may read only the model object (decrypting with its key via
    S3), pull only the image's repository, write only `log_group` and SageMaker's instance
    metrics, read the `rollback_alarms`, and with `network` manage the model's network
    interfaces in those subnets. The `allow_*` methods open it further."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        image: EcrImage,
        model: ModelArtifact,
        log_group: logs.ILogGroup,
        network: NetworkSettings | None,
        rollback_alarms: Sequence[cloudwatch.IAlarm],
    ) -> None:
        stack = Stack.of(scope)
        super().__init__(
            scope,
            construct_id,
            # Confused-deputy guard: only SageMaker acting for this account and region.
            assumed_by=service_principal(
                stack,
                "sagemaker.amazonaws.com",
                stack.format_arn(
                    service="sagemaker", resource="*", arn_format=ArnFormat.NO_RESOURCE_NAME
                ),
            ),
            description=f"SageMaker execution role of {endpoint_name}",
        )
        self.artifact = model
        self.allow_model(model)
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[log_group.log_group_arn],
            )
        )
        self.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "ecr:BatchCheckLayerAvailability",
                    "ecr:BatchGetImage",
                    "ecr:GetDownloadUrlForLayer",
                ],
                resources=[image.repository_arn(self)],
            )
        )
        self.add_to_policy(
            iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"])
        )
        if rollback_alarms:
            # Blue/green auto-rollback: SageMaker reads the alarms as this role.
            self.add_to_policy(
                iam.PolicyStatement(
                    actions=["cloudwatch:DescribeAlarms"],
                    resources=[alarm.alarm_arn for alarm in rollback_alarms],
                )
            )
        # The instance metrics (memory, disk, GPU memory) the alarms watch are published as
        # this role, into SageMaker's namespace only.
        self.add_to_policy(
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
            self._allow_network(network)
            unscoped.append(
                "the EC2 Describe* actions and DeleteNetworkInterfacePermission SageMaker "
                "uses to attach the model to the configured subnets take no resource "
                "scoping; the ENI actions are limited to those subnets by condition"
            )
        acknowledge(self, "AwsSolutions-IAM5[Resource::*]", "; ".join(unscoped) + ".")

    def allow_model(self, model: ModelArtifact) -> None:
        """Read `model`'s object (decrypting with its key via S3 only): the endpoint's own
        model, and a shadow variant's, which SageMaker starts as the same role."""
        self.add_to_policy(
            iam.PolicyStatement(actions=["s3:GetObject"], resources=[model.object_arn])
        )
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt"],
                resources=[model.key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": _via(Stack.of(self), "s3")}},
            )
        )

    def allow_batch_transform(self, *, input_prefix: str, output_prefix: str) -> None:
        """Let transform jobs run on the model: a job reads its S3 input and writes its
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
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogGroup"], resources=[log_group(TRANSFORM_LOG_GROUP)]
            )
        )
        streams = log_group(f"{TRANSFORM_LOG_GROUP}:*")
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[streams],
            )
        )
        acknowledge(
            self,
            f"AwsSolutions-IAM5[Resource::{nag_resource(stack, streams)}]",
            f"Transform jobs log to SageMaker's fixed group {TRANSFORM_LOG_GROUP}, one "
            "stream per job and instance, named by SageMaker when the job starts.",
        )
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": TRANSFORM_METRIC_NAMESPACE}},
            )
        )

    def allow_async_inference(self, config: AsyncInference) -> None:
        """InvokeEndpointAsync's input (read), the answers and failures (written), and the
        two outcome topics (publish; their key through SNS only)."""
        stack = Stack.of(self)
        self.allow_prefixes(
            read=[config.input_prefix],
            write=[config.output_prefix, config.failure_prefix],
            purpose="an asynchronous invocation",
        )
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["sns:Publish"],
                resources=[config.success_topic.topic_arn, config.error_topic.topic_arn],
            )
        )
        self.add_to_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=[self.artifact.key.key_arn],
                conditions={"StringEquals": {"kms:ViaService": _via(stack, "sns")}},
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
            self.add_to_policy(
                iam.PolicyStatement(
                    actions=["s3:GetObject"], resources=[objects[prefix] for prefix in read]
                )
            )
        if read and listed:
            self.add_to_policy(
                iam.PolicyStatement(
                    actions=["s3:ListBucket"],
                    resources=[bucket_arn],
                    conditions={"StringLike": {"s3:prefix": [f"{prefix}*" for prefix in read]}},
                )
            )
        if write:
            self.add_to_policy(
                iam.PolicyStatement(
                    actions=["s3:PutObject", "s3:AbortMultipartUpload"],
                    resources=[objects[prefix] for prefix in write],
                )
            )
        key = self.artifact.key.key_arn
        self.add_to_policy(
            iam.PolicyStatement(
                # A multipart upload to an SSE-KMS bucket decrypts its data key for each part.
                actions=["kms:Decrypt", *(["kms:GenerateDataKey"] if write else [])],
                resources=[key],
                conditions={"StringEquals": {"kms:ViaService": _via(stack, "s3")}},
            )
        )
        if write:
            self.add_to_policy(iam.PolicyStatement(actions=["kms:Encrypt"], resources=[key]))
        for prefix, resource in objects.items():
            acknowledge(
                self,
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

    def _allow_network(self, network: NetworkSettings) -> None:
        stack = Stack.of(self)

        def ec2_arn(resource: str, name: str) -> str:
            return stack.format_arn(
                service="ec2",
                resource=resource,
                resource_name=name,
                arn_format=ArnFormat.SLASH_RESOURCE_NAME,
            )

        self.add_to_policy(iam.PolicyStatement(actions=list(VPC_DESCRIBE_ACTIONS), resources=["*"]))
        subnets = [ec2_arn("subnet", subnet) for subnet in network.subnet_ids]
        conditions: dict[str, dict[str, object]] = {"ArnEquals": {"ec2:Subnet": subnets}}
        if network.vpc_id is not None:
            conditions["ArnEquals"]["ec2:Vpc"] = ec2_arn("vpc", network.vpc_id)
        interfaces = ec2_arn("network-interface", "*")
        self.add_to_policy(
            iam.PolicyStatement(
                actions=list(VPC_ENI_ACTIONS),
                resources=[interfaces],
                conditions=conditions,
            )
        )
        acknowledge(
            self,
            f"AwsSolutions-IAM5[Resource::{nag_resource(stack, interfaces)}]",
            "SageMaker creates the model's network interfaces, so their ids are not known; "
            "the statement is limited to interfaces in the configured subnets (ec2:Subnet, "
            "ec2:Vpc conditions).",
        )
        self.add_to_policy(
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
