"""dev's decision endpoint on an inference component that scales to zero (issue 41): the
component and its copy's resources, the variant that names no model and whose instances
SageMaker manages from none, the copies' scalable target with its target tracking, its
stop when idle and its wake-up on NoCapacityInvocationFailures, the alarms and dashboard
that know copies, the rolling updates with the rollback alarms, each checked against
botocore's SageMaker and Application Auto Scaling models; and what synth refuses. Then the
same on GPU instance pools, in an environment built here (the shipped gpu one stays off):
the pools kept, one Specification sized to the smallest pool type with a GPU, the alarms
per pool type on the component's metrics, cdk-nag and cfn-lint."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import botocore.loaders
import pytest
from aws_cdk.assertions import Capture, Match, Template

from cdk_constructs.endpoint_operations import ScaleToZero, wake_minutes
from cdk_constructs.endpoint_probe import handler
from cdk_constructs.endpoint_props import (
    CpuPlacement,
    GpuPlacement,
    Rollout,
    StepUnit,
    TrafficShift,
)
from cdk_constructs.validation import PropsError
from stacks.config import ConfigError, CopyRoom, ModelSource, copy_room
from stacks.environments import CUDA13_AMI, ENVIRONMENTS, SMOLLM2_135M
from tests.cdk.candidates import synthesize_checked
from tests.cdk.test_app import lint_problems
from tests.cdk.test_sagemaker_api import api_problems, check
from tests.support.templates import Synth, dashboard_body, resources

NAME = "semif-dev-decision"
COMPONENT = f"{NAME}-model"
DEV = ENVIRONMENTS["dev"]
_SCALING_MODEL = botocore.loaders.Loader().load_service_model(
    "application-autoscaling", "service-2"
)
# Its string patterns write characters past U+FFFF as Java's UTF-16 surrogate pairs; Python's
# `regex` takes the code points.
_SURROGATES = "\\uD800\\uDC00-\\uDBFF\\uDFFF"
SCALING_SHAPES = {
    name: {**shape, "pattern": shape["pattern"].replace(_SURROGATES, "\\U00010000-\\U0010FFFF")}
    if "pattern" in shape
    else shape
    for name, shape in _SCALING_MODEL["shapes"].items()
}


def policy_target(component: str) -> dict[str, str]:
    """What the scaling resources' intrinsics stand for, for `component`."""
    return {
        "ServiceNamespace": "sagemaker",
        "ResourceId": f"inference-component/{component}",
        "ScalableDimension": "sagemaker:inference-component:DesiredCopyCount",
    }


POLICY_TARGET = policy_target(COMPONENT)


@pytest.fixture(scope="module")
def template(synth: Synth) -> Template:
    return synth.template("dev", "decision")


def test_only_dev_scales_to_zero(synth: Synth) -> None:
    assert DEV.decision.scale_to_zero == ScaleToZero(idle_minutes=10)
    for env in ("prod", "gpu"):
        assert ENVIRONMENTS[env].decision.scale_to_zero is None
        assert not list(resources(synth.raw(env, "decision"), "AWS::SageMaker::InferenceComponent"))


def test_the_model_is_an_inference_component_of_one_copy_per_instance(
    template: Template,
) -> None:
    model = Capture()
    alarms = Capture()
    template.has_resource_properties(
        "AWS::SageMaker::InferenceComponent",
        {
            "InferenceComponentName": COMPONENT,
            "EndpointName": {
                "Fn::GetAtt": [Match.string_like_regexp("^DecisionEndpoint"), "EndpointName"]
            },
            "VariantName": "AllTraffic",
            "Specification": {
                "ModelName": {"Fn::GetAtt": [model, "ModelName"]},
                "StartupParameters": {
                    "ModelDataDownloadTimeoutInSeconds": 600,
                    "ContainerStartupHealthCheckTimeoutInSeconds": 600,
                },
                # ml.c6i.2xlarge: 8 threads, three quarters of its 16 GiB.
                "ComputeResourceRequirements": {
                    "NumberOfCpuCoresRequired": 8,
                    "MinMemoryRequiredInMb": 12288,
                },
            },
            "RuntimeConfig": {"CopyCount": 1},
            "DeploymentConfig": {
                "RollingUpdatePolicy": {
                    "MaximumBatchSize": {"Type": "COPY_COUNT", "Value": 1},
                    "WaitIntervalInSeconds": 600,
                },
                "AutoRollbackConfiguration": {"Alarms": alarms},
            },
        },
    )
    assert model.as_string().startswith("DecisionModel")
    # The 5XX rate (the component's), ScoringSpeed and LetterMass: the endpoint's logic.
    assert len(alarms.as_array()) == 3


def test_the_variant_names_no_model_and_scales_its_instances_from_zero(
    template: Template, synth: Synth
) -> None:
    template.has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "ProductionVariants": [
                {
                    "VariantName": "AllTraffic",
                    "InstanceType": "ml.c6i.2xlarge",
                    "InitialInstanceCount": 1,
                    "ManagedInstanceScaling": {
                        "Status": "ENABLED",
                        "MinInstanceCount": 0,
                        "MaxInstanceCount": 2,
                    },
                    "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
                    "ModelName": Match.absent(),
                    "ContainerStartupHealthCheckTimeoutInSeconds": Match.absent(),
                }
            ],
            "ExecutionRoleArn": {
                "Fn::GetAtt": [Match.string_like_regexp("^DecisionExecutionRole"), "Arn"]
            },
            "EnableNetworkIsolation": True,
        },
    )
    ((_, endpoint),) = [
        e
        for e in resources(synth.raw("dev", "decision"), "AWS::SageMaker::Endpoint")
        if e[1]["Properties"]["EndpointName"] == NAME
    ]
    assert "DeploymentConfig" not in endpoint["Properties"]  # the component's instead


def test_copies_scale_between_zero_and_the_upper_bound_on_concurrency_per_copy(
    template: Template,
) -> None:
    target = Capture()
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalableTarget",
        {**POLICY_TARGET, "MinCapacity": 0, "MaxCapacity": 2, "RoleARN": Match.absent()},
    )
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "PolicyType": "TargetTrackingScaling",
            "ScalingTargetId": {"Ref": target},
            "TargetTrackingScalingPolicyConfiguration": {
                "PredefinedMetricSpecification": {
                    "PredefinedMetricType": (
                        "SageMakerInferenceComponentConcurrentRequestsPerCopyHighResolution"
                    )
                },
                "TargetValue": DEV.decision.target_concurrency,
                "ScaleInCooldown": 300,
                "ScaleOutCooldown": 60,
            },
        },
    )
    assert target.as_string().startswith("ScalingTarget")


def _alarm_on(template: Template, policy_id: Capture, props: dict[str, Any]) -> None:
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm", {**props, "AlarmActions": [{"Ref": policy_id}]}
    )


def test_a_refused_call_wakes_one_copy(template: Template) -> None:
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "PolicyName": Match.string_like_regexp("FromZero"),
            "PolicyType": "StepScaling",
            "StepScalingPolicyConfiguration": {
                "AdjustmentType": "ChangeInCapacity",
                "MetricAggregationType": "Maximum",
                "Cooldown": 600,  # the copy's start-up timeout
                "StepAdjustments": [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}],
            },
        },
    )
    wake = Capture()
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "PolicyName": Match.string_like_regexp("^semifdevdecisionScalingFromZero"),
            "ScalingTargetId": Match.any_value(),
        },
    )
    _alarm_on(
        template,
        wake,
        {
            "Namespace": "AWS/SageMaker",
            "MetricName": "NoCapacityInvocationFailures",
            "Dimensions": [{"Name": "InferenceComponentName", "Value": COMPONENT}],
            "Statistic": "Sum",
            "Period": 60,
            "EvaluationPeriods": 1,
            "Threshold": 1,
            "ComparisonOperator": "GreaterThanOrEqualToThreshold",
        },
    )
    assert wake.as_string().startswith("ScalingFromZero")


def test_an_idle_spell_stops_every_copy(template: Template) -> None:
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "PolicyName": Match.string_like_regexp("ToZero"),
            "StepScalingPolicyConfiguration": {
                "AdjustmentType": "ExactCapacity",
                "MetricAggregationType": "Maximum",
                "Cooldown": 600,
                "StepAdjustments": [{"MetricIntervalUpperBound": 0, "ScalingAdjustment": 0}],
            },
        },
    )
    metrics = Capture()
    idle = Capture()
    _alarm_on(
        template,
        idle,
        {
            "Metrics": metrics,
            "EvaluationPeriods": 10,
            "DatapointsToAlarm": 10,
            "Threshold": 0,
            "ComparisonOperator": "LessThanOrEqualToThreshold",
            "TreatMissingData": "breaching",
        },
    )
    assert idle.as_string().startswith("ScalingToZero")
    read = {
        m["MetricStat"]["Metric"]["MetricName"]: m["MetricStat"]["Metric"]["Dimensions"]
        for m in metrics.as_array()
        if "MetricStat" in m
    }
    # A wake-up in progress (refused calls) is never taken for idleness.
    by_component = [{"Name": "InferenceComponentName", "Value": COMPONENT}]
    assert read == {"Invocations": by_component, "NoCapacityInvocationFailures": by_component}


def test_a_wake_up_that_does_not_come_pages(template: Template, synth: Synth) -> None:
    minutes = wake_minutes(600)
    assert minutes == 16  # the alarm, an instance's start, the copy's 10 minutes
    topic = {"Fn::ImportValue": Match.string_like_regexp(r"^semif-dev-artifact:.*Alarms")}
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "NoCapacityInvocationFailures",
            "EvaluationPeriods": minutes,
            "DatapointsToAlarm": minutes,
            "AlarmActions": [topic],
            "OKActions": [topic],
        },
    )


def test_the_client_finds_the_component_in_an_output(synth: Synth) -> None:
    outputs = synth.raw("dev", "decision")["Outputs"]
    assert outputs["DecisionInferenceComponentName"]["Value"] == COMPONENT
    assert "DecisionInferenceComponentName" not in synth.raw("prod", "decision")["Outputs"]


def _scaling_calls(raw: dict[str, Any], component: str) -> list[tuple[str, dict[str, Any]]]:
    """RegisterScalableTarget and PutScalingPolicy requests of `component`'s scaling."""
    target_of = policy_target(component)
    calls: list[tuple[str, dict[str, Any]]] = []
    targets = dict(resources(raw, "AWS::ApplicationAutoScaling::ScalableTarget"))
    for target in targets.values():
        if target["Properties"]["ResourceId"] == target_of["ResourceId"]:
            props = dict(target["Properties"])
            # CloudFormation lists tags; the API takes them as a map.
            props["Tags"] = {tag["Key"]: tag["Value"] for tag in props.get("Tags", [])}
            calls.append(("RegisterScalableTargetRequest", props))
    for _, policy in resources(raw, "AWS::ApplicationAutoScaling::ScalingPolicy"):
        props = dict(policy["Properties"])
        target_id = props.pop("ScalingTargetId")["Ref"]
        if targets[target_id]["Properties"]["ResourceId"] == target_of["ResourceId"]:
            calls.append(("PutScalingPolicyRequest", {**props, **target_of}))
    return calls


def _scaling_problems(raw: dict[str, Any], component: str) -> list[str]:
    """The component's target and its three policies, against Application Auto Scaling."""
    calls = _scaling_calls(raw, component)
    assert sorted(shape for shape, _ in calls) == [
        "PutScalingPolicyRequest",
        "PutScalingPolicyRequest",
        "PutScalingPolicyRequest",
        "RegisterScalableTargetRequest",
    ]
    return [
        problem
        for shape, request in calls
        for problem in check(request, shape, shape, SCALING_SHAPES)
    ]


def test_scaling_matches_the_application_auto_scaling_api(synth: Synth) -> None:
    assert _scaling_problems(synth.raw("dev", "decision"), COMPONENT) == []


# --- what synth refuses, naming the field ---------------------------------------------


def _decision(**changes: Any) -> None:
    replace(DEV.decision, **changes)


def test_a_traffic_shifting_rollout_is_refused() -> None:
    canary = Rollout(
        traffic=TrafficShift.CANARY,
        step_unit=StepUnit.INSTANCE_COUNT,
        step=1,
        wait_interval_seconds=600,
    )
    with pytest.raises(
        ConfigError, match=r"^decision\.rollout: CANARY with decision\.scale_to_zero"
    ):
        _decision(rollout=canary, autoscaling=replace(DEV.decision.autoscaling, min_capacity=2))


def test_more_threads_than_vcpus_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^decision\.threads: 16 with decision\.scale_to_zero"):
        _decision(threads=16)


def test_an_instance_of_unknown_memory_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^decision\.scale_to_zero: ml\.g5\.2xlarge's memory"):
        _decision(placement=CpuPlacement(instance_type="ml.g5.2xlarge"))


@pytest.mark.parametrize("minutes", [0, 16])
def test_an_idle_period_outside_1_to_15_minutes_is_refused(minutes: int) -> None:
    with pytest.raises(PropsError, match=r"^scale_to_zero\.idle_minutes: "):
        ScaleToZero(idle_minutes=minutes)


def test_the_model_size_is_required() -> None:
    unsized = replace(SMOLLM2_135M, size_bytes=None)
    with pytest.raises(ConfigError, match=r"^model\.size_bytes: required"):
        replace(DEV, model=unsized)


def test_a_copy_too_small_for_the_weights_and_kv_cache_is_refused() -> None:
    big = ModelSource(uri=SMOLLM2_135M.uri, sha256=SMOLLM2_135M.sha256, size_bytes=2_740_000_000)
    small = replace(DEV.decision, placement=CpuPlacement(instance_type="ml.c6i.large"), threads=2)
    with pytest.raises(
        ConfigError, match=r"^decision\.scale_to_zero: a copy asks 3072 MiB, less than the \d+ MiB"
    ):
        replace(DEV, model=big, decision=small)


# --- the post-deploy check through the component ---------------------------------------


class _Runtime:
    """Refuses for lack of capacity `refusals` times, then answers `answer`."""

    def __init__(self, refusals: int, answer: bytes) -> None:
        self.refusals = refusals
        self.answer = answer
        self.calls: list[dict[str, Any]] = []

    def invoke_endpoint(self, **request: Any) -> dict[str, Any]:
        from io import BytesIO

        from botocore.exceptions import ClientError

        self.calls.append(request)
        if len(self.calls) <= self.refusals:
            message = "Inference Component has no capacity to process this request."
            raise ClientError(
                {"Error": {"Code": "ValidationError", "Message": message}}, "InvokeEndpoint"
            )
        return {"Body": BytesIO(self.answer)}


def test_the_check_invokes_the_component_and_waits_out_a_wake_up() -> None:
    import json

    body = {"decision": {"id": "d", "options": [{"id": "yes"}, {"id": "no"}]}}
    result = {"result": {"id": "d", "option_ids": ["yes", "no"], "probabilities": [0.7, 0.3]}}
    runtime = _Runtime(2, json.dumps(result).encode())
    summary = handler.probe(
        runtime, NAME, "decision", body, lambda: 600.0, lambda _: None, component=COMPONENT
    )
    assert summary.startswith("decision yes=0.700")
    assert [call["InferenceComponentName"] for call in runtime.calls] == [COMPONENT] * 3
    # Without a component the same refusal is no wake-up: it fails the check.
    with pytest.raises(handler.CheckFailedError, match="ValidationError"):
        handler.probe(_Runtime(1, b"{}"), NAME, "decision", body, lambda: 600.0, lambda _: None)


# --- on GPU instance pools: an environment built here, the shipped gpu one stays off ----

GPU = ENVIRONMENTS["gpu"]
# About the size of Qwen3.5-4B Q4_K_M's GGUF (the gpu environment's model names none).
QWEN35_4B_BYTES = 2_740_000_000
GPU_ZERO_ENV = replace(
    GPU,
    name="gpu-zero",
    model=replace(GPU.model, size_bytes=QWEN35_4B_BYTES),
    decision=replace(GPU.decision, scale_to_zero=ScaleToZero(idle_minutes=10)),
)
GPU_STACK = "semif-gpu-zero-decision"
GPU_COMPONENT = f"{GPU_STACK}-model"
POOLS = GPU.decision.instance_pools


def _on_pools(*instance_types: str) -> GpuPlacement:
    """The gpu environment's placement on `instance_types`."""
    placement = GPU.decision.placement
    assert isinstance(placement, GpuPlacement)
    return replace(placement, instance_pools=instance_types)


@pytest.fixture(scope="module")
def gpu_zero(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """GPU_ZERO_ENV's templates by stack name; a cdk-nag finding fails this synth."""
    return synthesize_checked((GPU_ZERO_ENV,), tmp_path_factory.mktemp("cdk.out.gpu-zero"))


def test_gpu_pools_with_scale_to_zero_pass_cdk_nag(gpu_zero: dict[str, Any]) -> None:
    units = ("artifact", "images", "decision", "standard")
    assert set(gpu_zero) == {f"semif-gpu-zero-{unit}" for unit in units}


def test_the_variant_keeps_its_pools_and_scales_their_instances_from_zero(
    gpu_zero: dict[str, Any],
) -> None:
    Template.from_json(gpu_zero[GPU_STACK]).has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "ProductionVariants": [
                {
                    "VariantName": "AllTraffic",
                    "InstanceType": Match.absent(),
                    "InstancePools": [
                        {"InstanceType": instance_type, "Priority": priority}
                        for priority, instance_type in enumerate(POOLS, start=1)
                    ],
                    "VariantInstanceProvisionTimeoutInSeconds": 1200,
                    "InferenceAmiVersion": CUDA13_AMI,
                    "InitialInstanceCount": 1,
                    "ManagedInstanceScaling": {
                        "Status": "ENABLED",
                        "MinInstanceCount": 0,
                        "MaxInstanceCount": 4,
                    },
                    "ModelName": Match.absent(),
                }
            ],
            "KmsKeyId": Match.absent(),  # every pool type has NVMe instance storage
            "EnableNetworkIsolation": True,
        },
    )


def test_one_specification_fits_the_smallest_pool_type_with_one_gpu(
    gpu_zero: dict[str, Any],
) -> None:
    Template.from_json(gpu_zero[GPU_STACK]).has_resource_properties(
        "AWS::SageMaker::InferenceComponent",
        {
            "InferenceComponentName": GPU_COMPONENT,
            "Specification": {
                "StartupParameters": {
                    "ModelDataDownloadTimeoutInSeconds": 900,
                    "ContainerStartupHealthCheckTimeoutInSeconds": 900,
                },
                # ml.g6e.xlarge's 4 vCPUs (the fewest of the four), three quarters of the
                # 32 GiB every pool type has, one GPU.
                "ComputeResourceRequirements": {
                    "NumberOfCpuCoresRequired": 4,
                    "MinMemoryRequiredInMb": 24576,
                    "NumberOfAcceleratorDevicesRequired": 1,
                },
            },
            "Specifications": Match.absent(),
            "RuntimeConfig": {"CopyCount": 1},
        },
    )


def _metric_alarms(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: alarm["Properties"]
        for name, alarm in resources(raw, "AWS::CloudWatch::Alarm")
        if "EvaluationCriteria" not in alarm["Properties"]
    }


def _dimensions_read(alarm: dict[str, Any], metric_name: str) -> list[dict[str, str]]:
    """The dimensions of each `metric_name` an alarm reads (in its math or alone)."""
    metrics = [m["MetricStat"]["Metric"] for m in alarm.get("Metrics", []) if "MetricStat" in m]
    if "MetricName" in alarm:
        metrics.append(alarm)
    return [
        {d["Name"]: d["Value"] for d in metric["Dimensions"]}
        for metric in metrics
        if metric["MetricName"] == metric_name
    ]


def test_alarms_and_rollback_read_the_component_per_pool_type(gpu_zero: dict[str, Any]) -> None:
    raw = gpu_zero[GPU_STACK]
    alarms = _metric_alarms(raw)
    five_xx = {
        name: dims
        for name, alarm in alarms.items()
        for dims in _dimensions_read(alarm, "Invocation5XXErrors")
    }
    per_type = [{"InferenceComponentName": GPU_COMPONENT, "InstanceType": t} for t in POOLS]
    assert sorted(five_xx.values(), key=str) == sorted(
        [{"InferenceComponentName": GPU_COMPONENT}, *per_type], key=str
    )
    variant = {"EndpointName": GPU_STACK, "VariantName": "AllTraffic"}
    gpu_memory = [
        dims
        for alarm in alarms.values()
        for dims in _dimensions_read(alarm, "GPUMemoryUtilization")
    ]
    assert sorted(gpu_memory, key=str) == sorted(
        [variant, *({**variant, "InstanceType": t} for t in POOLS)], key=str
    )
    ((_, component),) = resources(raw, "AWS::SageMaker::InferenceComponent")
    rollback = [
        alarm["AlarmName"]["Ref"]
        for alarm in component["Properties"]["DeploymentConfig"]["AutoRollbackConfiguration"][
            "Alarms"
        ]
    ]
    # The 5XX rate per pool type (a failing type is not diluted by the others), then
    # ScoringSpeed and LetterMass.
    assert sorted(five_xx[name]["InstanceType"] for name in rollback if name in five_xx) == sorted(
        POOLS
    )
    assert len(rollback) == len(POOLS) + 2


def test_a_wake_up_may_fall_back_across_the_pools_before_it_pages(
    gpu_zero: dict[str, Any],
) -> None:
    template = Template.from_json(gpu_zero[GPU_STACK])
    minutes = wake_minutes(900, provision_seconds=1200)
    assert minutes == 36  # the alarm, 20 minutes across the pools, the copy's 15 minutes
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "NoCapacityInvocationFailures",
            "EvaluationPeriods": minutes,
            "DatapointsToAlarm": minutes,
        },
    )
    # No second copy while the first may still wait for capacity across the pools.
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "PolicyName": Match.string_like_regexp("FromZero"),
            "StepScalingPolicyConfiguration": {"Cooldown": 900 + 1200},
        },
    )


def test_the_dashboard_counts_copies_per_pool_type(gpu_zero: dict[str, Any]) -> None:
    body, _ = dashboard_body(gpu_zero[GPU_STACK])
    metrics = [
        metric for widget in body["widgets"] for metric in widget["properties"].get("metrics", [])
    ]
    for instance_type in POOLS:
        assert [
            "/aws/sagemaker/InferenceComponents",
            "CPUUtilizationNormalized",
            "InferenceComponentName",
            GPU_COMPONENT,
            "InstanceType",
            instance_type,
            {"label": f"copies on {instance_type}", "period": 60, "stat": "SampleCount"},
        ] in metrics


def test_gpu_pools_match_the_sagemaker_and_scaling_apis(gpu_zero: dict[str, Any]) -> None:
    raw = gpu_zero[GPU_STACK]
    assert api_problems(raw) == []
    assert _scaling_problems(raw, GPU_COMPONENT) == []


@pytest.mark.slow  # a few seconds: cfn-lint over the stacks scale to zero changes
def test_cfn_lint_passes_on_gpu_pools_with_scale_to_zero(gpu_zero: dict[str, Any]) -> None:
    problems = []
    for unit in ("artifact", "decision"):
        name = f"semif-gpu-zero-{unit}"
        problems += lint_problems(name, json.dumps(gpu_zero[name]), GPU_ZERO_ENV.region)
    assert problems == []


def test_a_copy_gets_a_gpu_share_of_a_type_with_several() -> None:
    assert copy_room("ml.g5.12xlarge", gpu=True) == CopyRoom(
        instance_type="ml.g5.12xlarge",
        vcpus=12,
        memory_bytes=48 << 30,
        gpu_memory_bytes=24 << 30,
    )


def test_a_pool_type_of_unknown_memory_is_refused() -> None:
    pools = _on_pools("ml.g6e.xlarge", "ml.p3.2xlarge")
    with pytest.raises(
        ConfigError, match=r"^decision\.scale_to_zero: ml\.p3\.2xlarge's memory is not known"
    ):
        replace(GPU_ZERO_ENV.decision, placement=pools)


def test_a_pool_type_whose_gpu_cannot_hold_a_copy_is_refused() -> None:
    # 9 GiB of weights, 6 GiB of KV cache (a quarter of the copy's 24 GiB) and 1 GiB: the
    # copy's memory holds it, a T4's 16 GiB does not.
    big = replace(GPU_ZERO_ENV.model, size_bytes=9 << 30)
    with pytest.raises(
        ConfigError,
        match=r"^decision\.scale_to_zero: ml\.g4dn\.2xlarge's GPU gives a copy 14745 MiB "
        r"\(0\.9 of 16384 MiB\), less than the 16384 MiB",
    ):
        replace(GPU_ZERO_ENV, model=big)
    without_t4 = _on_pools(*POOLS[:-1])
    replace(GPU_ZERO_ENV, model=big, decision=replace(GPU_ZERO_ENV.decision, placement=without_t4))
