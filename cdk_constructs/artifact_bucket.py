"""The model artifact bucket: KMS-encrypted, TLS-only, versioned, access-logged.

Its key is the environment's key: it also encrypts every log group and the alarm topic.
"""

from __future__ import annotations

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from cdk_constructs.build_project import allow_log_encryption
from cdk_constructs.nag import acknowledge

NONCURRENT_VERSION_DAYS = 30
ACCESS_LOG_DAYS = 365


class ArtifactBucket(Construct):
    """Bucket + customer-managed key (rotated) + access-log bucket.

    `removal_policy` DESTROY empties and deletes both buckets on `cdk destroy`; RETAIN
    keeps them (and the key), so a production model survives a stack teardown.
    """

    def __init__(
        self, scope: Construct, construct_id: str, *, removal_policy: RemovalPolicy
    ) -> None:
        super().__init__(scope, construct_id)
        destroy = removal_policy == RemovalPolicy.DESTROY
        self.key = kms.Key(
            self,
            "Key",
            description="Encrypts model artifacts and build outputs",
            enable_key_rotation=True,
            removal_policy=removal_policy,
        )
        allow_log_encryption(self.key)  # every log group of the environment uses this key
        self.access_logs = s3.Bucket(
            self,
            "AccessLogs",
            # Server access logging can only deliver to SSE-S3 buckets.
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            # Ownership is left to CDK: with cdk.json's serverAccessLogsUseBucketPolicy flag
            # the log delivery is granted by bucket policy and ACLs stay disabled.
            lifecycle_rules=[s3.LifecycleRule(expiration=Duration.days(ACCESS_LOG_DAYS))],
            removal_policy=removal_policy,
            auto_delete_objects=destroy,
        )
        acknowledge(
            self.access_logs,
            "AwsSolutions-S1",
            "This is the access-log target bucket; logging it into itself would loop.",
        )
        self.bucket = s3.Bucket(
            self,
            "Bucket",
            encryption=s3.BucketEncryption.KMS,
            encryption_key=self.key,
            bucket_key_enabled=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            enforce_ssl=True,
            versioned=True,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            server_access_logs_bucket=self.access_logs,
            server_access_logs_prefix="artifacts/",
            lifecycle_rules=[
                s3.LifecycleRule(
                    noncurrent_version_expiration=Duration.days(NONCURRENT_VERSION_DAYS),
                    abort_incomplete_multipart_upload_after=Duration.days(7),
                )
            ],
            removal_policy=removal_policy,
            auto_delete_objects=destroy,
        )
