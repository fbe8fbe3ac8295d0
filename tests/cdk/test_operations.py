"""Safe updates, alarms that reach someone, the post-deploy check, encrypted logs and the
trust policies, over every environment."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from aws_cdk.assertions import Match, Template

from cdk_constructs.endpoint_props import GpuPlacement
from stacks.config import AlarmNotifications
from stacks.environments import ENVIRONMENTS
from tests.support.templates import (
    ALL_STACKS,
    Synth,
    notifying_alarms,
    realtime_endpoint,
    resources,
    scaling_alarms,
    statements,
    synthesize_environment,
)

ENDPOINT_STACKS = [name for name in ALL_STACKS if name.endswith(("-decision", "-standard"))]


def _env(stack: str) -> str:
    return stack.split("-")[1]


def _deployment(raw: dict[str, Any], endpoint_id: str) -> dict[str, Any]:
    """What rolls an endpoint's model out: the endpoint's DeploymentConfig, or, where an
    inference component holds the model, the component's (the endpoint then has none)."""
    endpoint = raw["Resources"][endpoint_id]["Properties"]
    components = [
        c["Properties"]
        for _, c in resources(raw, "AWS::SageMaker::InferenceComponent")
        if c["Properties"]["EndpointName"] == {"Fn::GetAtt": [endpoint_id, "EndpointName"]}
    ]
    if not components:
        deployment: dict[str, Any] = endpoint["DeploymentConfig"]
        return deployment
    assert "DeploymentConfig" not in endpoint
    ((component,),) = [components]
    deployment = component["DeploymentConfig"]
    return deployment


@pytest.mark.parametrize("stack", ENDPOINT_STACKS)
def test_updates_roll_out_blue_green_with_rollback_alarms(synth: Synth, stack: str) -> None:
    raw = synth.templates[stack]
    for endpoint_id, endpoint in resources(raw, "AWS::SageMaker::Endpoint"):
        props = endpoint["Properties"]
        # The real-time endpoints keep their count; the asynchronous one starts its config's
        # one instance at each update (endpoint_stacks._add_async_endpoint).
        is_async = props["EndpointName"].endswith("-async")
        assert props["RetainAllVariantProperties"] is not is_async
        alarms = _deployment(raw, endpoint_id)["AutoRollbackConfiguration"]["Alarms"]
        assert alarms
        # The alarms exist before the endpoint: they never depend on it.
        for alarm in alarms:
            assert "DependsOn" not in raw["Resources"][alarm["AlarmName"]["Ref"]]
    endpoint_id, _ = realtime_endpoint(raw)
    deployment = _deployment(raw, endpoint_id)
    settings = ENVIRONMENTS[_env(stack)]
    rollout = (settings.decision if stack.endswith("decision") else settings.standard).rollout
    if "RollingUpdatePolicy" in deployment:  # an inference component: one copy a batch
        policy = deployment["RollingUpdatePolicy"]
        assert policy["MaximumBatchSize"] == {"Type": "COPY_COUNT", "Value": 1}
        assert rollout.traffic.value == "ALL_AT_ONCE"
    else:
        policy = deployment["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]
        assert policy["Type"] == rollout.traffic.value
    # Baked long enough for the slowest rollback alarm to fire (stacks/config.py).
    assert policy["WaitIntervalInSeconds"] >= 420


def _reads(alarm: dict[str, Any]) -> str:
    """What an alarm reads: a PromQL alarm its query; a metric alarm its namespace, metric
    names and dimensions."""
    props = alarm["Properties"]
    if "EvaluationCriteria" in props:
        return str(props["EvaluationCriteria"]["PromQLCriteria"]["Query"])
    stats = [q["MetricStat"]["Metric"] for q in props.get("Metrics", []) if "MetricStat" in q]
    metrics = stats or [props]
    names = "+".join(sorted(metric["MetricName"] for metric in metrics))
    dimensions = ",".join(
        f"{d['Name']}={d['Value']}"
        for d in sorted(metrics[0]["Dimensions"], key=lambda d: d["Name"])
    )
    return f"{metrics[0]['Namespace']} {names} {{{dimensions}}}"


def _rollback_reads(raw: dict[str, Any], endpoint_name: str) -> set[str]:
    ((endpoint_id, _),) = [
        (name, e)
        for name, e in resources(raw, "AWS::SageMaker::Endpoint")
        if e["Properties"]["EndpointName"] == endpoint_name
    ]
    alarms = _deployment(raw, endpoint_id)["AutoRollbackConfiguration"]["Alarms"]
    reads = [_reads(raw["Resources"][alarm["AlarmName"]["Ref"]]) for alarm in alarms]
    assert len(reads) == len(set(reads)) <= 10  # SageMaker's most
    return set(reads)


def _five_xx(endpoint_name: str, instance_type: str | None = None) -> str:
    typed = "" if instance_type is None else f"InstanceType={instance_type},"
    return (
        f"AWS/SageMaker Invocation5XXErrors+Invocations "
        f"{{EndpointName={endpoint_name},{typed}VariantName=AllTraffic}}"
    )


def _speed(name: str, limit_s: str) -> str:
    """The ScoringSpeed query, spelled out: seconds per decoded row, per instance."""
    where = f'{{"aws.sagemaker.endpoint.name"="{name}",variant=~"AllTraffic|"}}'
    evaluated = (
        f'{{"aws.sagemaker.endpoint.name"="{name}",variant=~"AllTraffic|",source="evaluated"}}'
    )
    return (
        f'sum by ("@resource.host.id") (rate(semif_pass_duration_seconds_sum{where}[10m])) / '
        f'sum by ("@resource.host.id") (rate(semif_prompt_tokens_total{evaluated}[10m]))'
        f" > {limit_s}"
    )


def _mass(name: str) -> str:
    """The LetterMass query, spelled out: the median letter mass, per instance."""
    where = f'{{"aws.sagemaker.endpoint.name"="{name}",variant=~"AllTraffic|"}}'
    return (
        'histogram_quantile(0.5, sum by (le, "@resource.host.id") '
        f"(rate(semif_allowed_token_mass_bucket{where}[10m]))) < 0.5"
    )


@pytest.mark.parametrize(
    ("env", "endpoint_name", "expected"),
    [
        (  # CPU, an inference component: its 5XX rate, the model's speed (10 ms a row) and
            # letter mass (the container's series still carry the endpoint's name)
            "dev",
            "semif-dev-decision",
            {
                "AWS/SageMaker Invocation5XXErrors+Invocations "
                "{InferenceComponentName=semif-dev-decision-model}",
                _speed("semif-dev-decision", "0.01"),
                _mass("semif-dev-decision"),
            },
        ),
        (  # CPU, Qwen3.5-4B: 40 ms a row
            "prod",
            "semif-prod-decision",
            {
                _five_xx("semif-prod-decision"),
                _speed("semif-prod-decision", "0.04"),
                _mass("semif-prod-decision"),
            },
        ),
        (  # GPU pools: the 5XX rate of each pool type (its metrics carry InstanceType); 5 ms
            "gpu",
            "semif-gpu-decision",
            {
                *(
                    _five_xx("semif-gpu-decision", pool)
                    for pool in (
                        "ml.g6e.xlarge",
                        "ml.g6.2xlarge",
                        "ml.g5.2xlarge",
                        "ml.g4dn.2xlarge",
                    )
                ),
                _speed("semif-gpu-decision", "0.005"),
                _mass("semif-gpu-decision"),
            },
        ),
        (  # asynchronous: failed invocations (no Invocations there) and its own signals
            "dev",
            "semif-dev-decision-async",
            {
                "AWS/SageMaker InvocationFailures "
                "{EndpointName=semif-dev-decision-async,VariantName=AllTraffic}",
                _speed("semif-dev-decision-async", "0.01"),
                _mass("semif-dev-decision-async"),
            },
        ),
        ("dev", "semif-dev-standard", {_five_xx("semif-dev-standard")}),
    ],
)
def test_rollback_alarms_read_failures_and_model_regressions_only(
    synth: Synth, env: str, endpoint_name: str, expected: set[str]
) -> None:
    """Exactly these alarms gate a rollback, each reading exactly this. Not latency (queue
    waits are in ModelLatency by design), not load (429s, the refused share), not the age of
    the asynchronous queue (it pages only: endpoint_operations.AsyncEndpointAlarms)."""
    unit = "standard" if endpoint_name.endswith("standard") else "decision"
    reads = _rollback_reads(synth.raw(env, unit), endpoint_name)
    assert reads == expected
    for load_or_latency in ("ModelLatency", "semif_refused", "Invocation4XX", "OldestRequest"):
        assert not any(load_or_latency in read for read in reads)


def test_prod_canaries_one_instance(synth: Synth) -> None:
    synth.template("prod", "decision").has_resource_properties(
        "AWS::SageMaker::Endpoint",
        {
            "DeploymentConfig": Match.object_like(
                {
                    "BlueGreenUpdatePolicy": Match.object_like(
                        {
                            "TrafficRoutingConfiguration": {
                                "Type": "CANARY",
                                "CanarySize": {"Type": "INSTANCE_COUNT", "Value": 1},
                                "WaitIntervalInSeconds": 600,
                            }
                        }
                    )
                }
            )
        },
    )


@pytest.mark.parametrize("stack", ENDPOINT_STACKS)
def test_every_alarm_notifies_the_environment_topic(synth: Synth, stack: str) -> None:
    topic = {
        "Fn::ImportValue": Match.string_like_regexp(rf"^semif-{_env(stack)}-artifact:.*Alarms")
    }
    template = synth.templates[stack]
    alarms = list(resources(template, "AWS::CloudWatch::Alarm"))
    assert alarms
    notifying_alarms(template).all_resources_properties(
        "AWS::CloudWatch::Alarm", {"AlarmActions": [topic], "OKActions": [topic]}
    )
    # Only the starts from zero (the asynchronous endpoint's, the inference component's)
    # and the component's stop when idle act on scaling, not on the topic.
    assert len(scaling_alarms(template)) == (3 if stack == "semif-dev-decision" else 0)


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_the_alarm_topic_is_kms_encrypted_and_open_to_cloudwatch_only(
    synth: Synth, env: str
) -> None:
    template = synth.template(env, "artifact")
    template.resource_count_is("AWS::SNS::Topic", 1)
    template.has_resource_properties("AWS::SNS::Topic", {"KmsMasterKeyId": Match.any_value()})
    template.has_resource_properties(
        "AWS::SNS::TopicPolicy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Principal": {"Service": "cloudwatch.amazonaws.com"},
                                "Action": "sns:Publish",
                                "Condition": Match.object_like(
                                    {
                                        "StringEquals": {
                                            "aws:SourceAccount": {"Ref": "AWS::AccountId"}
                                        }
                                    }
                                ),
                            }
                        )
                    ]
                )
            }
        },
    )
    template.resource_count_is("AWS::SNS::Subscription", 0)


def test_alarm_email_and_existing_topic(tmp_path: Path) -> None:
    dev = ENVIRONMENTS["dev"]
    emailed = dataclasses.replace(dev, notifications=AlarmNotifications(email="oncall@example.com"))
    assembly = synthesize_environment(emailed, tmp_path / "email")
    Template.from_json(
        assembly.get_stack_by_name("semif-dev-artifact").template
    ).has_resource_properties(
        "AWS::SNS::Subscription", {"Protocol": "email", "Endpoint": "oncall@example.com"}
    )
    arn = "arn:aws:sns:us-east-1:498765432107:platform-alarms"
    existing = dataclasses.replace(dev, notifications=AlarmNotifications(topic_arn=arn))
    assembly = synthesize_environment(existing, tmp_path / "topic")
    artifact = Template.from_json(assembly.get_stack_by_name("semif-dev-artifact").template)
    artifact.resource_count_is("AWS::SNS::Topic", 0)
    decision = assembly.get_stack_by_name("semif-dev-decision").template
    notifying_alarms(decision).all_resources_properties(
        "AWS::CloudWatch::Alarm", {"AlarmActions": [arn]}
    )


def test_gpu_placements_alarm_on_gpu_memory(synth: Synth) -> None:
    gpu = synth.template("gpu", "decision")
    found = gpu.find_resources(
        "AWS::CloudWatch::Alarm", {"Properties": {"MetricName": "GPUMemoryUtilization"}}
    )
    assert len(found) == 1 + len(ENVIRONMENTS["gpu"].decision.instance_pools)
    cpu = synth.template("dev", "decision")
    assert not cpu.find_resources(
        "AWS::CloudWatch::Alarm", {"Properties": {"MetricName": "GPUMemoryUtilization"}}
    )


@pytest.mark.parametrize(
    ("stack", "probe"),
    [(s, "chat" if s.endswith("standard") else "decision") for s in ENDPOINT_STACKS],
)
def test_post_deploy_check_invokes_the_endpoint_once_it_exists(
    synth: Synth, stack: str, probe: str
) -> None:
    raw = synth.templates[stack]
    endpoint_id, endpoint = realtime_endpoint(raw)
    config_id = endpoint["Properties"]["EndpointConfigName"]["Fn::GetAtt"][0]
    # One check: the asynchronous endpoint refuses a synchronous InvokeEndpoint.
    ((_, check),) = resources(raw, "Custom::EndpointCheck")
    assert endpoint_id in check["DependsOn"]
    assert check["Properties"]["Probe"] == probe
    assert check["Properties"]["EndpointName"] == endpoint["Properties"]["EndpointName"]
    assert check["Properties"]["EndpointConfigName"] == {
        "Fn::GetAtt": [config_id, "EndpointConfigName"]
    }
    invokes = [s for _, s in statements(raw) if s["Action"] == "sagemaker:InvokeEndpoint"]
    assert len(invokes) == 1
    name = endpoint["Properties"]["EndpointName"]
    components = list(resources(raw, "AWS::SageMaker::InferenceComponent"))
    if not components:
        assert json.dumps(invokes[0]["Resource"]).endswith(f':endpoint/{name}"]]}}')
        assert "InferenceComponentName" not in check["Properties"]
        return
    # Through the inference component, checked again when its model changes.
    ((component_id, component),) = components
    assert component_id in check["DependsOn"]
    spec = component["Properties"]["Specification"]
    assert check["Properties"]["InferenceComponentName"] == f"{name}-model"
    assert check["Properties"]["ModelName"] == spec["ModelName"]
    ends = [json.dumps(resource).removesuffix('"]]}') for resource in invokes[0]["Resource"]]
    assert [end.rsplit(":", 1)[1] for end in ends] == [
        f"endpoint/{name}",
        f"inference-component/{name}-model",
    ]


@pytest.mark.parametrize("stack", ALL_STACKS)
def test_every_log_group_is_encrypted_with_an_environment_key(synth: Synth, stack: str) -> None:
    for logical_id, log_group in resources(synth.templates[stack], "AWS::Logs::LogGroup"):
        assert "KmsKeyId" in log_group["Properties"], logical_id


@pytest.mark.parametrize("unit", ["artifact", "images"])
def test_keys_admit_cloudwatch_logs_for_this_account_only(synth: Synth, unit: str) -> None:
    for _, key in resources(synth.raw("dev", unit), "AWS::KMS::Key"):
        statements_ = key["Properties"]["KeyPolicy"]["Statement"]
        logs = [s for s in statements_ if s.get("Sid") == "CloudWatchLogsEncryption"]
        assert len(logs) == 1
        assert "kms:EncryptionContext:aws:logs:arn" in logs[0]["Condition"]["ArnLike"]


def _trust(raw: dict[str, Any], service: str) -> list[dict[str, Any]]:
    return [
        statement
        for _, role in resources(raw, "AWS::IAM::Role")
        for statement in role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        if statement["Principal"].get("Service") == service
    ]


@pytest.mark.parametrize(
    ("unit", "service"),
    [
        ("decision", "sagemaker.amazonaws.com"),
        ("standard", "sagemaker.amazonaws.com"),
        ("artifact", "codebuild.amazonaws.com"),
        ("images", "codebuild.amazonaws.com"),
    ],
)
def test_service_trust_has_confused_deputy_conditions(
    synth: Synth, unit: str, service: str
) -> None:
    trusts = _trust(synth.raw("dev", unit), service)
    assert trusts
    for trust in trusts:
        assert trust["Condition"]["StringEquals"] == {
            "aws:SourceAccount": {"Ref": "AWS::AccountId"}
        }
        assert "aws:SourceArn" in trust["Condition"]["ArnLike"]


@pytest.mark.parametrize("env", ["dev", "prod", "gpu"])
def test_scaling_uses_the_service_linked_role(synth: Synth, env: str) -> None:
    raw = synth.raw(env, "decision")
    targets = list(resources(raw, "AWS::ApplicationAutoScaling::ScalableTarget"))
    assert len(targets) == (2 if ENVIRONMENTS[env].decision.async_endpoint else 1)
    for _, target in targets:
        assert "RoleARN" not in target["Properties"]
    roles = [name for name, _ in resources(raw, "AWS::IAM::Role")]
    assert not [name for name in roles if name.startswith(("Scaling", "AsyncScaling"))]


def test_pool_endpoints_roll_back_on_their_per_type_5xx_alarms(tmp_path: Path) -> None:
    """With SageMaker's most pools (5), rollback watches each type's 5XX rate and the two
    model alarms: 7 of SageMaker's 10."""
    gpu = ENVIRONMENTS["gpu"]
    placement = gpu.decision.placement
    assert isinstance(placement, GpuPlacement)
    five = dataclasses.replace(
        placement, instance_pools=(*placement.instance_pools, "ml.g5.4xlarge")
    )
    config = dataclasses.replace(gpu, decision=dataclasses.replace(gpu.decision, placement=five))
    assembly = synthesize_environment(config, tmp_path)
    raw = assembly.get_stack_by_name("semif-gpu-decision").template
    reads = _rollback_reads(raw, "semif-gpu-decision")
    assert len(reads) == 7
    assert {_five_xx("semif-gpu-decision", pool) for pool in five.instance_pools} < reads
