"""The environment's alarm topic: KMS-encrypted SNS that CloudWatch alarms may publish to;
and `encrypted_topic`, the shape of every topic the app creates."""

from __future__ import annotations

import re

from aws_cdk import ArnFormat, Stack
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from cdk_constructs.validation import require

_EMAIL = re.compile(r"^[^@\s]+@[^@\s]+\.[^@\s]+$")


def require_email(address: str, what: str) -> str:
    require(bool(_EMAIL.fullmatch(address)), f"{what}: {address!r} is not an email address")
    return address


def encrypted_topic(
    scope: Construct, construct_id: str, *, key: kms.IKey, display_name: str
) -> sns.Topic:
    """A topic encrypted with `key` whose policy refuses every request not made over TLS.
    Publishers that are IAM principals need `sns:Publish` on it and the key through SNS."""
    return sns.Topic(
        scope, construct_id, display_name=display_name, master_key=key, enforce_ssl=True
    )


class AlarmTopic(Construct):
    """SNS topic encrypted with `key`, TLS-only; CloudWatch alarms of this account and region
    may publish (topic policy and key policy), and `email` (optional) is subscribed. An
    email subscription stays pending until its owner confirms the message AWS sends."""

    def __init__(
        self, scope: Construct, construct_id: str, *, key: kms.Key, email: str | None
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        alarms = stack.format_arn(
            service="cloudwatch",
            resource="alarm",
            resource_name="*",
            arn_format=ArnFormat.COLON_RESOURCE_NAME,
        )
        conditions = {
            "StringEquals": {"aws:SourceAccount": stack.account},
            "ArnLike": {"aws:SourceArn": alarms},
        }
        self.topic = encrypted_topic(self, "Topic", key=key, display_name="semif endpoint alarms")
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarms",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["sns:Publish"],
                resources=[self.topic.topic_arn],
                conditions=conditions,
            )
        )
        key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="CloudWatchAlarmsToEncryptedTopic",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey"],
                resources=["*"],
                # As AWS documents it for alarms to an SSE topic: no condition, since the
                # key calls are made by SNS for the publishing service.
            )
        )
        if email is not None:
            self.topic.add_subscription(
                subscriptions.EmailSubscription(require_email(email, "alarm_email"))
            )
