"""Offline decision batches: transform jobs on the decision model, and the asynchronous
endpoint that scales to zero (dev only): its config, role, scaling, alarms and outputs."""

from __future__ import annotations

import json
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import aws_sns as sns
from aws_cdk.assertions import Capture, Match, Matcher

from cdk_constructs.endpoint_props import AsyncInference, require_key_prefix
from cdk_constructs.validation import PropsError
from stacks.config import EndpointKind
from stacks.deployment import endpoint_name
from stacks.environments import ENVIRONMENTS
from tests.support.templates import (
    Synth,
    as_list,
    assert_role_policy_has,
    import_value,
    realtime_endpoint,
    resources,
    statements,
)

ENVS = sorted(ENVIRONMENTS)
ASYNC_ENVS = [env for env in ENVS if ENVIRONMENTS[env].decision.async_endpoint]


def _bucket(env: str) -> dict[str, Any]:
    return import_value(f"semif-{env}-artifact", "ArtifactsBucket")


def _key(env: str) -> dict[str, Any]:
    return import_value(f"semif-{env}-artifact", "ArtifactsKey")


def _objects(env: str, prefix: str) -> dict[str, Any]:
    """`<bucket ARN>/<prefix>*`, as the role's statements name it."""
    return {"Fn::Join": ["", [_bucket(env), f"/{prefix}*"]]}


def _s3_uri(env: str, prefix: str) -> dict[str, Any]:
    return {"Fn::Join": ["", ["s3://", _bucket(env), f"/{prefix}"]]}


def _via(service: str, region: str) -> Matcher:
    return Match.exact(
        {
            "StringEquals": {
                "kms:ViaService": {
                    "Fn::Join": ["", [f"{service}.{region}.", {"Ref": "AWS::URLSuffix"}]]
                }
            }
        }
    )


def _role_statements(raw: dict[str, Any], role_prefix: str) -> list[dict[str, Any]]:
    return [s for name, s in statements(raw) if name.startswith(role_prefix)]


def _async_name(env: str) -> str:
    return f"{endpoint_name(ENVIRONMENTS[env], EndpointKind.DECISION)}-async"


def _transform_logs(region: str, suffix: str) -> dict[str, Any]:
    """SageMaker's transform log group (`suffix` "") or its streams (":*") in `region`."""
    return {
        "Fn::Join": [
            "",
            [
                f"arn:aws:logs:{region}:",
                {"Ref": "AWS::AccountId"},
                f":log-group:/aws/sagemaker/TransformJobs{suffix}",
            ],
        ]
    }


# --- A. transform jobs on the decision model -------------------------------------------


@pytest.mark.parametrize("env", ENVS)
def test_the_decision_role_runs_transform_jobs_on_exact_prefixes(synth: Synth, env: str) -> None:
    """A transform job reads and writes S3 as the model's role: list and read under
    batch/input/, write (multipart too) under batch/output/, with the artifact key."""
    region = ENVIRONMENTS[env].region
    template = synth.template(env, "decision")
    # In the order the role's policy holds them (the model's grants merged in).
    expected: list[dict[str, Any]] = [
        {"Action": "s3:GetObject", "Resource": Match.array_with([_objects(env, "batch/input/")])},
        {
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Condition": _via("s3", region),
            "Resource": _key(env),
        },
        {
            "Action": "s3:ListBucket",
            "Condition": {"StringLike": {"s3:prefix": ["batch/input/*"]}},
            "Resource": _bucket(env),
        },
        {
            "Action": ["s3:AbortMultipartUpload", "s3:PutObject"],
            "Resource": _objects(env, "batch/output/"),
        },
        {"Action": "kms:Encrypt", "Resource": _key(env)},
        {  # CreateLogGroup authorizes against the group's own ARN, and only that
            "Action": "logs:CreateLogGroup",
            "Resource": _transform_logs(region, ""),
        },
        {
            "Action": "cloudwatch:PutMetricData",
            "Condition": {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/TransformJobs"}},
            "Resource": "*",
        },
    ]
    assert_role_policy_has(template, "DecisionExecutionRole", expected)
    # The streams (the endpoint's own log group's statement, merged: the same actions).
    template.has_resource_properties(
        "AWS::IAM::Policy",
        {
            "Roles": [{"Ref": Match.string_like_regexp("^DecisionExecutionRole")}],
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        {
                            "Action": [
                                "logs:CreateLogStream",
                                "logs:DescribeLogStreams",
                                "logs:PutLogEvents",
                            ],
                            "Effect": "Allow",
                            "Resource": Match.array_with([_transform_logs(region, ":*")]),
                        }
                    ]
                )
            },
        },
    )
    creates = [
        s
        for s in _role_statements(synth.raw(env, "decision"), "DecisionExecutionRole")
        if "logs:CreateLogGroup" in as_list(s["Action"])
    ]
    assert len(creates) == 1
    assert creates[0]["Action"] == "logs:CreateLogGroup"  # nothing else on the bare ARN
    # Nothing else of the bucket: the model object, the batch input and the batch output.
    role = _role_statements(synth.raw(env, "decision"), "DecisionExecutionRole")
    suffixes = {
        part
        for s in role
        if any(action.startswith("s3:") for action in as_list(s["Action"]))
        for resource in as_list(s["Resource"])
        for part in json.loads(json.dumps(resource)).get("Fn::Join", ["", [""]])[1]
        if isinstance(part, str) and part.startswith("/")
    }
    assert {s for s in suffixes if not s.startswith("/models/")} == {
        "/batch/input/*",
        "/batch/output/*",
    }


@pytest.mark.parametrize("env", ENVS)
def test_batch_outputs_name_the_current_model_the_prefixes_and_the_key(
    synth: Synth, env: str
) -> None:
    template = synth.template(env, "decision")
    model_id, _ = next(
        (name, model)
        for name, model in resources(synth.raw(env, "decision"), "AWS::SageMaker::Model")
        if name.startswith("DecisionModel")
    )
    # The real-time endpoint's model: a blue/green update replaces it, and the output with it.
    template.has_output("DecisionModelName", {"Value": {"Fn::GetAtt": [model_id, "ModelName"]}})
    template.has_output("BatchInputPrefix", {"Value": _s3_uri(env, "batch/input/")})
    template.has_output("BatchOutputPrefix", {"Value": _s3_uri(env, "batch/output/")})
    template.has_output("ArtifactKeyArn", {"Value": _key(env)})


# --- B. the asynchronous endpoint -------------------------------------------------------


@pytest.mark.parametrize("env", ENVS)
def test_only_environments_that_ask_get_an_async_endpoint(synth: Synth, env: str) -> None:
    raw = synth.raw(env, "decision")
    names = {e["Properties"]["EndpointName"] for _, e in resources(raw, "AWS::SageMaker::Endpoint")}
    configs = [c for _, c in resources(raw, "AWS::SageMaker::EndpointConfig")]
    outputs = {name for name in raw["Outputs"] if name.startswith("Async")}
    if env in ASYNC_ENVS:
        assert names == {_async_name(env)[: -len("-async")], _async_name(env)}
        assert sum("AsyncInferenceConfig" in c["Properties"] for c in configs) == 1
        assert outputs == {
            "AsyncEndpointName",
            "AsyncInputPrefix",
            "AsyncOutputPrefix",
            "AsyncFailurePrefix",
            "AsyncSuccessTopicArn",
            "AsyncErrorTopicArn",
        }
    else:
        assert names == {endpoint_name(ENVIRONMENTS[env], EndpointKind.DECISION)}
        assert not any("AsyncInferenceConfig" in c["Properties"] for c in configs)
        assert not list(resources(raw, "AWS::SNS::Topic"))
        assert outputs == set()
    assert "prod" not in ASYNC_ENVS


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_config_writes_answers_and_failures_encrypted_and_notifies(
    synth: Synth, env: str
) -> None:
    settings = ENVIRONMENTS[env].decision
    template = synth.template(env, "decision")
    success, error, model = Capture(), Capture(), Capture()
    template.has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "AsyncInferenceConfig": {
                "OutputConfig": {
                    "S3OutputPath": _s3_uri(env, "async/output/"),
                    "S3FailurePath": _s3_uri(env, "async/failure/"),
                    "KmsKeyId": _key(env),
                    "NotificationConfig": {
                        "SuccessTopic": {"Ref": success},
                        "ErrorTopic": {"Ref": error},
                    },
                },
                "ClientConfig": {
                    "MaxConcurrentInvocationsPerInstance": settings.async_invocations_per_instance
                },
            },
            # Detailed observability set explicitly: its signals and PromQL alarms read it.
            "MetricsConfig": {
                "EnableDetailedObservability": True,
                "MetricPublishFrequencyInSeconds": settings.metrics.publish_frequency_seconds,
            },
            "ProductionVariants": [
                Match.object_like(
                    {
                        "ModelName": {"Fn::GetAtt": [model, "ModelName"]},
                        "InitialInstanceCount": 1,  # SageMaker's least; scaling takes it to 0
                        "RoutingConfig": Match.absent(),
                    }
                )
            ],
        },
    )
    assert settings.async_invocations_per_instance == 2  # 32 requests a pass: two files
    assert model.as_string().startswith("AsyncModel")
    raw = synth.raw(env, "decision")
    template.resource_count_is("AWS::SNS::Topic", 2)
    template.all_resources_properties("AWS::SNS::Topic", {"KmsMasterKeyId": _key(env)})
    for topic in (success.as_string(), error.as_string()):
        assert raw["Resources"][topic]["Type"] == "AWS::SNS::Topic"
        template.has_resource_properties(
            "AWS::SNS::TopicPolicy",
            {
                "Topics": [{"Ref": topic}],
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
    template.has_output("AsyncSuccessTopicArn", {"Value": {"Ref": success.as_string()}})
    template.has_output("AsyncErrorTopicArn", {"Value": {"Ref": error.as_string()}})


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_model_serves_the_same_image_and_artifact_with_async_limits(
    synth: Synth, env: str
) -> None:
    settings = ENVIRONMENTS[env].decision
    assert settings.async_endpoint is not None
    models = {  # by construct: DecisionModel..., AsyncModel...
        name.split("Model")[0]: model["Properties"]
        for name, model in resources(synth.raw(env, "decision"), "AWS::SageMaker::Model")
    }
    realtime, queued = models["Decision"], models["Async"]
    for field in ("Image", "ModelDataUrl"):
        assert queued["PrimaryContainer"][field] == realtime["PrimaryContainer"][field]
    assert queued["EnableNetworkIsolation"] is True
    environment = queued["PrimaryContainer"]["Environment"]
    assert environment == {
        **realtime["PrimaryContainer"]["Environment"],
        "SEMIF_REQUEST_TIMEOUT_S": "3600.0",
        "SEMIF_MAX_LINES_BYTES": str(1 << 30),
        "SEMIF_MAX_LINES": str(1 << 20),  # a line per KiB of a whole file
    }
    assert realtime["PrimaryContainer"]["Environment"]["SEMIF_REQUEST_TIMEOUT_S"] == "50.0"


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_endpoint_rolls_out_its_own_instance_and_has_no_synchronous_check(
    synth: Synth, env: str
) -> None:
    """Blue/green all at once, baked 10 minutes; an update starts the config's one
    instance instead of retaining a count that may be zero (which would deploy the new
    model onto no instance, unstarted and unwatched). Its rollback alarms:
    test_operations.py."""
    raw = synth.raw(env, "decision")
    (endpoint,) = [
        e["Properties"]
        for _, e in resources(raw, "AWS::SageMaker::Endpoint")
        if e["Properties"]["EndpointName"] == _async_name(env)
    ]
    policy = endpoint["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert policy["TrafficRoutingConfiguration"] == {
        "Type": "ALL_AT_ONCE",
        "WaitIntervalInSeconds": 600,
    }
    assert endpoint["RetainAllVariantProperties"] is False
    ((_, check),) = resources(raw, "Custom::EndpointCheck")
    assert (
        check["Properties"]["EndpointName"]
        == realtime_endpoint(raw)[1]["Properties"]["EndpointName"]
    )


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_role_reads_requests_writes_answers_and_publishes_outcomes(
    synth: Synth, env: str
) -> None:
    region = ENVIRONMENTS[env].region
    template = synth.template(env, "decision")
    expected: list[dict[str, Any]] = [
        {"Action": "s3:GetObject", "Resource": Match.array_with([_objects(env, "async/input/")])},
        {
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Condition": _via("s3", region),
            "Resource": _key(env),
        },
        {
            "Action": ["s3:AbortMultipartUpload", "s3:PutObject"],
            "Resource": [_objects(env, "async/failure/"), _objects(env, "async/output/")],
        },
        {"Action": "kms:Encrypt", "Resource": _key(env)},
        {
            "Action": "sns:Publish",
            "Resource": [
                {"Ref": Match.string_like_regexp("^AsyncErrorTopic")},
                {"Ref": Match.string_like_regexp("^AsyncSuccessTopic")},
            ],
        },
        {
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Condition": _via("sns", region),
            "Resource": _key(env),
        },
    ]
    assert_role_policy_has(template, "AsyncExecutionRole", expected)
    role = _role_statements(synth.raw(env, "decision"), "AsyncExecutionRole")
    actions = {action for s in role for action in as_list(s["Action"])}
    assert "s3:ListBucket" not in actions  # InputLocation names one object
    assert "batch/" not in json.dumps(role)
    assert "async/" not in json.dumps(
        _role_statements(synth.raw(env, "decision"), "DecisionExecutionRole")
    )


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_endpoint_scales_from_zero_on_its_queue(synth: Synth, env: str) -> None:
    settings = ENVIRONMENTS[env].decision
    assert settings.async_endpoint is not None
    name = _async_name(env)
    template = synth.template(env, "decision")
    raw = template.to_json()
    target = Capture()
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalableTarget",
        {
            "ResourceId": f"endpoint/{name}/variant/AllTraffic",
            "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
            "MinCapacity": 0,
            "MaxCapacity": settings.async_endpoint.max_capacity,
            "RoleARN": Match.absent(),
        },
    )
    (target_id,) = [
        name_
        for name_, t in resources(raw, "AWS::ApplicationAutoScaling::ScalableTarget")
        if t["Properties"]["ResourceId"] == f"endpoint/{name}/variant/AllTraffic"
    ]
    assert any(d.startswith("AsyncEndpoint") for d in raw["Resources"][target_id]["DependsOn"])
    queue = {"Name": "EndpointName", "Value": name}
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "ScalingTargetId": {"Ref": target_id},
            "PolicyType": "TargetTrackingScaling",
            "TargetTrackingScalingPolicyConfiguration": {
                "CustomizedMetricSpecification": {
                    "MetricName": "ApproximateBacklogSizePerInstance",
                    "Namespace": "AWS/SageMaker",
                    "Dimensions": [queue],
                    "Statistic": "Average",
                },
                "TargetValue": settings.async_endpoint.target_backlog_per_instance,
                "ScaleInCooldown": 600,
                "ScaleOutCooldown": 300,
            },
        },
    )
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "ScalingTargetId": {"Ref": target_id},
            "PolicyType": "StepScaling",
            "StepScalingPolicyConfiguration": {
                "AdjustmentType": "ChangeInCapacity",
                "MetricAggregationType": "Average",
                # While the first instance starts, no second +1 (start-up timeout).
                "Cooldown": settings.startup_timeout_seconds,
                "StepAdjustments": [{"MetricIntervalLowerBound": 0, "ScalingAdjustment": 1}],
            },
        },
    )
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "HasBacklogWithoutCapacity",
            "Namespace": "AWS/SageMaker",
            "Dimensions": [queue],
            "Statistic": "Average",
            "Period": 60,
            "EvaluationPeriods": 1,
            "Threshold": 1,
            "ComparisonOperator": "GreaterThanOrEqualToThreshold",
            "AlarmActions": [{"Ref": target}],
            "OKActions": Match.absent(),
        },
    )
    policy = raw["Resources"][target.as_string()]
    assert policy["Type"] == "AWS::ApplicationAutoScaling::ScalingPolicy"
    assert policy["Properties"]["PolicyType"] == "StepScaling"


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_alarms_watch_the_oldest_request_not_latency(synth: Synth, env: str) -> None:
    settings = ENVIRONMENTS[env].decision
    assert settings.async_endpoint is not None
    name = _async_name(env)
    template = synth.template(env, "decision")
    topic = import_value(f"semif-{env}-artifact", "Alarms")
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "ApproximateAgeOfOldestRequest",
            "Namespace": "AWS/SageMaker",
            "Dimensions": [{"Name": "EndpointName", "Value": name}],
            "Statistic": "Maximum",
            "Threshold": settings.async_endpoint.max_oldest_request_age_seconds,
            "ComparisonOperator": "GreaterThanThreshold",
            "AlarmActions": [topic],
            "OKActions": [topic],
        },
    )
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "MetricName": "InvocationFailures",
            "Namespace": "AWS/SageMaker",
            "Dimensions": [
                {"Name": "EndpointName", "Value": name},
                {"Name": "VariantName", "Value": "AllTraffic"},
            ],
            "Statistic": "Sum",
            "Threshold": 0,
            "ComparisonOperator": "GreaterThanThreshold",
            "EvaluationPeriods": 5,
            "DatapointsToAlarm": 3,
            "AlarmActions": [topic],
        },
    )
    watched = {
        alarm["Properties"].get("MetricName")
        for _, alarm in resources(template.to_json(), "AWS::CloudWatch::Alarm")
        if name in json.dumps(alarm["Properties"].get("Dimensions", []))
    }
    assert watched == {
        "ApproximateAgeOfOldestRequest",
        "InvocationFailures",
        "HasBacklogWithoutCapacity",
        "MemoryUtilization",
        "DiskUtilization",
    }


@pytest.mark.parametrize("env", ASYNC_ENVS)
def test_async_outputs_name_the_endpoint_and_its_prefixes(synth: Synth, env: str) -> None:
    template = synth.template(env, "decision")
    template.has_output("AsyncEndpointName", {"Value": _async_name(env)})
    template.has_output("AsyncInputPrefix", {"Value": _s3_uri(env, "async/input/")})
    template.has_output("AsyncOutputPrefix", {"Value": _s3_uri(env, "async/output/")})
    template.has_output("AsyncFailurePrefix", {"Value": _s3_uri(env, "async/failure/")})


# --- props ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prefix", ["batch/input", "/batch/input/", "batch/*/", "Batch/input/", "batch//", ""]
)
def test_a_grant_prefix_is_exact(prefix: str) -> None:
    with pytest.raises(PropsError, match="is not a key prefix"):
        require_key_prefix(prefix, "batch input_prefix")
    assert require_key_prefix("batch/input/", "x") == "batch/input/"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"invocations_per_instance": 0}, "async.invocations_per_instance: 0 is outside 1..1000"),
        ({"invocations_per_instance": 1001}, "1001 is outside 1..1000"),
        ({"output_prefix": "async/output"}, "async.output_prefix: 'async/output' is not a key"),
        ({"failure_prefix": "async/*/"}, "async.failure_prefix"),
    ],
)
def test_async_inference_takes_what_sagemaker_takes(
    overrides: dict[str, Any], message: str
) -> None:
    stack = cdk.Stack(cdk.App(), "Props")
    topic = sns.Topic(stack, "Topic")
    values: dict[str, Any] = {
        "input_prefix": "async/input/",
        "output_prefix": "async/output/",
        "failure_prefix": "async/failure/",
        "success_topic": topic,
        "error_topic": topic,
        "invocations_per_instance": 2,
        **overrides,
    }
    with pytest.raises(PropsError, match=message.replace("*", r"\*")):
        AsyncInference(**values)
