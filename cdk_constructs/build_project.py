"""CodeBuild project with a role that holds only what the build needs.

The role is handed to CodeBuild as immutable so the L2 construct cannot widen it
(report groups, `/aws/codebuild/*` logs); each build adds its own statements, naming ARNs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from aws_cdk import ArnFormat, Duration, IgnoreMode, RemovalPolicy, Stack
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3_assets as s3_assets
from constructs import Construct

from cdk_constructs.deploy_roles import service_principal

BUILD_IMAGE = codebuild.LinuxBuildImage.AMAZON_LINUX_2023_5
# CodeBuild's smallest queued timeout. A build waits at most this long for a host, then runs
# at most its own timeout: together they end before the deploy-time waiter gives up.
QUEUED_TIMEOUT = Duration.minutes(5)


class RepoSource(Construct):
    """Upload only the named top-level paths of the repository as a CodeBuild source.

    Docker-style ignore rules anchor patterns at the root, so `*` plus `!name` keeps exactly
    the build inputs; the asset hash then changes only when an input changes.
    """

    def __init__(
        self, scope: Construct, construct_id: str, *, root: Path, include: Sequence[str]
    ) -> None:
        super().__init__(scope, construct_id)
        self.asset = s3_assets.Asset(
            self,
            "Asset",
            path=str(root),
            ignore_mode=IgnoreMode.DOCKER,
            exclude=["*", *(f"!{name}" for name in include), "**/__pycache__", "**/*.pyc"],
        )

    @property
    def asset_hash(self) -> str:
        return self.asset.asset_hash


class BuildProject(Construct):
    """A KMS-encrypted CodeBuild project reading `source`, logging to its own log group.

    The log group is encrypted with `encryption_key` too (its key policy must allow the
    CloudWatch Logs service: `allow_log_encryption`). `buildspec` is a path inside `source`,
    or an inline `codebuild.BuildSpec` for a project that needs no source. Every build host
    is an ordinary Linux container host (no GPU); a `docker_cache` project keeps Docker
    layers in CodeBuild's local cache between builds on the same host.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        description: str,
        source: RepoSource | None,
        buildspec: str | codebuild.BuildSpec,
        environment_variables: Mapping[str, str],
        encryption_key: kms.IKey,
        compute_type: codebuild.ComputeType,
        timeout: Duration,
        removal_policy: RemovalPolicy,
        privileged: bool = False,
        docker_cache: bool = False,
    ) -> None:
        super().__init__(scope, construct_id)
        self.log_group = logs.LogGroup(
            self,
            "Logs",
            retention=logs.RetentionDays.THREE_MONTHS,
            encryption_key=encryption_key,
            removal_policy=removal_policy,
        )
        stack = Stack.of(self)
        self.role = iam.Role(
            self,
            "Role",
            # Confused-deputy guard: only CodeBuild projects of this account and region.
            assumed_by=service_principal(
                stack,
                "codebuild.amazonaws.com",
                stack.format_arn(
                    service="codebuild",
                    resource="project",
                    resource_name="*",
                    arn_format=ArnFormat.SLASH_RESOURCE_NAME,
                ),
            ),
            description=description,
        )
        self.project = codebuild.Project(
            self,
            "Project",
            description=description,
            role=self.role.without_policy_updates(),
            source=None
            if source is None
            else codebuild.Source.s3(bucket=source.asset.bucket, path=source.asset.s3_object_key),
            build_spec=codebuild.BuildSpec.from_source_filename(buildspec)
            if isinstance(buildspec, str)
            else buildspec,
            environment=codebuild.BuildEnvironment(
                build_image=BUILD_IMAGE, compute_type=compute_type, privileged=privileged
            ),
            environment_variables={
                name: codebuild.BuildEnvironmentVariable(value=value)
                for name, value in sorted(environment_variables.items())
            },
            encryption_key=encryption_key,
            logging=codebuild.LoggingOptions(
                cloud_watch=codebuild.CloudWatchLoggingOptions(log_group=self.log_group)
            ),
            timeout=timeout,
            queued_timeout=QUEUED_TIMEOUT,
            cache=codebuild.Cache.local(codebuild.LocalCacheMode.DOCKER_LAYER)
            if docker_cache
            else None,
            grant_report_group_permissions=False,
        )
        # The build must not start before its permissions exist.
        self.project.node.add_dependency(self.role)
        self.allow(["logs:CreateLogStream", "logs:PutLogEvents"], [self.log_group.log_group_arn])
        if source is not None:
            self.allow(
                ["s3:GetObject", "s3:GetObjectVersion"],
                [source.asset.bucket.arn_for_objects(source.asset.s3_object_key)],
            )
        self.allow(["kms:Decrypt", "kms:Encrypt", "kms:GenerateDataKey"], [encryption_key.key_arn])

    def allow(self, actions: Sequence[str], resources: Sequence[str]) -> None:
        """Grant the build `actions` on exactly `resources`."""
        self.role.add_to_policy(
            iam.PolicyStatement(actions=list(actions), resources=list(resources))
        )


def allow_log_encryption(key: kms.Key) -> None:
    """Let CloudWatch Logs use `key` for log groups of this account and region only."""
    stack = Stack.of(key)
    key.add_to_resource_policy(
        iam.PolicyStatement(
            sid="CloudWatchLogsEncryption",
            principals=[iam.ServicePrincipal(f"logs.{stack.region}.{stack.url_suffix}")],
            actions=[
                "kms:Decrypt",
                "kms:DescribeKey",
                "kms:Encrypt",
                "kms:GenerateDataKey",
                "kms:GenerateDataKeyWithoutPlaintext",
                "kms:ReEncryptFrom",
                "kms:ReEncryptTo",
            ],
            resources=["*"],
            conditions={
                "ArnLike": {
                    "kms:EncryptionContext:aws:logs:arn": stack.format_arn(
                        service="logs",
                        resource="log-group",
                        resource_name="*",
                        arn_format=ArnFormat.COLON_RESOURCE_NAME,
                    )
                }
            },
        )
    )
