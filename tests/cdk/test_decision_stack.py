"""The decision stack: the deploy-time image build, the endpoint, its scaling and alarms."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import pytest
from aws_cdk.assertions import Capture, Match

from cdk_constructs.endpoint_props import CpuPlacement, GpuPlacement
from cdk_constructs.model_build import model_object_key
from stacks.config import EndpointKind
from stacks.deployment import endpoint_name
from stacks.environments import ENVIRONMENTS
from tests.support.templates import (
    Synth,
    as_list,
    assert_role_policy_has,
    dashboard_body,
    import_value,
    logical_id,
    resources,
    scaling_alarms,
    statements,
)


def _model_data_url(env: str) -> dict[str, Any]:
    key = model_object_key(ENVIRONMENTS[env].model.sha256)
    return {
        "Fn::Join": [
            "",
            ["s3://", import_value(f"semif-{env}-artifact", "ArtifactsBucket"), f"/{key}"],
        ]
    }


def test_waiter_handlers_may_only_start_and_read_their_project(synth: Synth) -> None:
    raw = synth.raw("dev", "decision")
    codebuild = [s for _, s in statements(raw) if "codebuild:StartBuild" in as_list(s["Action"])]
    assert len(codebuild) == 1
    assert sorted(codebuild[0]["Action"]) == [
        "codebuild:BatchGetBuilds",
        "codebuild:ListBuildsForProject",
        "codebuild:StartBuild",
    ]
    synth.template("dev", "decision").has_resource_properties(
        "AWS::IAM::Policy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Action": Match.array_with(["codebuild:StartBuild"]),
                                "Resource": import_value("semif-dev-images", "CpuImageProject"),
                            }
                        )
                    ]
                )
            }
        },
    )


@pytest.mark.parametrize("env", ["dev", "prod", "gpu"])
def test_decision_model_serves_the_built_digest_with_network_isolation(
    synth: Synth, env: str
) -> None:
    template = synth.template(env, "decision")
    build_id = Capture()
    # dev also serves the same digest and artifact asynchronously (its second model).
    models = 2 if ENVIRONMENTS[env].decision.async_endpoint else 1
    template.resource_count_is("AWS::SageMaker::Model", models)
    template.all_resources_properties(
        "AWS::SageMaker::Model",
        {
            "EnableNetworkIsolation": True,
            "PrimaryContainer": Match.object_like(
                {
                    # <this account>.dkr.ecr.<this region>.<suffix>/<adapter repo>@<built digest>
                    "Image": {
                        "Fn::Join": [
                            "",
                            [
                                {"Ref": "AWS::AccountId"},
                                ".dkr.ecr.",
                                {"Ref": "AWS::Region"},
                                ".",
                                {"Ref": "AWS::URLSuffix"},
                                "/",
                                import_value(f"semif-{env}-images", "AdapterRepository"),
                                "@",
                                {"Fn::GetAtt": [build_id, "IMAGE_DIGEST"]},
                            ],
                        ]
                    },
                    "ModelDataUrl": _model_data_url(env),
                }
            ),
            "ModelName": Match.absent(),
        },
    )
    template.has_resource(
        "Custom::DeployTimeBuild",
        {
            "Properties": Match.object_like(
                {
                    "OutputVariables": ["IMAGE_URI", "IMAGE_DIGEST"],
                    "Trigger": Match.string_like_regexp(r"^(cpu|cuda)-[0-9a-f]{32}$"),
                }
            )
        },
    )
    assert template.to_json()["Resources"][build_id.as_string()]["Type"] == (
        "Custom::DeployTimeBuild"
    )


def test_decision_environment_variables(synth: Synth) -> None:
    config = ENVIRONMENTS["prod"].decision
    assert isinstance(config.placement, CpuPlacement)
    synth.template("prod", "decision").has_resource_properties(
        "AWS::SageMaker::Model",
        {
            "PrimaryContainer": Match.object_like(
                {
                    "Environment": Match.exact(
                        {
                            "SEMIF_VARIANT": "AllTraffic",
                            "SEMIF_MAX_TOKENS": str(config.max_tokens),
                            "SEMIF_MAX_QUEUE": str(config.max_queue),
                            "SEMIF_QUEUE_TIMEOUT_S": str(config.queue_timeout_seconds),
                            "SEMIF_REQUEST_TIMEOUT_S": str(config.request_timeout_seconds),
                            "SEMIF_MAX_BATCH_REQUESTS": str(config.max_batch_requests),
                            "SEMIF_MAX_REQUEST_TOKENS": str(config.max_request_tokens),
                            "SEMIF_N_GPU_LAYERS": "0",
                            "SEMIF_THREADS": str(config.threads),
                            "SEMIF_WEIGHT_BUFFERS": "auto",
                            "SEMIF_KV_MEMORY": "auto",
                        }
                    )
                }
            )
        },
    )
    synth.template("gpu", "decision").has_resource_properties(
        "AWS::SageMaker::Model",
        {
            "PrimaryContainer": Match.object_like(
                {
                    "Environment": Match.object_like(
                        {"SEMIF_N_GPU_LAYERS": "-1", "SEMIF_THREADS": Match.absent()}
                    )
                }
            )
        },
    )


def test_cpu_endpoint_config_uses_one_fixed_instance(synth: Synth) -> None:
    config = ENVIRONMENTS["prod"].decision
    assert isinstance(config.placement, CpuPlacement)
    template = synth.template("prod", "decision")
    template.resource_count_is("AWS::SageMaker::EndpointConfig", 1)
    template.has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "EndpointConfigName": Match.absent(),
            "KmsKeyId": Match.any_value(),
            "ProductionVariants": [
                Match.object_like(
                    {
                        "InstanceType": config.placement.instance_type,
                        "InitialInstanceCount": config.autoscaling.min_capacity,
                        "InstancePools": Match.absent(),
                        "InferenceAmiVersion": Match.absent(),
                        "ContainerStartupHealthCheckTimeoutInSeconds": 600,
                    }
                )
            ],
        },
    )


@pytest.mark.parametrize("env", ["dev", "prod", "gpu"])
def test_decision_config_turns_detailed_observability_on(synth: Synth, env: str) -> None:
    """SageMaker scrapes the adapter's /metrics (its default path for a BYO container) and
    publishes it at the configured frequency; routing by prefix only where enabled (prod),
    elsewhere to the instance with the fewest requests in flight."""
    settings = ENVIRONMENTS[env].decision
    routing = (
        {
            "RoutingStrategy": "PREFIX_AWARE",
            "PrefixAwareRoutingConfig": {
                "PrefixLength": 1024,
                "ConcurrencyThreshold": settings.max_batch_requests,
            },
        }
        if env == "prod"
        else {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"}
    )
    synth.template(env, "decision").has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "MetricsConfig": {
                "EnableDetailedObservability": True,
                "MetricPublishFrequencyInSeconds": settings.metrics.publish_frequency_seconds,
            },
            "ProductionVariants": [Match.object_like({"RoutingConfig": routing})],
        },
    )


def test_gpu_endpoint_config_uses_ordered_instance_pools_and_the_cuda_ami(synth: Synth) -> None:
    placement = ENVIRONMENTS["gpu"].decision.placement
    assert isinstance(placement, GpuPlacement)
    template = synth.template("gpu", "decision")
    template.resource_count_is("AWS::SageMaker::EndpointConfig", 1)
    template.has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "KmsKeyId": Match.absent(),  # NVMe instance storage rejects a volume key
            "ProductionVariants": [
                Match.object_like(
                    {
                        "InstanceType": Match.absent(),
                        "InstancePools": Match.exact(
                            [
                                {"InstanceType": instance_type, "Priority": priority}
                                for priority, instance_type in enumerate(
                                    placement.instance_pools, start=1
                                )
                            ]
                        ),
                        "InferenceAmiVersion": "al2023-ami-sagemaker-inference-gpu-4-1",
                        "VariantInstanceProvisionTimeoutInSeconds": 1200,
                        "ContainerStartupHealthCheckTimeoutInSeconds": 900,
                        "ModelDataDownloadTimeoutInSeconds": 900,
                    }
                )
            ],
        },
    )


def test_decision_endpoint_name_and_outputs(synth: Synth) -> None:
    template = synth.template("dev", "decision")
    name = endpoint_name(ENVIRONMENTS["dev"], EndpointKind.DECISION)
    template.resource_count_is("AWS::SageMaker::Endpoint", 2)  # and f"{name}-async"
    template.has_resource_properties("AWS::SageMaker::Endpoint", {"EndpointName": name})
    template.has_output("DecisionEndpointName", {"Value": name})
    build_id = logical_id(template.to_json(), "Custom::DeployTimeBuild")
    template.has_output(
        "DecisionImageUri",
        {"Value": {"Fn::GetAtt": [build_id, "IMAGE_URI"]}},
    )


def test_decision_role_reads_only_its_model_and_pulls_only_its_repository(synth: Synth) -> None:
    """Of the bucket, the role reads the model object and the batch input only and writes
    only the batch output (test_offline_batches.py); the rest is the endpoint's own."""
    template = synth.template("dev", "decision")
    raw = template.to_json()
    role_policies = [
        s for logical_id, s in statements(raw) if logical_id.startswith("DecisionExecutionRole")
    ]
    written = [s["Resource"] for s in role_policies if "s3:PutObject" in as_list(s["Action"])]
    assert json.dumps(written).count("/batch/output/*") == 1
    assert json.dumps(written).count("Fn::ImportValue") == 1
    key = model_object_key(ENVIRONMENTS["dev"].model.sha256)
    (log_group_id,) = template.find_resources(
        "AWS::Logs::LogGroup",
        {"Properties": {"LogGroupName": "/aws/sagemaker/Endpoints/semif-dev-decision"}},
    )
    expected: list[dict[str, Any]] = [
        {
            "Action": "s3:GetObject",
            "Resource": Match.array_with(
                [
                    {
                        "Fn::Join": [
                            "",
                            [import_value("semif-dev-artifact", "ArtifactsBucket"), f"/{key}"],
                        ]
                    }
                ]
            ),
        },
        {
            # Reading the model, and the batch objects (GenerateDataKey: writing them).
            "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
            "Condition": Match.exact(
                {
                    "StringEquals": {
                        "kms:ViaService": {
                            "Fn::Join": ["", ["s3.us-east-1.", {"Ref": "AWS::URLSuffix"}]]
                        }
                    }
                }
            ),
            "Resource": import_value("semif-dev-artifact", "ArtifactsKey"),
        },
        {  # its own log group, and the transform jobs' streams (test_offline_batches.py)
            "Action": Match.array_with(["logs:PutLogEvents"]),
            "Resource": Match.array_with([{"Fn::GetAtt": [log_group_id, "Arn"]}]),
        },
        {
            "Action": Match.array_with(["ecr:BatchGetImage"]),
            "Resource": {
                "Fn::Join": [
                    "",
                    [
                        Match.string_like_regexp(r"^arn:aws:ecr:us-east-1:$"),
                        {"Ref": "AWS::AccountId"},
                        ":repository/",
                        import_value("semif-dev-images", "AdapterRepository"),
                    ],
                ]
            },
        },
        {  # blue/green auto-rollback reads exactly the rollback alarms as this role
            "Action": "cloudwatch:DescribeAlarms",
            "Resource": [
                {"Fn::GetAtt": [Match.string_like_regexp("^AlarmsVariant5xx"), "Arn"]},
                {"Fn::GetAtt": [Match.string_like_regexp("^SignalsLetterMass"), "Arn"]},
                {"Fn::GetAtt": [Match.string_like_regexp("^SignalsScoringSpeed"), "Arn"]},
            ],
        },
        {
            "Action": "cloudwatch:PutMetricData",
            "Condition": {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/Endpoints"}},
            "Resource": "*",
        },
    ]
    assert_role_policy_has(template, "DecisionExecutionRole", expected)


# dev scales an inference component's copies instead (tests/cdk/test_scale_to_zero.py).
@pytest.mark.parametrize("env", ["prod", "gpu"])
def test_decision_autoscaling_tracks_concurrency_below_one_batch(synth: Synth, env: str) -> None:
    settings = ENVIRONMENTS[env].decision
    scaling = settings.autoscaling
    # Below one batch per instance, so a new instance starts before requests queue for a
    # second pass, and above half of one, so one instance's batches stay full: the shipped
    # 32 requests a batch track 24.
    target = settings.target_concurrency
    assert settings.max_batch_requests / 2 < target < settings.max_batch_requests
    assert (settings.max_batch_requests, target) == (32, 24)
    template = synth.template(env, "decision")
    # dev: also the asynchronous endpoint's target, tracking and start from zero.
    extra = 1 if settings.async_endpoint else 0
    template.resource_count_is("AWS::ApplicationAutoScaling::ScalableTarget", 1 + extra)
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalableTarget",
        {
            "ResourceId": f"endpoint/semif-{env}-decision/variant/AllTraffic",
            "ScalableDimension": "sagemaker:variant:DesiredInstanceCount",
            "MinCapacity": scaling.min_capacity,
            "MaxCapacity": scaling.max_capacity,
        },
    )
    template.resource_count_is("AWS::ApplicationAutoScaling::ScalingPolicy", 1 + 2 * extra)
    template.has_resource_properties(
        "AWS::ApplicationAutoScaling::ScalingPolicy",
        {
            "TargetTrackingScalingPolicyConfiguration": Match.object_like(
                {
                    "PredefinedMetricSpecification": {
                        "PredefinedMetricType": (
                            "SageMakerVariantConcurrentRequestsPerModelHighResolution"
                        )
                    },
                    "TargetValue": target,
                }
            )
        },
    )


def _alarms(raw: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The metric alarms (the PromQL ones on the container's metrics are `_promql`'s)."""
    return [
        alarm["Properties"]
        for _, alarm in resources(raw, "AWS::CloudWatch::Alarm")
        if "EvaluationCriteria" not in alarm["Properties"]
    ]


def _promql(raw: Mapping[str, Any]) -> list[str]:
    return [
        alarm["Properties"]["EvaluationCriteria"]["PromQLCriteria"]["Query"]
        for _, alarm in resources(raw, "AWS::CloudWatch::Alarm")
        if "EvaluationCriteria" in alarm["Properties"]
    ]


@pytest.mark.parametrize("env", ["dev", "prod", "gpu"])
def test_decision_signal_alarms_read_the_containers_metrics(synth: Synth, env: str) -> None:
    """The 503 share, the seconds per decoded row and the median letter mass, from the
    adapter's /metrics as SageMaker publishes them (labelled with the endpoint's name),
    each with the environment's threshold, notifying the topic both ways."""
    from cdk_constructs.endpoint_operations import (
        letter_mass_query,
        scoring_speed_query,
        unavailable_query,
    )

    name = endpoint_name(ENVIRONMENTS[env], EndpointKind.DECISION)
    thresholds = ENVIRONMENTS[env].decision.signal_alarms
    raw = synth.raw(env, "decision")
    where = f'{{"aws.sagemaker.endpoint.name"="{name}",variant=~"AllTraffic|"}}'
    evaluated = (
        f'{{"aws.sagemaker.endpoint.name"="{name}",variant=~"AllTraffic|",source="evaluated"}}'
    )
    expected = {
        unavailable_query(name, thresholds.max_unavailable_percent): (
            f"sum (rate(semif_unavailable_total{where}[10m])) / "
            f"sum (rate(semif_requests_total{where}[10m])) > "
            f"{thresholds.max_unavailable_percent / 100:g}"
        ),
        scoring_speed_query(name, thresholds.max_ms_per_decoded_row): (
            f'sum by ("@resource.host.id") (rate(semif_pass_duration_seconds_sum{where}[10m]))'
            f' / sum by ("@resource.host.id") (rate(semif_prompt_tokens_total{evaluated}[10m]))'
            f" > {thresholds.max_ms_per_decoded_row / 1000:g}"
        ),
        letter_mass_query(name, thresholds.min_median_allowed_token_mass): (
            'histogram_quantile(0.5, sum by (le, "@resource.host.id") '
            f"(rate(semif_allowed_token_mass_bucket{where}[10m])))"
            f" < {thresholds.min_median_allowed_token_mass:g}"
        ),
    }
    assert all(query == spelled for query, spelled in expected.items())
    queries = [query for query in _promql(raw) if where in query]
    assert sorted(queries) == sorted(expected)
    for _, alarm in resources(raw, "AWS::CloudWatch::Alarm"):
        if "EvaluationCriteria" in alarm["Properties"]:
            assert alarm["Properties"]["AlarmActions"] == alarm["Properties"]["OKActions"]
            assert len(alarm["Properties"]["AlarmActions"]) == 1


def _metric_names(alarm: dict[str, Any]) -> set[str]:
    if "MetricName" in alarm:
        return {alarm["MetricName"]}
    return {
        query["MetricStat"]["Metric"]["MetricName"]
        for query in alarm["Metrics"]
        if "MetricStat" in query
    }


def test_decision_alarms_cover_5xx_and_instance_health_not_latency(synth: Synth) -> None:
    """No ModelLatency alarm: a request's queue wait (up to SEMIF_QUEUE_TIMEOUT_S) is in
    it by design; latency is on the dashboard only."""
    thresholds = ENVIRONMENTS["prod"].decision.alarms
    template = synth.template("prod", "decision")
    alarms = _alarms(template.to_json())
    assert {frozenset(_metric_names(alarm)) for alarm in alarms} == {
        frozenset({"Invocation5XXErrors", "Invocations"}),
        frozenset({"MemoryUtilization"}),
        frozenset({"DiskUtilization"}),
    }
    assert len(alarms) == 3
    template.has_resource_properties(
        "AWS::CloudWatch::Alarm",
        {
            "Metrics": Match.array_with(
                [
                    Match.object_like(
                        {
                            "MetricStat": Match.object_like(
                                {"Metric": Match.object_like({"MetricName": "Invocation5XXErrors"})}
                            )
                        }
                    )
                ]
            ),
            "Threshold": thresholds.five_xx_rate_percent,
        },
    )
    assert all(alarm["TreatMissingData"] == "notBreaching" for alarm in alarms)


def test_gpu_alarms_repeat_per_pool_instance_type(synth: Synth) -> None:
    placement = ENVIRONMENTS["gpu"].decision.placement
    assert isinstance(placement, GpuPlacement)
    template = synth.template("gpu", "decision")
    # 5XX, memory, disk and GPU memory, variant-wide and per pool type.
    assert len(_alarms(template.to_json())) == 4 * (1 + len(placement.instance_pools))
    five_xx = [
        alarm
        for alarm in _alarms(template.to_json())
        if "Invocation5XXErrors" in _metric_names(alarm)
    ]
    five_xx_types = {
        dimension["Value"]
        for alarm in five_xx
        for query in alarm["Metrics"]
        if "MetricStat" in query
        for dimension in query["MetricStat"]["Metric"]["Dimensions"]
        if dimension["Name"] == "InstanceType"
    }
    assert len(five_xx) == 1 + len(placement.instance_pools)
    assert five_xx_types == set(placement.instance_pools)


@pytest.mark.parametrize("env", ["dev", "prod", "gpu"])
def test_decision_dashboard_shows_the_endpoint_its_alarms_and_its_signals(
    synth: Synth, env: str
) -> None:
    """Named like the endpoint; SageMaker's invocation, error, latency, instance and
    concurrency metrics of this endpoint; every alarm of the stack; and the PromQL of the
    container's queue, batch fill, scoring speed, letter mass, prefix hit ratio,
    abstention rate, 429s (load) and 503s (failures) for this endpoint, the alarms' own
    expressions among them."""
    from cdk_constructs.endpoint_operations import (
        median_allowed_token_mass,
        refused_share,
        seconds_per_decoded_row,
        unavailable_share,
    )

    name = endpoint_name(ENVIRONMENTS[env], EndpointKind.DECISION)
    raw = synth.raw(env, "decision")
    body, named = dashboard_body(raw)
    assert body["name"] == name
    metrics = [
        metric
        for widget in body["widgets"]
        if widget["type"] == "metric"
        for metric in widget["properties"]["metrics"]
    ]
    graphed = {metric[1]: metric[2:6] for metric in metrics if metric[2] == "EndpointName"}
    # With scale to zero (dev), the inference component's copies, its refused calls and
    # its requests per copy, by the component's name.
    copies = {metric[1]: metric[2:4] for metric in metrics if metric[2] != "EndpointName"}
    component = ENVIRONMENTS[env].decision.scale_to_zero is not None
    copy_metrics = ("CPUUtilizationNormalized", "NoCapacityInvocationFailures")
    expected = (*copy_metrics, "ConcurrentRequestsPerCopy") if component else ()
    assert copies == {metric: ["InferenceComponentName", f"{name}-model"] for metric in expected}
    assert set(graphed) == {
        "Invocations",
        "Invocation4XXErrors",
        "Invocation5XXErrors",
        "ModelLatency",
        "CPUUtilization",
        "ConcurrentRequestsPerModel",
    }
    assert all(
        dimensions == ["EndpointName", name, "VariantName", "AllTraffic"]
        for dimensions in graphed.values()
    )
    # Every alarm of the stack (the asynchronous endpoint's too) but the scaling trigger.
    alarms = {logical for logical, _ in resources(raw, "AWS::CloudWatch::Alarm")}
    assert sorted(named) == sorted(alarms - scaling_alarms(raw))
    (text,) = (w["properties"]["markdown"] for w in body["widgets"] if w["type"] == "text")
    queries = re.findall(r"`([^`]*semif_[^`]*)`", text)
    assert len(queries) == 12
    assert all(f'"aws.sagemaker.endpoint.name"="{name}"' in query for query in queries)
    for expression in (seconds_per_decoded_row, median_allowed_token_mass):
        assert expression(name) in queries  # exactly what the rollback alarms compare
    for share in (refused_share, unavailable_share):
        assert share(name) in queries
    for needed in (
        "semif_queue_depth",
        "semif_pass_requests_sum",
        'source="reused"',
        "semif_abstentions_total",
        "sum by (cause) (rate(semif_refused_total",
        "sum by (cause) (rate(semif_unavailable_total",
    ):
        assert any(needed in query for query in queries), needed


def test_dashboard_queries_name_the_adapters_metrics() -> None:
    """Every series a dashboard query (and so an alarm) reads is one the adapter exposes (a
    renamed metric would leave an empty query behind), and every query selects one
    endpoint."""
    from adapter.metrics import Metrics
    from cdk_constructs.endpoint_dashboard import decision_queries

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exposed = {
        family.name + suffix
        for family in Metrics().registry.collect()
        for suffix in suffixes[family.type]
    }
    queries = decision_queries("semif-x-decision")
    read = {name for query in queries.values() for name in re.findall(r"semif_\w+", query)}
    assert read - exposed == set()
    assert all(
        query.count('"aws.sagemaker.endpoint.name"="semif-x-decision"') == query.count("semif_")
        for query in queries.values()
    )
