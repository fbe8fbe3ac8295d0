"""A candidate as the decision endpoint's shadow variant (`decision.candidate`): where it
appears in the template and where it must not, each side naming its variant, its own model
build and alarms, and the synth-time refusals, each naming its field."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from aws_cdk.assertions import Capture, Match, Template

from cdk_constructs.endpoint_props import CpuPlacement, ShadowVariant
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.model_build import model_object_key
from cdk_constructs.validation import PropsError
from stacks.config import CandidateSettings, ConfigError, DecisionEndpointSettings
from stacks.environments import ENVIRONMENTS
from tests.cdk.candidates import CPU_CANDIDATE, CPU_ENV, GPU_CANDIDATE, GPU_ENV
from tests.support.templates import realtime_endpoint, resources

CPU = f"semif-{CPU_ENV.name}"
GPU = f"semif-{GPU_ENV.name}"


def _template(templates: dict[str, Any], env: str, unit: str) -> dict[str, Any]:
    template: dict[str, Any] = templates[f"{env}-{unit}"]
    return template


def _realtime_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The endpoint config the real-time endpoint names."""
    _, endpoint = realtime_endpoint(raw)
    (config_id, _) = endpoint["Properties"]["EndpointConfigName"]["Fn::GetAtt"]
    config: dict[str, Any] = raw["Resources"][config_id]["Properties"]
    return config


def _variant_environments(raw: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The container environment of each variant of the real-time endpoint, by name."""
    config = _realtime_config(raw)
    return {
        variant["VariantName"]: raw["Resources"][variant["ModelName"]["Fn::GetAtt"][0]][
            "Properties"
        ]["PrimaryContainer"]["Environment"]
        for variant in config["ProductionVariants"] + config["ShadowProductionVariants"]
    }


@pytest.mark.parametrize("env", [CPU, GPU])
def test_the_candidate_is_only_a_shadow_and_each_side_names_its_variant(
    candidate_templates: dict[str, Any], env: str
) -> None:
    """SageMaker never returns a shadow variant's answer: the candidate's model appears
    under ShadowProductionVariants alone, and each container's SEMIF_VARIANT is the name
    of the variant that serves it."""
    raw = _template(candidate_templates, env, "decision")
    config = _realtime_config(raw)
    primary_model, shadow_model = Capture(), Capture()
    Template.from_json(raw).has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "ProductionVariants": [
                Match.object_like(
                    {
                        "VariantName": "AllTraffic",
                        "InitialVariantWeight": 1,
                        "ModelName": {"Fn::GetAtt": [primary_model, "ModelName"]},
                    }
                )
            ],
            "ShadowProductionVariants": [
                Match.object_like(
                    {
                        "VariantName": "Candidate",
                        "ModelName": {"Fn::GetAtt": [shadow_model, "ModelName"]},
                    }
                )
            ],
        },
    )
    assert primary_model.as_string() != shadow_model.as_string()
    assert len(config["ProductionVariants"]) == len(config["ShadowProductionVariants"]) == 1
    environments = _variant_environments(raw)
    assert set(environments) == {"AllTraffic", "Candidate"}
    for variant, environment in environments.items():
        assert environment["SEMIF_VARIANT"] == variant
        assert environment["SEMIF_AUDIT"] == "digest"  # both sides keep the records
    # Every other endpoint config of the stack (the asynchronous one) has no shadow.
    configs = [props["Properties"] for _, props in resources(raw, "AWS::SageMaker::EndpointConfig")]
    assert sum("ShadowProductionVariants" in each for each in configs) == 1


def test_the_cpu_candidate_samples_its_share_with_its_own_adapter_settings(
    candidate_templates: dict[str, Any],
) -> None:
    raw = _template(candidate_templates, CPU, "decision")
    (shadow,) = _realtime_config(raw)["ShadowProductionVariants"]
    assert shadow["InitialVariantWeight"] == CPU_CANDIDATE.sampling_percentage / 100
    assert shadow["InitialInstanceCount"] == 1
    assert shadow["InstanceType"] == "ml.c6i.2xlarge"  # the decision endpoint's placement
    environments = _variant_environments(raw)
    assert environments["Candidate"]["SEMIF_OPTION_ORDER"] == "debiased"
    assert "SEMIF_OPTION_ORDER" not in environments["AllTraffic"]
    rest = {k: v for k, v in environments["Candidate"].items() if k != "SEMIF_OPTION_ORDER"}
    assert rest == {**environments["AllTraffic"], "SEMIF_VARIANT": "Candidate"}


def test_the_gpu_candidate_keeps_its_own_pools_and_count(
    candidate_templates: dict[str, Any],
) -> None:
    raw = _template(candidate_templates, GPU, "decision")
    (shadow,) = _realtime_config(raw)["ShadowProductionVariants"]
    assert shadow["InitialInstanceCount"] == 2
    assert shadow["InitialVariantWeight"] == 1
    assert [pool["InstanceType"] for pool in shadow["InstancePools"]] == [
        "ml.g6e.xlarge",
        "ml.g5.2xlarge",
    ]
    assert "InstanceType" not in shadow


def test_the_candidate_model_is_built_and_resolved_like_the_primary(
    candidate_templates: dict[str, Any],
) -> None:
    """Its own model build, source (with its calibration file) and object, read by the
    decision role; outputs prefixed Candidate."""
    artifact = Template.from_json(_template(candidate_templates, CPU, "artifact"))
    model = CPU_CANDIDATE.model
    key = model_object_key(model.sha256, model.build_calibration, model.build_chat_template)
    artifact.resource_count_is("AWS::CodeBuild::Project", 2)
    artifact.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Environment": Match.object_like(
                {
                    "EnvironmentVariables": Match.array_with(
                        [
                            {
                                "Name": "MODEL_DEST_URI",
                                "Type": "PLAINTEXT",
                                "Value": Match.object_like(
                                    {"Fn::Join": ["", Match.array_with([f"/{key}"])]}
                                ),
                            }
                        ]
                    )
                }
            )
        },
    )
    outputs = _template(candidate_templates, CPU, "artifact")["Outputs"]
    assert {"ModelS3Uri", "CandidateModelS3Uri", "CandidateModelBuildId"} <= set(outputs)
    raw = _template(candidate_templates, CPU, "decision")
    (shadow,) = _realtime_config(raw)["ShadowProductionVariants"]
    shadow_model = raw["Resources"][shadow["ModelName"]["Fn::GetAtt"][0]]["Properties"]
    assert shadow_model["PrimaryContainer"]["ModelDataUrl"]["Fn::Join"][1][-1] == f"/{key}"
    reads = [
        statement["Resource"]
        for _, policy in resources(raw, "AWS::IAM::Policy")
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]
        if statement["Action"] == "s3:GetObject"
    ]
    assert any(f"/{key}" in str(resource) for resource in reads)


def test_a_candidate_of_the_same_object_reuses_the_primary_build(
    candidate_templates: dict[str, Any],
) -> None:
    """gpu's candidate serves gpu's own model with other settings: one build, one object."""
    artifact = Template.from_json(_template(candidate_templates, GPU, "artifact"))
    artifact.resource_count_is("AWS::CodeBuild::Project", 1)
    assert "CandidateModelS3Uri" not in _template(candidate_templates, GPU, "artifact")["Outputs"]
    raw = _template(candidate_templates, GPU, "decision")
    urls = {
        str(props["Properties"]["PrimaryContainer"]["ModelDataUrl"])
        for _, props in resources(raw, "AWS::SageMaker::Model")
    }
    assert len(urls) == 1
    environments = _variant_environments(raw)
    assert environments["Candidate"]["SEMIF_READOUT"] == GPU_CANDIDATE.readout
    assert "SEMIF_READOUT" not in environments["AllTraffic"]


@pytest.mark.parametrize("env", [CPU, GPU])
def test_the_candidate_has_its_own_alarms_and_never_rolls_back_the_primary(
    candidate_templates: dict[str, Any], env: str
) -> None:
    raw = _template(candidate_templates, env, "decision")
    template = Template.from_json(raw)
    candidate = {
        name
        for name, alarm in resources(raw, "AWS::CloudWatch::Alarm")
        if {"Name": "VariantName", "Value": "Candidate"}
        in [
            dimension
            for metric in alarm["Properties"].get("Metrics", [alarm["Properties"]])
            for dimension in (
                metric.get("MetricStat", {}).get("Metric", {}).get("Dimensions", [])
                or metric.get("Dimensions", [])
            )
        ]
    }
    # 5XX rate, memory, disk, GPU memory and latency, variant-wide and per pool type.
    pools = 2 if env == GPU else 0
    per_set = 5 if env == GPU else 4
    assert len(candidate) == per_set * (1 + pools)
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "ModelLatency",
            "Namespace": "AWS/SageMaker",
            "ExtendedStatistic": "p90",
            "Threshold": ENVIRONMENTS["dev"].decision.request_timeout_seconds / 2 * 1_000_000,
            "Dimensions": Match.array_with([{"Name": "VariantName", "Value": "Candidate"}]),
        },
    )
    _, endpoint = realtime_endpoint(raw)
    rollback = endpoint["Properties"]["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]
    named = {alarm["AlarmName"]["Ref"] for alarm in rollback}
    assert named
    assert not named & candidate
    # Scaling targets the production variant only.
    targets = [
        props["Properties"]["ResourceId"]
        for _, props in resources(raw, "AWS::ApplicationAutoScaling::ScalableTarget")
    ]
    assert all(str(target).endswith("/variant/AllTraffic") for target in targets), targets
    # The container-metric (PromQL) alarms read the primary's series only: every metric they
    # select leaves the candidate's instances out (their series carry variant="Candidate").
    queries = [
        alarm["Properties"]["EvaluationCriteria"]["PromQLCriteria"]["Query"]
        for _, alarm in resources(raw, "AWS::CloudWatch::Alarm")
        if "EvaluationCriteria" in alarm["Properties"]
    ]
    assert queries
    for query in queries:
        assert query.count('variant=~"AllTraffic|"') == query.count("semif_"), query


def test_a_shipped_environment_shadows_nothing() -> None:
    assert all(env.decision.candidate is None for env in ENVIRONMENTS.values())


# --- refusals -------------------------------------------------------------------------


def _with(candidate: CandidateSettings | None = CPU_CANDIDATE, **decision: Any) -> None:
    """dev's decision settings with `candidate` and `decision` changes (digests recorded;
    on instances of its own, since a shadow and scale to zero exclude each other)."""
    replace(
        ENVIRONMENTS["dev"].decision,
        **{"audit": "digest", "candidate": candidate, "scale_to_zero": None, **decision},
    )


@pytest.mark.parametrize("percentage", [0, 101, -5])
def test_sampling_percentage_is_refused_outside_1_to_100(percentage: int) -> None:
    with pytest.raises(ConfigError, match=r"^decision\.candidate\.sampling_percentage: "):
        replace(CPU_CANDIDATE, sampling_percentage=percentage)


def test_instance_count_below_one_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^decision\.candidate\.instance_count: 0"):
        replace(CPU_CANDIDATE, instance_count=0)


def test_a_candidate_without_audit_records_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^decision\.audit: 'none' with decision\.candidate"):
        _with(audit="none")


def test_a_candidate_on_another_kind_of_placement_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^decision\.candidate\.placement: a GpuPlacement"):
        _with(candidate=replace(CPU_CANDIDATE, placement=GPU_CANDIDATE.placement))


def test_a_canary_must_fit_the_candidate_instances() -> None:
    """prod canaries one instance: half of two candidate instances fits, one does not."""
    prod = ENVIRONMENTS["prod"].decision
    replace(prod, audit="digest", candidate=replace(CPU_CANDIDATE, instance_count=2))
    with pytest.raises(ConfigError, match=r"^decision\.candidate\.instance_count: a CANARY"):
        replace(prod, audit="digest", candidate=CPU_CANDIDATE)


def test_the_adapter_refuses_a_candidate_setting_at_synth() -> None:
    bad = replace(CPU_CANDIDATE, option_order="sideways")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^decision\.candidate: SEMIF_OPTION_ORDER='sideways'"):
        _with(candidate=bad)


def test_a_kv_budget_is_checked_against_the_candidate_instance() -> None:
    small = replace(CPU_CANDIDATE, placement=CpuPlacement(instance_type="ml.c6i.large"))
    _with(kv_memory="6GiB")  # half of the decision endpoint's 16 GiB c6i.2xlarge
    with pytest.raises(ConfigError, match=r"^decision\.kv_memory: 6GiB .*ml\.c6i\.large"):
        _with(candidate=small, kv_memory="6GiB")


def test_the_candidate_environment_needs_a_candidate() -> None:
    settings: DecisionEndpointSettings = ENVIRONMENTS["dev"].decision
    with pytest.raises(ConfigError, match=r"^decision\.candidate: not set"):
        settings.candidate_container_environment()


def test_a_shadow_variant_needs_its_own_name_and_a_valid_share() -> None:
    stack = cdk.Stack()
    shadow = ShadowVariant(
        variant_name="Candidate",
        model=ModelArtifact(
            bucket=s3.Bucket.from_bucket_name(stack, "Bucket", "semif-artifacts"),
            key=kms.Key.from_key_arn(
                stack, "Key", "arn:aws:kms:us-east-1:498765432107:key/0a1b2c3d-4e5f"
            ),
            object_key="models/candidate/model.tar.gz",
        ),
        environment={},
        placement=CpuPlacement(instance_type="ml.c6i.2xlarge"),
        instance_count=1,
        sampling_percentage=50,
    )
    assert shadow.weight == 0.5
    changes: list[dict[str, Any]] = [
        {"variant_name": "not_a_name"},
        {"sampling_percentage": 0},
        {"instance_count": 0},
    ]
    for change in changes:
        with pytest.raises(PropsError, match=rf"^shadow\.{next(iter(change))}: "):
            replace(shadow, **change)
