"""The artifact stack: the model bucket and its key, the model build and what it may touch."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from aws_cdk.assertions import Capture, Match, Template

from cdk_constructs.deploy_time_build import MAX_BUILD_TIMEOUT, TOTAL_TIMEOUT
from cdk_constructs.model_build import (
    ARCHIVE_SHA256,
    ARCHIVE_URI,
    CALIBRATION_FILE,
    CHAT_TEMPLATE_FILE,
    GGUF_SHA256,
    model_object_key,
)
from stacks.config import REPO_ROOT, ModelSource
from stacks.environments import ENVIRONMENTS
from tests.support.templates import (
    CALIBRATIONS,
    VALID_CALIBRATION,
    VALID_CHAT_TEMPLATE,
    Synth,
    as_list,
    logical_id,
    object_arn,
    statements,
    synthesize_environment,
)

# A chat template for the tests, named relative to the repository like an environment's.


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


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_model_build_without_files_gets_no_file_variables(synth: Synth, env: str) -> None:
    """No shipped environment names a calibration or a chat template: model-build gets
    neither variable, and the key is the plain one checked above."""
    assert ENVIRONMENTS[env].model.build_files == ()
    for variable in (CALIBRATION_FILE, CHAT_TEMPLATE_FILE):
        synth.template(env, "artifact").has_resource_properties(
            "AWS::CodeBuild::Project",
            {
                "Environment": Match.object_like(
                    {
                        "EnvironmentVariables": Match.not_(
                            Match.array_with([Match.object_like({"Name": variable})])
                        )
                    }
                )
            },
        )


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
    model = ModelSource(uri=uri, sha256="a" * 64, size_bytes=2_740_000_000)
    config = replace(ENVIRONMENTS["dev"], model=model)
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


def test_a_calibrated_model_build_packs_the_file_into_its_own_object(tmp_path: Path) -> None:
    calibrated = replace(ENVIRONMENTS["dev"].model, calibration=VALID_CALIBRATION)
    assert calibrated.build_calibration is not None
    config = replace(ENVIRONMENTS["dev"], model=calibrated)
    assembly = synthesize_environment(config, tmp_path)
    stack = assembly.get_stack_by_name("semif-dev-artifact")
    template = Template.from_json(stack.template)
    bucket_id = _artifact_bucket(template)
    key = model_object_key(calibrated.sha256, calibrated.build_calibration)
    assert key.endswith(f"/calibration-{calibrated.build_calibration.sha256}/model.tar.gz")
    variables = Capture()
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {"Environment": Match.object_like({"EnvironmentVariables": variables})},
    )
    by_name = {variable["Name"]: variable["Value"] for variable in variables.as_array()}
    assert by_name[CALIBRATION_FILE] == VALID_CALIBRATION  # model-build reads it by this path
    assert by_name["MODEL_DEST_URI"] == {"Fn::Join": ["", ["s3://", {"Ref": bucket_id}, f"/{key}"]]}
    # The file travels in the build's source asset, beside model_build/ and nothing else.
    assets = json.loads((tmp_path / "semif-dev-artifact.assets.json").read_text())["files"]
    (source,) = (
        tmp_path / asset["source"]["path"]
        for asset in assets.values()
        if asset["displayName"] == "ModelBuildSource/Asset"
    )
    assert (source / VALID_CALIBRATION).read_bytes() == (REPO_ROOT / VALID_CALIBRATION).read_bytes()
    assert sorted(p.name for p in source.iterdir()) == ["model_build", "tests"]
    assert [p.name for p in (source / CALIBRATIONS).iterdir()] == ["valid.json"]
    # Both endpoints serve (and may read) exactly the calibrated object.
    decision = Template.from_json(assembly.get_stack_by_name("semif-dev-decision").template)
    decision.has_resource_properties(
        "AWS::SageMaker::Model",
        {
            "PrimaryContainer": Match.object_like(
                {"ModelDataUrl": {"Fn::Join": ["", ["s3://", Match.any_value(), f"/{key}"]]}}
            )
        },
    )


def _model_data_url(key: str) -> dict[str, object]:
    return {
        "PrimaryContainer": Match.object_like(
            {"ModelDataUrl": {"Fn::Join": ["", ["s3://", Match.any_value(), f"/{key}"]]}}
        )
    }


def test_a_chat_template_model_build_packs_the_file_into_its_own_object(tmp_path: Path) -> None:
    templated = replace(ENVIRONMENTS["dev"].model, chat_template=VALID_CHAT_TEMPLATE)
    template_file = templated.build_chat_template
    assert template_file is not None
    config = replace(ENVIRONMENTS["dev"], model=templated)
    assembly = synthesize_environment(config, tmp_path)
    template = Template.from_json(assembly.get_stack_by_name("semif-dev-artifact").template)
    bucket_id = _artifact_bucket(template)
    key = model_object_key(templated.sha256, chat_template=template_file)
    assert key == f"models/{templated.sha256}/chat-template-{template_file.sha256}/model.tar.gz"
    dest = Capture()
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Environment": Match.object_like(
                {
                    "EnvironmentVariables": Match.array_with(
                        [
                            # model-build reads the template by its path in the source
                            Match.object_like(
                                {"Name": CHAT_TEMPLATE_FILE, "Value": VALID_CHAT_TEMPLATE}
                            ),
                            Match.object_like({"Name": "MODEL_DEST_URI", "Value": dest}),
                        ]
                    )
                }
            )
        },
    )
    assert dest.as_object() == {"Fn::Join": ["", ["s3://", {"Ref": bucket_id}, f"/{key}"]]}
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Environment": Match.object_like(
                {
                    "EnvironmentVariables": Match.not_(
                        Match.array_with([Match.object_like({"Name": CALIBRATION_FILE})])
                    )
                }
            )
        },
    )
    # The build role writes exactly the new object.
    bucket_arn = {"Fn::GetAtt": [bucket_id, "Arn"]}
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
    # The file travels in the build's source asset, beside model_build/ and nothing else.
    assets = json.loads((tmp_path / "semif-dev-artifact.assets.json").read_text())["files"]
    (source,) = (
        tmp_path / asset["source"]["path"]
        for asset in assets.values()
        if asset["displayName"] == "ModelBuildSource/Asset"
    )
    packed = (source / VALID_CHAT_TEMPLATE).read_bytes()
    assert packed == (REPO_ROOT / VALID_CHAT_TEMPLATE).read_bytes()
    assert sorted(p.name for p in source.iterdir()) == ["model_build", "tests"]
    assert [p.name for p in (source / VALID_CHAT_TEMPLATE).parent.iterdir()] == ["valid.jinja"]
    # Both endpoints serve exactly the new object: a new SageMaker model each (blue/green).
    for unit in ("decision", "standard"):
        endpoint = Template.from_json(assembly.get_stack_by_name(f"semif-dev-{unit}").template)
        endpoint.has_resource_properties("AWS::SageMaker::Model", _model_data_url(key))


def test_a_calibration_and_a_chat_template_name_one_object(tmp_path: Path) -> None:
    model = replace(
        ENVIRONMENTS["dev"].model,
        calibration=VALID_CALIBRATION,
        chat_template=VALID_CHAT_TEMPLATE,
    )
    assert model.build_calibration is not None
    assert model.build_chat_template is not None
    key = model_object_key(model.sha256, model.build_calibration, model.build_chat_template)
    assert key == (
        f"models/{model.sha256}/calibration-{model.build_calibration.sha256}"
        f"/chat-template-{model.build_chat_template.sha256}/model.tar.gz"
    )
    assembly = synthesize_environment(replace(ENVIRONMENTS["dev"], model=model), tmp_path)
    artifact = Template.from_json(assembly.get_stack_by_name("semif-dev-artifact").template)
    artifact.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Environment": Match.object_like(
                {
                    "EnvironmentVariables": Match.array_with(
                        [
                            Match.object_like(
                                {"Name": CALIBRATION_FILE, "Value": VALID_CALIBRATION}
                            ),
                            Match.object_like(
                                {"Name": CHAT_TEMPLATE_FILE, "Value": VALID_CHAT_TEMPLATE}
                            ),
                        ]
                    )
                }
            )
        },
    )
    decision = Template.from_json(assembly.get_stack_by_name("semif-dev-decision").template)
    decision.has_resource_properties("AWS::SageMaker::Model", _model_data_url(key))


@pytest.mark.parametrize(
    "add_file",
    [
        lambda model: replace(model, calibration=VALID_CALIBRATION),
        lambda model: replace(model, chat_template=VALID_CHAT_TEMPLATE),
    ],
    ids=["calibration", "chat_template"],
)
def test_a_new_calibration_or_chat_template_is_a_new_build(
    tmp_path: Path, add_file: Callable[[ModelSource], ModelSource]
) -> None:
    """The build trigger hashes the source asset, which holds the file."""

    def trigger(model: ModelSource, outdir: Path) -> str:
        assembly = synthesize_environment(replace(ENVIRONMENTS["dev"], model=model), outdir)
        raw = assembly.get_stack_by_name("semif-dev-artifact").template
        build = raw["Resources"][logical_id(raw, "Custom::DeployTimeBuild")]
        return str(build["Properties"]["Trigger"])

    plain = ENVIRONMENTS["dev"].model
    changed = add_file(plain)
    assert trigger(plain, tmp_path / "plain") != trigger(changed, tmp_path / "changed")
