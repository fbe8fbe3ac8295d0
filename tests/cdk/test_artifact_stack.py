"""The artifact stack: the model bucket and its key, the model build and what it may touch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from aws_cdk.assertions import Capture, Match, Template

from cdk_constructs.deploy_time_build import MAX_BUILD_TIMEOUT, TOTAL_TIMEOUT
from cdk_constructs.model_build import ARCHIVE_SHA256, ARCHIVE_URI, GGUF_SHA256, model_object_key
from stacks.config import ModelSource
from stacks.environments import ENVIRONMENTS
from tests.cdk.support import (
    Synth,
    as_list,
    logical_id,
    object_arn,
    statements,
    synthesize_environment,
)


def _artifact_bucket(template: Template) -> str:
    """The access-logged bucket (the other bucket is its access-log target)."""
    (bucket_id,) = template.find_resources(
        "AWS::S3::Bucket", {"Properties": {"LoggingConfiguration": Match.any_value()}}
    )
    return bucket_id


def test_artifact_bucket_is_kms_encrypted_versioned_logged_and_private(synth: Synth) -> None:
    template = synth.template("dev", "artifact")
    bucket_id = _artifact_bucket(template)
    key = Capture()
    access_logs = Capture()
    template.has_resource_properties(
        "AWS::S3::Bucket",
        {
            "BucketEncryption": {
                "ServerSideEncryptionConfiguration": [
                    Match.object_like(
                        {
                            "ServerSideEncryptionByDefault": {
                                "SSEAlgorithm": "aws:kms",
                                "KMSMasterKeyID": {"Fn::GetAtt": [key, "Arn"]},
                            }
                        }
                    )
                ]
            },
            "VersioningConfiguration": Match.exact({"Status": "Enabled"}),
            "PublicAccessBlockConfiguration": Match.exact(
                {
                    "BlockPublicAcls": True,
                    "BlockPublicPolicy": True,
                    "IgnorePublicAcls": True,
                    "RestrictPublicBuckets": True,
                }
            ),
            "LifecycleConfiguration": {
                "Rules": Match.array_with(
                    [Match.object_like({"NoncurrentVersionExpiration": {"NoncurrentDays": 30}})]
                )
            },
            "LoggingConfiguration": Match.object_like(
                {"DestinationBucketName": {"Ref": access_logs}}
            ),
        },
    )
    assert template.to_json()["Resources"][key.as_string()]["Properties"]["EnableKeyRotation"]
    assert template.to_json()["Resources"][access_logs.as_string()]["Type"] == "AWS::S3::Bucket"
    template.has_resource_properties(
        "AWS::S3::BucketPolicy",
        {
            "Bucket": {"Ref": bucket_id},
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Effect": "Deny",
                                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                            }
                        )
                    ]
                )
            },
        },
    )


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_model_build_project_runs_the_model_buildspec_with_the_pinned_model(
    synth: Synth, env: str
) -> None:
    config = ENVIRONMENTS[env]
    template = synth.template(env, "artifact")
    raw = template.to_json()
    bucket_id = _artifact_bucket(template)
    key_id = logical_id(raw, "AWS::KMS::Key")
    template.resource_count_is("AWS::CodeBuild::Project", 1)
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Source": Match.object_like({"BuildSpec": "model_build/buildspec.yml"}),
            "TimeoutInMinutes": MAX_BUILD_TIMEOUT.to_minutes(),
            "EncryptionKey": {"Fn::GetAtt": [key_id, "Arn"]},
            "Environment": Match.object_like(
                {
                    "EnvironmentVariables": Match.array_with(
                        [
                            Match.object_like(
                                {
                                    "Name": "MODEL_DEST_URI",
                                    "Value": {
                                        "Fn::Join": [
                                            "",
                                            [
                                                "s3://",
                                                {"Ref": bucket_id},
                                                f"/{model_object_key(config.model.sha256)}",
                                            ],
                                        ]
                                    },
                                }
                            ),
                            Match.object_like(
                                {
                                    "Name": "MODEL_KMS_KEY_ID",
                                    "Value": {"Fn::GetAtt": [key_id, "Arn"]},
                                }
                            ),
                            Match.object_like(
                                {"Name": "MODEL_SHA256", "Value": config.model.sha256}
                            ),
                            Match.object_like(
                                {"Name": "MODEL_SOURCE_URI", "Value": config.model.uri}
                            ),
                        ]
                    )
                }
            ),
        },
    )
    build_id = logical_id(raw, "Custom::DeployTimeBuild")
    template.has_resource_properties(
        "Custom::DeployTimeBuild",
        {"OutputVariables": [ARCHIVE_URI, ARCHIVE_SHA256, GGUF_SHA256]},
    )
    template.has_output("ModelSha256", {"Value": {"Fn::GetAtt": [build_id, GGUF_SHA256]}})
    template.has_output("ModelS3Uri", {"Value": {"Fn::GetAtt": [build_id, ARCHIVE_URI]}})


def test_model_build_role_writes_only_its_object(synth: Synth) -> None:
    template = synth.template("dev", "artifact")
    bucket_arn = {"Fn::GetAtt": [_artifact_bucket(template), "Arn"]}
    key = model_object_key(ENVIRONMENTS["dev"].model.sha256)
    writes = [
        statement
        for _, statement in statements(template.to_json())
        if "s3:PutObject" in as_list(statement["Action"])
    ]
    assert len(writes) == 1
    template.has_resource_properties(
        "AWS::IAM::Policy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Action": Match.array_with(["s3:PutObject"]),
                                "Resource": object_arn(bucket_arn, key),
                            }
                        )
                    ]
                )
            }
        },
    )


def test_model_build_role_reads_an_s3_source_object(tmp_path: Path) -> None:
    uri = "s3://model-sources/qwen/Qwen3.5-4B-Q4_K_M.gguf"
    config = replace(ENVIRONMENTS["dev"], model=ModelSource(uri=uri, sha256="a" * 64))
    assembly = synthesize_environment(config, tmp_path)
    template = Template.from_json(assembly.get_stack_by_name("semif-dev-artifact").template)
    source_read = {
        "Action": "s3:GetObject",
        "Effect": "Allow",
        "Resource": {
            "Fn::Join": [
                "",
                [
                    "arn:",
                    {"Ref": "AWS::Partition"},
                    ":s3:::model-sources/qwen/Qwen3.5-4B-Q4_K_M.gguf",
                ],
            ]
        },
    }
    template.has_resource_properties(
        "AWS::IAM::Policy",
        {"PolicyDocument": {"Statement": Match.array_with([source_read])}},
    )
    # That is the only statement granting s3:GetObject alone.
    reads = [
        statement
        for _, statement in statements(template.to_json())
        if as_list(statement["Action"]) == ["s3:GetObject"]
    ]
    assert reads == [source_read]


def test_deploy_time_build_finishes_inside_the_custom_resource_hour() -> None:
    assert MAX_BUILD_TIMEOUT.to_minutes() < TOTAL_TIMEOUT.to_minutes() < 60
