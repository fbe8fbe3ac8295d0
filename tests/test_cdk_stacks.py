"""The synthesized templates of every environment: resource properties, IAM, nag, cfn-lint.

The whole app (`-c env=all`, cdk-nag included) is synthesized once per module, with the
context from cdk.json as the CLI would pass it; each test reads one template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk.assertions import Match, Template

import app as cdk_app
from cdk_constructs.artifact_bucket import ArtifactBucket
from cdk_constructs.deploy_time_build import MAX_BUILD_TIMEOUT, TOTAL_TIMEOUT
from cdk_constructs.image_build import ImageFlavor, image_tag
from cdk_constructs.model_build import (
    ARCHIVE_SHA256,
    ARCHIVE_URI,
    GGUF_SHA256,
    model_object_key,
)
from cdk_constructs.sagemaker_endpoint import SageMakerEndpoint
from stacks.config import (
    ENVIRONMENTS,
    ConfigError,
    CpuPlacement,
    EndpointKind,
    EnvironmentConfig,
    GpuPlacement,
    ModelSource,
)
from stacks.deployment import add_environment, endpoint_name, stack_name

REPO = Path(__file__).resolve().parents[1]
CDK_CONTEXT: dict[str, Any] = json.loads((REPO / "cdk.json").read_text())["context"]
# Actions that AWS does not scope by resource; every other statement must name ARNs.
UNSCOPED_ACTIONS = {
    "ecr:GetAuthorizationToken",
    "ec2:CreateNetworkInterface",
    "ec2:CreateNetworkInterfacePermission",
    "ec2:DeleteNetworkInterface",
    "ec2:DeleteNetworkInterfacePermission",
    "ec2:DescribeDhcpOptions",
    "ec2:DescribeNetworkInterfaces",
    "ec2:DescribeSecurityGroups",
    "ec2:DescribeSubnets",
    "ec2:DescribeVpcs",
    # Step Functions log delivery (the Provider framework's waiter state machine).
    "logs:CreateLogDelivery",
    "logs:CreateLogStream",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutLogEvents",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
}
# W3005: CDK writes DependsOn next to a GetAtt on purpose (ordering of policies and roles).
CFN_LINT_IGNORED = {"W3005"}


@dataclass
class Synth:
    outdir: Path
    templates: dict[str, dict[str, Any]]
    violations: dict[str, list[str]]

    def template(self, env: str, unit: str) -> Template:
        return Template.from_json(self.templates[f"semif-{env}-{unit}"])

    def raw(self, env: str, unit: str) -> dict[str, Any]:
        return self.templates[f"semif-{env}-{unit}"]


def _synthesize(outdir: Path, with_nag: bool) -> cdk.cx_api.CloudAssembly:
    app = cdk.App(outdir=str(outdir), context={**CDK_CONTEXT, "env": "all"})
    if with_nag:
        return cdk_app.build_app(app, "all").synth()
    for config in ENVIRONMENTS.values():
        add_environment(app, config, cdk_app.REPO_ROOT)
    return app.synth()


def _violations(outdir: Path) -> dict[str, list[str]]:
    report = json.loads((outdir / "validation-report.json").read_text())
    found: dict[str, list[str]] = {}
    for plugin in report["pluginReports"]:
        for violation in plugin["violations"]:
            for construct in violation["violatingConstructs"]:
                stack = construct["constructPath"].split("/")[0]
                found.setdefault(stack, []).append(
                    f"{violation['ruleName']} at {construct['constructPath']}"
                )
    return found


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    outdir = tmp_path_factory.mktemp("cdk.out")
    violations: dict[str, list[str]] = {}
    try:
        assembly = _synthesize(outdir, with_nag=True)
    except RuntimeError:
        # cdk-nag failed the synth: keep its report, synthesize again to test the rest.
        violations = _violations(outdir)
        outdir = tmp_path_factory.mktemp("cdk.out.nonag")
        assembly = _synthesize(outdir, with_nag=False)
    templates = {stack.stack_name: stack.template for stack in assembly.stacks}
    return Synth(outdir=outdir, templates=templates, violations=violations)


def expected_stacks(config: EnvironmentConfig) -> set[str]:
    units = {"artifact"}
    if config.deploys(EndpointKind.DECISION):
        units |= {"images", "decision"}
    if config.deploys(EndpointKind.STANDARD):
        units.add("standard")
    return {stack_name(config, unit) for unit in units}


ALL_STACKS = sorted(name for c in ENVIRONMENTS.values() for name in expected_stacks(c))


def resources(template: dict[str, Any], kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for logical_id, resource in template["Resources"].items():
        if resource["Type"] == kind:
            yield logical_id, resource


def one(template: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [resource for _, resource in resources(template, kind)]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]["Properties"]  # type: ignore[no-any-return]


def statements(template: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for logical_id, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::IAM::Policy":
            documents = [props["PolicyDocument"]]
        elif resource["Type"] == "AWS::IAM::Role":
            documents = [policy["PolicyDocument"] for policy in props.get("Policies", [])]
        else:
            continue
        for document in documents:
            for statement in document["Statement"]:
                yield logical_id, statement


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


# --- every environment, every stack ---------------------------------------------------


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_every_environment_synthesizes_its_stacks(synth: Synth, env: str) -> None:
    names = {name for name in synth.templates if name.startswith(f"semif-{env}-")}
    assert names == expected_stacks(ENVIRONMENTS[env])


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_cdk_nag_has_no_findings(synth: Synth, stack: str) -> None:
    assert synth.violations.get(stack, []) == []


def test_cfn_lint_passes_on_every_template(synth: Synth) -> None:
    from cfnlint.api import lint

    problems = []
    for name in synth.templates:
        region = ENVIRONMENTS[name.split("-")[1]].region
        path = synth.outdir / f"{name}.template.json"
        for match in lint(path.read_text(), regions=[region]):
            # Errors and warnings, as the cfn-lint CLI reports by default.
            if match.rule.id[0] in "EW" and match.rule.id not in CFN_LINT_IGNORED:
                problems.append(f"{name}: {match.rule.id} {match.message}")
    assert problems == []


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_iam_wildcards_only_for_unscoped_actions(synth: Synth, stack: str) -> None:
    for logical_id, statement in statements(synth.templates[stack]):
        actions = as_list(statement["Action"])
        assert not any("*" in action for action in actions), (logical_id, actions)
        if "*" in as_list(statement.get("Resource")):
            assert set(actions) <= UNSCOPED_ACTIONS, (logical_id, actions)


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_no_aws_managed_policies_on_our_roles(synth: Synth, stack: str) -> None:
    for logical_id, role in resources(synth.templates[stack], "AWS::IAM::Role"):
        if logical_id.startswith("CustomS3AutoDeleteObjects"):
            continue  # CDK's own bucket-emptying provider (dev environments only)
        assert "ManagedPolicyArns" not in role["Properties"], logical_id


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_tags_from_config_on_every_resource_that_takes_them(synth: Synth, env: str) -> None:
    config = ENVIRONMENTS[env]
    for unit in ("artifact", "decision"):
        for kind in ("AWS::KMS::Key", "AWS::SageMaker::Endpoint", "AWS::IAM::Role"):
            for logical_id, resource in resources(synth.raw(env, unit), kind):
                if logical_id.startswith("Custom"):
                    continue  # CDK's bucket-emptying provider role takes no tags
                tags = {tag["Key"]: tag["Value"] for tag in resource["Properties"]["Tags"]}
                assert tags == dict(config.tags), logical_id


# --- artifact stack ---------------------------------------------------------------------


def _artifact_bucket(template: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    for logical_id, resource in resources(template, "AWS::S3::Bucket"):
        if "LoggingConfiguration" in resource["Properties"]:
            return logical_id, resource
    raise AssertionError("no access-logged artifact bucket")


def test_artifact_bucket_is_kms_encrypted_versioned_logged_and_private(synth: Synth) -> None:
    raw = synth.raw("dev", "artifact")
    logical_id, bucket = _artifact_bucket(raw)
    props = bucket["Properties"]
    (rule,) = props["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == "aws:kms"
    key_ref = rule["ServerSideEncryptionByDefault"]["KMSMasterKeyID"]["Fn::GetAtt"][0]
    assert raw["Resources"][key_ref]["Properties"]["EnableKeyRotation"] is True
    assert props["VersioningConfiguration"] == {"Status": "Enabled"}
    assert props["PublicAccessBlockConfiguration"] == {
        "BlockPublicAcls": True,
        "BlockPublicPolicy": True,
        "IgnorePublicAcls": True,
        "RestrictPublicBuckets": True,
    }
    lifecycle = props["LifecycleConfiguration"]["Rules"][0]
    assert lifecycle["NoncurrentVersionExpiration"]["NoncurrentDays"] == 30
    assert "DestinationBucketName" in props["LoggingConfiguration"]
    synth.template("dev", "artifact").has_resource_properties(
        "AWS::S3::BucketPolicy",
        {
            "Bucket": {"Ref": logical_id},
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


@pytest.mark.parametrize(("env", "policy"), [("dev", "Delete"), ("prod", "Retain")])
def test_data_removal_policy_follows_the_environment(synth: Synth, env: str, policy: str) -> None:
    artifact = synth.raw(env, "artifact")
    for kind in ("AWS::S3::Bucket", "AWS::KMS::Key"):
        for logical_id, resource in resources(artifact, kind):
            assert resource["DeletionPolicy"] == policy, logical_id
    (repository,) = [r for _, r in resources(synth.raw(env, "images"), "AWS::ECR::Repository")]
    assert repository["DeletionPolicy"] == policy
    assert repository["Properties"].get("EmptyOnDelete", False) is (policy == "Delete")
    auto_delete = list(resources(artifact, "Custom::S3AutoDeleteObjects"))
    assert len(auto_delete) == (2 if policy == "Delete" else 0)


def test_dev_removes_every_log_group_on_destroy(synth: Synth) -> None:
    for name, template in synth.templates.items():
        for logical_id, log_group in resources(template, "AWS::Logs::LogGroup"):
            waiter = logical_id.startswith("DeployTimeBuildWaiter")
            expected = "Delete" if waiter or name.startswith("semif-dev-") else "Retain"
            if name.startswith(("semif-dev-", "semif-prod-")):
                assert log_group["DeletionPolicy"] == expected, (name, logical_id)


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_model_build_project_runs_the_model_buildspec_with_the_pinned_model(
    synth: Synth, env: str
) -> None:
    config = ENVIRONMENTS[env]
    raw = synth.raw(env, "artifact")
    project = one(raw, "AWS::CodeBuild::Project")
    assert project["Source"]["BuildSpec"] == "model_build/buildspec.yml"
    assert project["TimeoutInMinutes"] == MAX_BUILD_TIMEOUT.to_minutes()
    assert "EncryptionKey" in project
    variables = {v["Name"]: v["Value"] for v in project["Environment"]["EnvironmentVariables"]}
    assert variables["MODEL_SOURCE_URI"] == config.model.uri
    assert variables["MODEL_SHA256"] == config.model.sha256
    dest = json.dumps(variables["MODEL_DEST_URI"])
    assert f"/{model_object_key(config.model.sha256)}" in dest
    assert "MODEL_KMS_KEY_ID" in variables
    (build_id,) = [logical_id for logical_id, _ in resources(raw, "Custom::DeployTimeBuild")]
    build = raw["Resources"][build_id]["Properties"]
    assert build["OutputVariables"] == [ARCHIVE_URI, ARCHIVE_SHA256, GGUF_SHA256]
    outputs = raw["Outputs"]
    assert outputs["ModelSha256"]["Value"] == {"Fn::GetAtt": [build_id, GGUF_SHA256]}
    assert outputs["ModelS3Uri"]["Value"] == {"Fn::GetAtt": [build_id, ARCHIVE_URI]}


def test_model_build_role_writes_only_its_object(synth: Synth) -> None:
    raw = synth.raw("dev", "artifact")
    key = model_object_key(ENVIRONMENTS["dev"].model.sha256)
    writes = [
        statement
        for _, statement in statements(raw)
        if "s3:PutObject" in as_list(statement["Action"])
    ]
    assert len(writes) == 1
    assert json.dumps(writes[0]["Resource"]).endswith(f'"/{key}"]]}}')


def test_model_build_role_reads_an_s3_source_object(tmp_path: Path) -> None:
    uri = "s3://model-sources/qwen/Qwen3.5-4B-Q4_K_M.gguf"
    config = replace(ENVIRONMENTS["dev"], model=ModelSource(uri=uri, sha256="a" * 64))
    app = cdk.App(outdir=str(tmp_path), context=CDK_CONTEXT)
    add_environment(app, config, cdk_app.REPO_ROOT)
    raw = app.synth().get_stack_by_name("semif-dev-artifact").template
    reads = [
        statement["Resource"]
        for _, statement in statements(raw)
        if as_list(statement["Action"]) == ["s3:GetObject"]
    ]
    assert reads == [
        {
            "Fn::Join": [
                "",
                [
                    "arn:",
                    {"Ref": "AWS::Partition"},
                    ":s3:::model-sources/qwen/Qwen3.5-4B-Q4_K_M.gguf",
                ],
            ]
        }
    ]


def test_deploy_time_build_finishes_inside_the_custom_resource_hour() -> None:
    assert MAX_BUILD_TIMEOUT.to_minutes() < TOTAL_TIMEOUT.to_minutes() < 60


def test_waiter_handlers_may_only_start_and_read_their_project(synth: Synth) -> None:
    raw = synth.raw("dev", "decision")
    codebuild = [s for _, s in statements(raw) if "codebuild:StartBuild" in as_list(s["Action"])]
    assert len(codebuild) == 1
    assert sorted(codebuild[0]["Action"]) == [
        "codebuild:BatchGetBuilds",
        "codebuild:ListBuildsForProject",
        "codebuild:StartBuild",
    ]
    assert "Fn::ImportValue" in codebuild[0]["Resource"]


# --- images stack -----------------------------------------------------------------------


@pytest.mark.parametrize(("env", "flavor"), [("dev", ImageFlavor.CPU), ("gpu", ImageFlavor.CUDA)])
def test_image_build_project_per_flavor(synth: Synth, env: str, flavor: ImageFlavor) -> None:
    config = ENVIRONMENTS[env]
    raw = synth.raw(env, "images")
    repository = one(raw, "AWS::ECR::Repository")
    assert repository["ImageTagMutability"] == "IMMUTABLE"
    assert repository["ImageScanningConfiguration"] == {"ScanOnPush": True}
    rules = json.loads(repository["LifecyclePolicy"]["LifecyclePolicyText"])["rules"]
    # Nothing an endpoint may serve expires: only untagged leftovers do.
    assert [rule["selection"]["tagStatus"] for rule in rules] == ["untagged"]
    project = one(raw, "AWS::CodeBuild::Project")
    assert project["Source"]["BuildSpec"] == "images/buildspec.yml"
    assert project["Environment"]["PrivilegedMode"] is True
    expected_type = "LINUX_GPU_CONTAINER" if flavor.gpu else "LINUX_CONTAINER"
    assert project["Environment"]["Type"] == expected_type
    variables = {v["Name"]: v["Value"] for v in project["Environment"]["EnvironmentVariables"]}
    base = config.dlc_images.cuda if flavor.gpu else config.dlc_images.cpu
    assert variables["DLC_IMAGE"] == base
    assert variables["DOCKERFILE"] == flavor.dockerfile
    assert variables["SMOKE_BACKEND"] == flavor.backend
    assert re.fullmatch(rf"{flavor.label}-[0-9a-f]{{32}}", variables["IMAGE_TAG"])


def test_image_tag_hashes_every_input() -> None:
    base = image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "1" * 64)
    assert base != image_tag(ImageFlavor.CPU, "b" * 64, "repo@sha256:" + "1" * 64)
    assert base != image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "2" * 64)
    assert base != image_tag(ImageFlavor.CUDA, "a" * 64, "repo@sha256:" + "1" * 64)
    assert base == image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "1" * 64)


def test_image_build_role_pushes_only_to_its_repository(synth: Synth) -> None:
    raw = synth.raw("dev", "images")
    (repository_id,) = [logical_id for logical_id, _ in resources(raw, "AWS::ECR::Repository")]
    push = [s for _, s in statements(raw) if "ecr:PutImage" in as_list(s["Action"])]
    assert len(push) == 1
    assert push[0]["Resource"] == {"Fn::GetAtt": [repository_id, "Arn"]}


# --- decision endpoint ------------------------------------------------------------------


def _decision_model(synth: Synth, env: str) -> dict[str, Any]:
    return one(synth.raw(env, "decision"), "AWS::SageMaker::Model")


@pytest.mark.parametrize("env", ["dev", "prod", "gpu"])
def test_decision_model_serves_the_built_digest_with_network_isolation(
    synth: Synth, env: str
) -> None:
    raw = synth.raw(env, "decision")
    model = _decision_model(synth, env)
    assert model["EnableNetworkIsolation"] is True
    build_id = next(logical_id for logical_id, _ in resources(raw, "Custom::DeployTimeBuild"))
    assert model["PrimaryContainer"]["Image"] == {"Fn::GetAtt": [build_id, "IMAGE_URI"]}
    build = raw["Resources"][build_id]["Properties"]
    assert build["OutputVariables"] == ["IMAGE_URI"]
    assert re.fullmatch(r"(cpu|cuda)-[0-9a-f]{32}", build["Trigger"])
    key = model_object_key(ENVIRONMENTS[env].model.sha256)
    assert key in json.dumps(model["PrimaryContainer"]["ModelDataUrl"])
    assert "ModelName" not in model


def test_decision_environment_variables(synth: Synth) -> None:
    config = ENVIRONMENTS["prod"].decision
    assert isinstance(config.placement, CpuPlacement)
    assert _decision_model(synth, "prod")["PrimaryContainer"]["Environment"] == {
        "SEMIF_MAX_IN_FLIGHT": str(config.max_in_flight),
        "SEMIF_MAX_TOKENS": str(config.max_tokens),
        "SEMIF_N_GPU_LAYERS": "0",
        "SEMIF_THREADS": str(config.placement.threads),
    }
    gpu = _decision_model(synth, "gpu")["PrimaryContainer"]["Environment"]
    assert gpu["SEMIF_N_GPU_LAYERS"] == "-1"
    assert "SEMIF_THREADS" not in gpu


def test_cpu_endpoint_config_uses_one_fixed_instance(synth: Synth) -> None:
    config = ENVIRONMENTS["prod"].decision
    assert isinstance(config.placement, CpuPlacement)
    endpoint_config = one(synth.raw("prod", "decision"), "AWS::SageMaker::EndpointConfig")
    assert "EndpointConfigName" not in endpoint_config
    assert "KmsKeyId" in endpoint_config
    (variant,) = endpoint_config["ProductionVariants"]
    assert variant["InstanceType"] == config.placement.instance_type
    assert variant["InitialInstanceCount"] == config.autoscaling.min_capacity
    assert "InstancePools" not in variant
    assert "InferenceAmiVersion" not in variant
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] >= 600


def test_gpu_endpoint_config_uses_ordered_instance_pools_and_the_cuda_ami(synth: Synth) -> None:
    placement = ENVIRONMENTS["gpu"].decision.placement
    assert isinstance(placement, GpuPlacement)
    endpoint_config = one(synth.raw("gpu", "decision"), "AWS::SageMaker::EndpointConfig")
    (variant,) = endpoint_config["ProductionVariants"]
    assert "InstanceType" not in variant
    assert variant["InstancePools"] == [
        {"InstanceType": instance_type, "Priority": priority}
        for priority, instance_type in enumerate(placement.instance_pools, start=1)
    ]
    assert variant["InferenceAmiVersion"] == "al2023-ami-sagemaker-inference-gpu-4-1"
    assert variant["VariantInstanceProvisionTimeoutInSeconds"] == 1200
    assert variant["ContainerStartupHealthCheckTimeoutInSeconds"] >= 600
    assert variant["ModelDataDownloadTimeoutInSeconds"] >= 600
    assert "KmsKeyId" not in endpoint_config  # NVMe instance storage rejects a volume key


def test_decision_endpoint_name_and_outputs(synth: Synth) -> None:
    raw = synth.raw("dev", "decision")
    name = endpoint_name(ENVIRONMENTS["dev"], EndpointKind.DECISION)
    assert one(raw, "AWS::SageMaker::Endpoint")["EndpointName"] == name
    assert raw["Outputs"]["DecisionEndpointName"]["Value"] == name
    assert "IMAGE_URI" in json.dumps(raw["Outputs"]["DecisionImageUri"]["Value"])


def test_decision_role_reads_only_its_model_and_pulls_only_its_repository(synth: Synth) -> None:
    raw = synth.raw("dev", "decision")
    role_policies = [
        s for logical_id, s in statements(raw) if logical_id.startswith("DecisionExecutionRole")
    ]
    by_action = {action: s for s in role_policies for action in as_list(s["Action"])}
    key = model_object_key(ENVIRONMENTS["dev"].model.sha256)
    assert json.dumps(by_action["s3:GetObject"]["Resource"]).endswith(f'"/{key}"]]}}')
    assert "Fn::ImportValue" in by_action["ecr:BatchGetImage"]["Resource"]
    assert "images" in json.dumps(by_action["ecr:BatchGetImage"]["Resource"])
    assert by_action["kms:Decrypt"]["Condition"] == {
        "StringEquals": {"kms:ViaService": "s3.us-east-1.amazonaws.com"}
    }
    assert by_action["logs:PutLogEvents"]["Resource"]["Fn::GetAtt"][1] == "Arn"
    assert not any(action.startswith("s3:Put") for action in by_action)
    (log_group,) = [
        lg for _, lg in resources(raw, "AWS::Logs::LogGroup") if "LogGroupName" in lg["Properties"]
    ]
    assert log_group["Properties"]["LogGroupName"] == "/aws/sagemaker/Endpoints/semif-dev-decision"


@pytest.mark.parametrize(
    ("env", "metric"),
    [
        ("dev", "SageMakerVariantInvocationsPerInstance"),
        ("prod", "SageMakerVariantConcurrentRequestsPerModelHighResolution"),
    ],
)
def test_decision_autoscaling(synth: Synth, env: str, metric: str) -> None:
    scaling = ENVIRONMENTS[env].decision.autoscaling
    raw = synth.raw(env, "decision")
    target = one(raw, "AWS::ApplicationAutoScaling::ScalableTarget")
    assert target["ResourceId"] == f"endpoint/semif-{env}-decision/variant/AllTraffic"
    assert target["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    assert (target["MinCapacity"], target["MaxCapacity"]) == (
        scaling.min_capacity,
        scaling.max_capacity,
    )
    policy = one(raw, "AWS::ApplicationAutoScaling::ScalingPolicy")
    tracking = policy["TargetTrackingScalingPolicyConfiguration"]
    assert tracking["PredefinedMetricSpecification"]["PredefinedMetricType"] == metric
    assert tracking["TargetValue"] == scaling.target_value


def _alarms(raw: dict[str, Any]) -> list[dict[str, Any]]:
    return [alarm["Properties"] for _, alarm in resources(raw, "AWS::CloudWatch::Alarm")]


def _metric_names(alarm: dict[str, Any]) -> set[str]:
    if "MetricName" in alarm:
        return {alarm["MetricName"]}
    return {
        query["MetricStat"]["Metric"]["MetricName"]
        for query in alarm["Metrics"]
        if "MetricStat" in query
    }


def test_decision_alarms_cover_5xx_latency_and_instance_health(synth: Synth) -> None:
    thresholds = ENVIRONMENTS["prod"].decision.alarms
    alarms = _alarms(synth.raw("prod", "decision"))
    by_metric = {frozenset(_metric_names(alarm)): alarm for alarm in alarms}
    assert set(by_metric) == {
        frozenset({"Invocation5XXErrors", "Invocations"}),
        frozenset({"ModelLatency"}),
        frozenset({"MemoryUtilization"}),
        frozenset({"DiskUtilization"}),
    }
    latency = by_metric[frozenset({"ModelLatency"})]
    assert latency["ExtendedStatistic"] == "p95"
    assert latency["Threshold"] == thresholds.p95_model_latency_ms * 1000
    error_rate = by_metric[frozenset({"Invocation5XXErrors", "Invocations"})]
    assert error_rate["Threshold"] == thresholds.five_xx_rate_percent
    for alarm in alarms:
        assert alarm["TreatMissingData"] == "notBreaching"


def test_gpu_alarms_repeat_per_pool_instance_type(synth: Synth) -> None:
    placement = ENVIRONMENTS["gpu"].decision.placement
    assert isinstance(placement, GpuPlacement)
    alarms = _alarms(synth.raw("gpu", "decision"))
    assert len(alarms) == 4 * (1 + len(placement.instance_pools))
    latency_types = {
        dimension["Value"]
        for alarm in alarms
        if alarm.get("MetricName") == "ModelLatency"
        for dimension in alarm["Dimensions"]
        if dimension["Name"] == "InstanceType"
    }
    assert latency_types == set(placement.instance_pools)


# --- standard endpoint ------------------------------------------------------------------


def test_standard_endpoint_serves_the_published_dlc_by_digest(synth: Synth) -> None:
    config = ENVIRONMENTS["dev"]
    raw = synth.raw("dev", "standard")
    model = one(raw, "AWS::SageMaker::Model")
    assert model["PrimaryContainer"]["Image"] == config.dlc_images.cpu
    assert model["EnableNetworkIsolation"] is True
    assert model["PrimaryContainer"]["Environment"] == {
        "SM_LLAMA_CPP_CTX_SIZE": str(config.standard.context_size),
        "SM_LLAMA_CPP_THREADS": str(config.standard.threads),
        "SM_LLAMA_CPP_N_GPU_LAYERS": "0",
    }
    (variant,) = one(raw, "AWS::SageMaker::EndpointConfig")["ProductionVariants"]
    assert variant["InstanceType"] == config.standard.instance_type
    assert "InstancePools" not in variant
    assert one(raw, "AWS::SageMaker::Endpoint")["EndpointName"] == "semif-dev-standard"
    assert raw["Outputs"]["StandardImageUri"]["Value"] == config.dlc_images.cpu
    actions = {a for _, s in statements(raw) for a in as_list(s["Action"])}
    assert not any(action.startswith("ecr:") for action in actions)
    assert len(_alarms(raw)) == 4


def test_vpc_settings_reach_both_models(synth: Synth) -> None:
    network = ENVIRONMENTS["gpu"].network
    assert network is not None
    for unit in ("decision", "standard"):
        model = one(synth.raw("gpu", unit), "AWS::SageMaker::Model")
        assert model["VpcConfig"] == {
            "SecurityGroupIds": list(network.security_group_ids),
            "Subnets": list(network.subnet_ids),
        }
    assert "VpcConfig" not in one(synth.raw("dev", "standard"), "AWS::SageMaker::Model")


def test_endpoint_construct_refuses_a_mutable_image_tag() -> None:
    stack = cdk.Stack(cdk.App(), "Probe")
    artifacts = ArtifactBucket(stack, "Artifacts", removal_policy=cdk.RemovalPolicy.DESTROY)
    with pytest.raises(ConfigError, match="not digest-pinned"):
        SageMakerEndpoint(
            stack,
            "Standard",
            endpoint_name="probe",
            image_uri="public.ecr.aws/deep-learning-containers/llama-cpp:server-sagemaker-cpu-v1",
            repository=None,
            bucket=artifacts.bucket,
            object_key="models/x/model.tar.gz",
            key=artifacts.key,
            environment={},
            placement=CpuPlacement(instance_type="ml.c6i.2xlarge", threads=8),
            initial_instance_count=1,
            startup_timeout_seconds=600,
            network=None,
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
