"""Trust and logging pieces every role of the deploy machinery shares.

`service_principal` is the confused-deputy guard: the service may assume the role only for
this account and for resources matching `source_arn`. `machinery_logs` is the log group of
deploy-time Lambdas (removed with the stack in every environment, encrypted with the
environment's key, whose policy admits CloudWatch Logs), and `allow_logging` lets roles
write to it and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable

from aws_cdk import RemovalPolicy, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct


def service_principal(stack: Stack, service: str, source_arn: str) -> iam.ServicePrincipal:
    return iam.ServicePrincipal(
        service,
        conditions={
            "StringEquals": {"aws:SourceAccount": stack.account},
            "ArnLike": {"aws:SourceArn": source_arn},
        },
    )


def machinery_logs(scope: Construct, key: kms.IKey) -> logs.LogGroup:
    return logs.LogGroup(
        scope,
        "Logs",
        retention=logs.RetentionDays.ONE_MONTH,
        encryption_key=key,
        removal_policy=RemovalPolicy.DESTROY,
    )


def allow_logging(roles: Iterable[iam.IRole], log_group: logs.ILogGroup) -> None:
    for role in roles:
        role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["logs:CreateLogStream", "logs:PutLogEvents"],
                resources=[log_group.log_group_arn],
            )
        )
