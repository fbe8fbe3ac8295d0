"""Every environment, every stack: the stack set, cdk-nag, cfn-lint, IAM, tags, removal.

The whole app (`-c env=all`, cdk-nag included) is synthesized once per test run with the
context from cdk.json, as the CLI would pass it (the `synth` fixture); each test reads it.
"""

from __future__ import annotations

import pytest

from stacks.environments import ENVIRONMENTS
from tests.cdk.support import ALL_STACKS, Synth, as_list, expected_stacks, resources, statements

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


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_every_environment_synthesizes_its_stacks(synth: Synth, env: str) -> None:
    names = {name for name in synth.templates if name.startswith(f"semif-{env}-")}
    assert names == expected_stacks(ENVIRONMENTS[env])


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_cdk_nag_has_no_findings(synth: Synth, stack: str) -> None:
    assert synth.violations.get(stack, []) == []


@pytest.mark.slow  # ~11 s: cfn-lint over all eleven templates
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


@pytest.mark.parametrize(("env", "policy"), [("dev", "Delete"), ("prod", "Retain")])
def test_data_removal_policy_follows_the_environment(synth: Synth, env: str, policy: str) -> None:
    artifact = synth.template(env, "artifact")
    for kind in ("AWS::S3::Bucket", "AWS::KMS::Key"):
        found = artifact.find_resources(kind)
        assert found
        for logical_id, resource in found.items():
            assert resource["DeletionPolicy"] == policy, logical_id
    images = synth.template(env, "images")
    images.resource_count_is("AWS::ECR::Repository", 1)
    images.has_resource(
        "AWS::ECR::Repository",
        {
            "DeletionPolicy": policy,
            "Properties": {"EmptyOnDelete": policy == "Delete"},
        },
    )
    artifact.resource_count_is("Custom::S3AutoDeleteObjects", 2 if policy == "Delete" else 0)


def test_dev_removes_every_log_group_on_destroy(synth: Synth) -> None:
    for name, template in synth.templates.items():
        for logical_id, log_group in resources(template, "AWS::Logs::LogGroup"):
            waiter = logical_id.startswith("DeployTimeBuildWaiter")
            expected = "Delete" if waiter or name.startswith("semif-dev-") else "Retain"
            if name.startswith(("semif-dev-", "semif-prod-")):
                assert log_group["DeletionPolicy"] == expected, (name, logical_id)
