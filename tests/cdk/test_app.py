"""Every environment, every stack: the stack set, cdk-nag, cfn-lint, IAM, tags, removal.

The whole app (`-c env=all`, cdk-nag included) is synthesized once per test run with the
context from cdk.json, as the CLI would pass it (the `synth` fixture); each test reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Match

from stacks.environments import ENVIRONMENTS
from tests.cdk.candidates import CPU_ENV, GPU_ENV
from tests.support.templates import (
    ALL_STACKS,
    REPO,
    Synth,
    as_list,
    expected_stacks,
    resources,
    statements,
)

# Actions that AWS does not scope by resource; every other statement must name ARNs.
UNSCOPED_ACTIONS = {
    "ecr:GetAuthorizationToken",
    # SageMaker's instance metrics; limited to its namespace by condition.
    "cloudwatch:PutMetricData",
    # The post-deploy check's series lookup (what CloudWatch's PromQL GetSeries authorizes
    # as); the service authorization reference lists no resource type for it.
    "cloudwatch:ListMetrics",
    # The DLC mirror's authenticated ECR Public pull (login tokens only).
    "ecr-public:GetAuthorizationToken",
    "sts:GetServiceBearerToken",
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
# W6001 (an output whose value is an import) only for these decision-stack outputs: they
# repeat the artifact bucket's batch and async prefixes and its key, so `semif batch` reads
# the one stack it runs against.
OUTPUTS_OF_IMPORTS = {
    "BatchInputPrefix",
    "BatchOutputPrefix",
    "ArtifactKeyArn",
    "AsyncInputPrefix",
    "AsyncOutputPrefix",
    "AsyncFailurePrefix",
}


def _allowed(rule: str, path: list[object]) -> bool:
    if rule in CFN_LINT_IGNORED:
        return True
    return rule == "W6001" and path[:1] == ["Outputs"] and path[1] in OUTPUTS_OF_IMPORTS


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_every_environment_synthesizes_its_stacks(synth: Synth, env: str) -> None:
    names = {name for name in synth.templates if name.startswith(f"semif-{env}-")}
    assert names == expected_stacks(ENVIRONMENTS[env])


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_cdk_nag_has_no_findings(synth: Synth, stack: str) -> None:
    assert synth.violations.get(stack, []) == []


def lint_problems(name: str, template: str, region: str) -> list[str]:
    """cfn-lint's errors and warnings, as its CLI reports by default, less the allowed."""
    from cfnlint.api import lint

    return [
        f"{name}: {match.rule.id} {match.message}"
        for match in lint(template, regions=[region])
        if match.rule.id[0] in "EW" and not _allowed(match.rule.id, list(match.path))
    ]


@pytest.mark.slow  # ~11 s: cfn-lint over all eleven templates
def test_cfn_lint_passes_on_every_template(synth: Synth) -> None:
    problems = []
    for name in synth.templates:
        region = ENVIRONMENTS[name.split("-")[1]].region
        path = synth.outdir / f"{name}.template.json"
        problems += lint_problems(name, path.read_text(), region)
    assert problems == []


@pytest.mark.slow  # a few seconds: the stacks a candidate changes
def test_cfn_lint_passes_with_a_candidate(candidate_templates: dict[str, Any]) -> None:
    """The artifact and decision stacks of the environments with a candidate (the shadow
    variant, its model build and alarms)."""
    problems = []
    for config in (CPU_ENV, GPU_ENV):
        for unit in ("artifact", "decision"):
            name = f"semif-{config.name}-{unit}"
            problems += lint_problems(name, json.dumps(candidate_templates[name]), config.region)
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


@pytest.mark.parametrize(("env", "policy"), [("dev", "Delete"), ("prod", "Retain")])
def test_data_removal_policy_follows_the_environment(synth: Synth, env: str, policy: str) -> None:
    artifact = synth.template(env, "artifact")
    for kind in ("AWS::S3::Bucket", "AWS::KMS::Key"):
        found = artifact.find_resources(kind)
        assert found
        for logical_id, resource in found.items():
            assert resource["DeletionPolicy"] == policy, logical_id
    images = synth.template(env, "images")
    images.resource_count_is("AWS::ECR::Repository", 2)
    images.has_resource(  # the adapter repository: images an endpoint may roll back to
        "AWS::ECR::Repository",
        {
            "DeletionPolicy": policy,
            "Properties": {"EmptyOnDelete": policy == "Delete", "RepositoryName": Match.absent()},
        },
    )
    images.has_resource(  # the DLC mirror: a fixed name, so never retained
        "AWS::ECR::Repository",
        {
            "DeletionPolicy": "Delete",
            "Properties": {"EmptyOnDelete": True, "RepositoryName": f"semif-{env}/llama-cpp-dlc"},
        },
    )
    artifact.resource_count_is("Custom::S3AutoDeleteObjects", 2 if policy == "Delete" else 0)


def test_log_groups_follow_the_environment_except_fixed_names(synth: Synth) -> None:
    """Build logs follow retain_data; machinery logs and the endpoint log groups (the fixed
    name SageMaker writes to) are removed with the stack everywhere."""
    for name, template in synth.templates.items():
        config = ENVIRONMENTS[name.split("-")[1]]
        for logical_id, log_group in resources(template, "AWS::Logs::LogGroup"):
            machinery = logical_id.startswith(("DeployTimeBuildWaiter", "Check", "DlcMirror"))
            fixed = "LogGroupName" in log_group["Properties"]
            retained = config.retain_data and not machinery and not fixed
            expected = "Retain" if retained else "Delete"
            assert log_group["DeletionPolicy"] == expected, (name, logical_id)


# Properties that give a resource a fixed physical name. Such a resource must never be
# retained: `cdk destroy` would leave it and the next deploy would fail with "already exists".
PHYSICAL_NAME_PROPERTIES = {
    "AWS::Logs::LogGroup": "LogGroupName",
    "AWS::ECR::Repository": "RepositoryName",
    "AWS::S3::Bucket": "BucketName",
    "AWS::SNS::Topic": "TopicName",
    "AWS::KMS::Alias": "AliasName",
    "AWS::IAM::Role": "RoleName",
    "AWS::Lambda::Function": "FunctionName",
    "AWS::CodeBuild::Project": "Name",
    "AWS::SageMaker::Endpoint": "EndpointName",
    "AWS::SageMaker::Model": "ModelName",
    "AWS::SageMaker::EndpointConfig": "EndpointConfigName",
    "AWS::CloudWatch::Alarm": "AlarmName",
}


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_no_resource_with_a_fixed_name_is_retained(synth: Synth, stack: str) -> None:
    for logical_id, resource in synth.templates[stack]["Resources"].items():
        name_property = PHYSICAL_NAME_PROPERTIES.get(resource["Type"])
        if name_property and name_property in resource.get("Properties", {}):
            for policy in ("DeletionPolicy", "UpdateReplacePolicy"):
                assert resource.get(policy, "Delete") == "Delete", (logical_id, policy)


def test_fixed_names_are_unique_per_environment(synth: Synth) -> None:
    """Two environments in one account and region must not collide on a fixed name."""
    seen: dict[tuple[str, str], str] = {}
    for stack, template in synth.templates.items():
        for logical_id, resource in template["Resources"].items():
            name_property = PHYSICAL_NAME_PROPERTIES.get(resource["Type"])
            value = resource.get("Properties", {}).get(name_property or "")
            if isinstance(value, str):
                key = (resource["Type"], value)
                assert key not in seen, (stack, logical_id, seen.get(key))
                seen[key] = f"{stack}/{logical_id}"


def test_a_refused_setting_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    context = {"env": "dev", "account": "111111111111", "region": "us-east-1"}
    done = subprocess.run(
        [sys.executable, "app.py"],
        cwd=REPO,
        env={**os.environ, "CDK_CONTEXT_JSON": json.dumps(context), "CDK_OUTDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if "!!" not in line and line.strip()]
    assert errors[-1].startswith("app.py: -c account: '111111111111' is a placeholder")
    assert "Traceback" not in done.stderr
