"""Rules that keep a real deploy working: private ECR images only, no placeholder targets,
account/region resolution, rollout policy, NVMe instance storage, scoped permissions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import Aws, Fn
from aws_cdk import aws_sagemaker as sagemaker

import app as cdk_app
from cdk_constructs.container_image import (
    EcrImage,
    PrivateEcrImageRule,
    image_problem,
    render_image,
)
from cdk_constructs.endpoint_props import (
    CpuPlacement,
    NetworkSettings,
    Rollout,
    StepUnit,
    TrafficShift,
)
from cdk_constructs.validation import PropsError, looks_like_placeholder
from stacks.config import ConfigError
from stacks.environments import ENVIRONMENTS
from stacks.targets import resolve_target
from tests.support.templates import CDK_CONTEXT, Synth, resources, statements

DIGEST = "sha256:" + "ab" * 32
REAL_ACCOUNT = "498765432107"


# --- 1. SageMaker pulls only private ECR by digest --------------------------------------


def _model_with_image(image: str) -> cdk.App:
    app = cdk.App()
    stack = cdk.Stack(app, "Probe")
    sagemaker.CfnModel(
        stack,
        "Model",
        execution_role_arn="arn:aws:iam::498765432107:role/probe",
        primary_container=sagemaker.CfnModel.ContainerDefinitionProperty(image=image),
    )
    cdk.Aspects.of(app).add(PrivateEcrImageRule())
    return app


@pytest.mark.parametrize(
    "image",
    [
        "public.ecr.aws/deep-learning-containers/llama-cpp@" + DIGEST,
        "763104351884.dkr.ecr.us-east-1.amazonaws.com/llama-cpp:server-sagemaker-cpu-v1",
        "498765432107.dkr.ecr.us-east-1.amazonaws.com/repo:latest",
        "docker.io/library/python@" + DIGEST,
        "498765432107.dkr.ecr.us-east-1.amazonaws.com/repo@sha256:" + "0" * 63,
    ],
)
def test_rule_refuses_every_model_image_but_private_ecr_by_digest(image: str) -> None:
    with pytest.raises(RuntimeError, match="not a private Amazon ECR image pinned by digest"):
        _model_with_image(image).synth()


@pytest.mark.parametrize(
    "image",
    [
        "498765432107.dkr.ecr.us-east-1.amazonaws.com/semif-dev/llama-cpp-dlc@" + DIGEST,
        "498765432107.dkr.ecr.cn-north-1.amazonaws.com.cn/repo@" + DIGEST,
        EcrImage(repository_name="semif-dev/llama-cpp-dlc", digest=DIGEST).uri,
    ],
)
def test_rule_accepts_private_ecr_by_digest(image: str) -> None:
    _model_with_image(image).synth()


def test_rule_reads_tokens_by_what_they_resolve_to() -> None:
    built = {"Fn::GetAtt": ["ImageBuild", "IMAGE_DIGEST"]}
    imported = {"Fn::ImportValue": "semif-dev-images:Repository"}
    pseudo = [{"Ref": "AWS::AccountId"}, ".dkr.ecr.", {"Ref": "AWS::Region"}, "."]
    good = {"Fn::Join": ["", [*pseudo, {"Ref": "AWS::URLSuffix"}, "/", imported, "@", built]]}
    assert image_problem(good) is None
    # An imported whole URI, or an attribute that is not a verified digest, is refused.
    assert image_problem(imported) is not None
    other = {"Fn::GetAtt": ["ImageBuild", "IMAGE_URI"]}
    bad = {"Fn::Join": ["", [*pseudo, {"Ref": "AWS::URLSuffix"}, "/repo@", other]]}
    assert image_problem(bad) is not None
    assert render_image({"Fn::Sub": "x"}) == "<unsupported intrinsic>"


def test_ecr_image_checks_its_literal_parts() -> None:
    with pytest.raises(PropsError, match=r"image\.digest"):
        EcrImage(repository_name="repo", digest="latest")
    with pytest.raises(PropsError, match=r"image\.repository_name"):
        EcrImage(repository_name="Repo/With Spaces", digest=DIGEST)
    EcrImage(repository_name=Fn.import_value("x"), digest=Aws.NO_VALUE)  # tokens pass


@pytest.mark.parametrize("stack", ["standard", "decision"])
def test_every_model_in_the_app_pulls_private_ecr_by_digest(synth: Synth, stack: str) -> None:
    for name, template in synth.templates.items():
        if not name.endswith(stack):
            continue
        for _, model in resources(template, "AWS::SageMaker::Model"):
            assert image_problem(model["Properties"]["PrimaryContainer"]["Image"]) is None


def test_standard_role_pulls_exactly_the_mirror(synth: Synth) -> None:
    pulls = [
        s["Resource"]
        for _, s in statements(synth.raw("dev", "standard"))
        if "ecr:BatchGetImage" in s["Action"]
    ]
    assert len(pulls) == 1
    assert "repository/semif-dev/llama-cpp-dlc" in json.dumps(pulls[0])


# --- 2. your own account and region, no placeholders ------------------------------------


def test_shipped_environments_name_no_account_and_no_network() -> None:
    for config in ENVIRONMENTS.values():
        assert config.account is None
        assert config.network is None


def test_ci_synth_is_environment_agnostic(synth: Synth) -> None:
    for name, template in synth.templates.items():
        text = json.dumps(template)
        for placeholder in ("111111111111", "222222222222", "333333333333", "123456789012"):
            assert placeholder not in text, name
        assert "subnet-" not in text, name
        assert "sg-0" not in text, name


@pytest.mark.parametrize(
    ("context", "environ", "account", "region"),
    [
        ({}, {}, None, "us-east-1"),
        (
            {},
            {"CDK_DEFAULT_ACCOUNT": REAL_ACCOUNT, "CDK_DEFAULT_REGION": "eu-west-1"},
            REAL_ACCOUNT,
            "eu-west-1",
        ),
        (
            {"account": "498765432108", "region": "ap-southeast-2"},
            {"CDK_DEFAULT_ACCOUNT": REAL_ACCOUNT, "CDK_DEFAULT_REGION": "eu-west-1"},
            "498765432108",
            "ap-southeast-2",
        ),
    ],
)
def test_account_and_region_resolution_order(
    context: dict[str, str], environ: dict[str, str], account: str | None, region: str
) -> None:
    resolved = resolve_target(ENVIRONMENTS["dev"], context, environ)
    assert (resolved.account, resolved.region) == (account, region)


@pytest.mark.parametrize(
    ("context", "environ", "setting"),
    [
        ({"account": "111111111111"}, {}, "-c account"),
        ({"account": "123456789012"}, {}, "-c account"),
        ({}, {"CDK_DEFAULT_ACCOUNT": "000000000000"}, "CDK_DEFAULT_ACCOUNT"),
        ({"account": "12345"}, {}, "-c account"),
        ({"region": "useast1"}, {}, "-c region"),
        (
            {"subnet_ids": "subnet-0123456789abcdef0", "security_group_ids": "sg-1a2b3c4d"},
            {},
            "subnet_ids",
        ),
        ({"subnet_ids": "subnet-1a2b3c4d"}, {}, "go together"),
        ({"alarm_email": "not-an-address"}, {}, "alarm_email"),
    ],
)
def test_placeholders_and_bad_targets_are_refused_naming_the_setting(
    context: dict[str, str], environ: dict[str, str], setting: str
) -> None:
    with pytest.raises(ConfigError, match=setting):
        resolve_target(ENVIRONMENTS["dev"], context, environ)


def test_a_placeholder_account_in_the_config_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dev\.account: '111111111111' is a placeholder"):
        dataclasses.replace(ENVIRONMENTS["dev"], account="111111111111")


def test_network_and_email_from_context() -> None:
    resolved = resolve_target(
        ENVIRONMENTS["gpu"],
        {
            "subnet_ids": "subnet-1a2b3c4d,subnet-5e6f7a8b",
            "security_group_ids": "sg-9c8d7e6f",
            "vpc_id": "vpc-4f3e2d1c",
            "alarm_email": "oncall@example.com",
        },
        {},
    )
    assert resolved.network == NetworkSettings(
        subnet_ids=("subnet-1a2b3c4d", "subnet-5e6f7a8b"),
        security_group_ids=("sg-9c8d7e6f",),
        vpc_id="vpc-4f3e2d1c",
    )
    assert resolved.notifications.email == "oncall@example.com"


@pytest.mark.parametrize(
    ("value", "placeholder"),
    [
        ("111111111111", True),
        ("123456789012", True),
        ("0123456789abcdef0", True),
        ("0fedcba9876543210", True),
        ("00000000", True),
        ("498765432107", False),
        ("1a2b3c4d", False),
    ],
)
def test_placeholder_detection(value: str, placeholder: bool) -> None:
    assert looks_like_placeholder(value) is placeholder


def test_a_real_account_synthesizes_for_that_account(tmp_path: Path) -> None:
    app = cdk.App(outdir=str(tmp_path), context={**CDK_CONTEXT, "account": REAL_ACCOUNT})
    assembly = cdk_app.build_app(app, "dev", environ={}).synth()
    environments = {stack.environment.account for stack in assembly.stacks}
    assert environments == {REAL_ACCOUNT}


def _vpc_synth(tmp_path: Path) -> dict[str, Any]:
    app = cdk.App(
        outdir=str(tmp_path),
        context={
            **CDK_CONTEXT,
            "account": REAL_ACCOUNT,
            "subnet_ids": "subnet-1a2b3c4d,subnet-5e6f7a8b",
            "security_group_ids": "sg-9c8d7e6f",
            "vpc_id": "vpc-4f3e2d1c",
        },
    )
    assembly = cdk_app.build_app(app, "dev", environ={}).synth()  # cdk-nag included
    return {s.stack_name: s.template for s in assembly.stacks}


def test_vpc_models_and_scoped_eni_permissions(tmp_path: Path) -> None:
    templates = _vpc_synth(tmp_path)
    for unit in ("decision", "standard"):
        template = templates[f"semif-dev-{unit}"]
        models = list(resources(template, "AWS::SageMaker::Model"))
        assert len(models) == (2 if unit == "decision" else 1)  # dev: the async one too
        for _, model in models:
            assert model["Properties"]["VpcConfig"] == {
                "SecurityGroupIds": ["sg-9c8d7e6f"],
                "Subnets": ["subnet-1a2b3c4d", "subnet-5e6f7a8b"],
            }
        eni = [
            s
            for name, s in statements(template)
            if name.startswith(unit.capitalize()) and "ec2:DeleteNetworkInterface" in s["Action"]
        ]
        assert len(eni) == 1
        conditions = eni[0]["Condition"]["ArnEquals"]
        assert len(conditions["ec2:Subnet"]) == 2
        assert "vpc/vpc-4f3e2d1c" in json.dumps(conditions["ec2:Vpc"])
        assert "network-interface/*" in json.dumps(eni[0]["Resource"])


# --- 4. rollout policy ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"traffic": TrafficShift.CANARY}, "needs step"),
        ({"step": 1, "step_unit": StepUnit.INSTANCE_COUNT}, "takes no step"),
        ({"wait_interval_seconds": 3601}, "wait_interval_seconds"),
        ({"termination_wait_seconds": -1}, "termination_wait_seconds"),
        ({"maximum_execution_timeout_seconds": 599}, "maximum_execution_timeout_seconds"),
        (
            {"traffic": TrafficShift.LINEAR, "step": 5, "step_unit": StepUnit.CAPACITY_PERCENT},
            "outside 10..50",
        ),
        (
            {"traffic": TrafficShift.CANARY, "step": 60, "step_unit": StepUnit.CAPACITY_PERCENT},
            "outside 1..50",
        ),
    ],
)
def test_rollout_rules(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PropsError, match=message):
        Rollout(**kwargs)


def test_a_canary_must_fit_the_fewest_instances() -> None:
    canary = Rollout(traffic=TrafficShift.CANARY, step=1, step_unit=StepUnit.INSTANCE_COUNT)
    canary.check_capacity(2, "x")
    with pytest.raises(PropsError, match="100 % of 1"):
        canary.check_capacity(1, "x")
    dev = ENVIRONMENTS["dev"].decision
    with pytest.raises(ConfigError, match=r"decision\.rollout"):
        dataclasses.replace(dev, rollout=canary)


# --- 8. instance storage ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("instance_type", "storage"),
    [
        ("ml.c6i.2xlarge", False),
        ("ml.c6id.2xlarge", True),
        ("ml.m5d.large", True),
        ("ml.r5dn.xlarge", True),
        ("ml.g4dn.xlarge", True),
        ("ml.m5.large", False),
    ],
)
def test_nvme_instance_types_are_recognised(instance_type: str, storage: bool) -> None:
    assert CpuPlacement(instance_type=instance_type).has_instance_storage is storage


def test_nvme_cpu_type_gets_no_volume_key(tmp_path: Path) -> None:
    dev = ENVIRONMENTS["dev"]
    nvme = CpuPlacement(instance_type="ml.c6id.2xlarge")
    config = dataclasses.replace(dev, standard=dataclasses.replace(dev.standard, placement=nvme))
    from tests.support.templates import synthesize_environment

    assembly = synthesize_environment(config, tmp_path)
    template = assembly.get_stack_by_name("semif-dev-standard").template
    ((_, endpoint_config),) = resources(template, "AWS::SageMaker::EndpointConfig")
    assert "KmsKeyId" not in endpoint_config["Properties"]
