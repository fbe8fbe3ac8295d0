"""The standard stack: the published CPU DLC (from the private mirror) on CPU instances."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from aws_cdk.assertions import Match, Template

from cdk_constructs.endpoint_dashboard import standard_queries
from stacks.config import EndpointKind
from stacks.environments import ENVIRONMENTS
from tests.support.templates import Synth, dashboard_body, resources, synthesize_environment


def test_standard_endpoint_serves_the_published_dlc_by_digest(synth: Synth) -> None:
    config = ENVIRONMENTS["dev"]
    template = synth.template("dev", "standard")
    digest = config.dlc_images.cpu.rsplit("@", 1)[1]
    mirrored = {
        "Fn::Join": [
            "",
            [
                {"Ref": "AWS::AccountId"},
                ".dkr.ecr.",
                {"Ref": "AWS::Region"},
                ".",
                {"Ref": "AWS::URLSuffix"},
                f"/semif-dev/llama-cpp-dlc@{digest}",
            ],
        ]
    }
    template.resource_count_is("AWS::SageMaker::Model", 1)
    template.has_resource_properties(
        "AWS::SageMaker::Model",
        {
            "EnableNetworkIsolation": True,
            "PrimaryContainer": Match.object_like(
                {
                    "Image": mirrored,  # the pinned public digest, copied to private ECR
                    "Environment": Match.exact(
                        {
                            "SM_LLAMA_CPP_CTX_SIZE": str(config.standard.context_size),
                            "SM_LLAMA_CPP_THREADS": str(config.standard.threads),
                            "SM_LLAMA_CPP_N_GPU_LAYERS": "0",
                            "SM_LLAMA_CPP_METRICS": "true",  # llama-server's --metrics
                        }
                    ),
                }
            ),
        },
    )
    template.resource_count_is("AWS::SageMaker::EndpointConfig", 1)
    template.has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "MetricsConfig": {
                "EnableDetailedObservability": True,
                "MetricPublishFrequencyInSeconds": 60,
            },
            "ProductionVariants": [
                Match.object_like(
                    {
                        "InstanceType": config.standard.placement.instance_type,
                        "InstancePools": Match.absent(),
                        "RoutingConfig": {"RoutingStrategy": "LEAST_OUTSTANDING_REQUESTS"},
                    }
                )
            ],
        },
    )
    template.resource_count_is("AWS::SageMaker::Endpoint", 1)
    template.has_resource_properties(
        "AWS::SageMaker::Endpoint", {"EndpointName": "semif-dev-standard"}
    )
    template.has_output("StandardImageUri", {"Value": mirrored})
    template.resource_count_is("AWS::CloudWatch::Alarm", 3)  # 5XX rate, memory, disk


def test_standard_endpoint_takes_its_instance_count_and_startup_timeout_from_settings(
    tmp_path: Path,
) -> None:
    """Values other than the shipped defaults reach the variant: none is fixed in the stack."""
    config = ENVIRONMENTS["dev"]
    standard = dataclasses.replace(
        config.standard, initial_instance_count=3, startup_timeout_seconds=1200
    )
    changed = dataclasses.replace(
        config, standard=standard, endpoints=frozenset({EndpointKind.STANDARD})
    )
    assembly = synthesize_environment(changed, tmp_path)
    template = Template.from_json(assembly.get_stack_by_name("semif-dev-standard").template)
    template.has_resource_properties(
        "AWS::SageMaker::EndpointConfig",
        {
            "ProductionVariants": [
                Match.object_like(
                    {
                        "InitialInstanceCount": 3,
                        "ContainerStartupHealthCheckTimeoutInSeconds": 1200,
                        "ModelDataDownloadTimeoutInSeconds": 1200,
                    }
                )
            ]
        },
    )


def test_standard_stack_waits_for_the_mirror(synth: Synth) -> None:
    manifest = json.loads((synth.outdir / "manifest.json").read_text())
    dependencies = manifest["artifacts"]["semif-dev-standard"]["dependencies"]
    assert "semif-dev-images" in dependencies


def test_standard_dashboard_shows_llama_servers_own_metrics(synth: Synth) -> None:
    """Named like the endpoint, its alarms' states, SageMaker's graphs of it, and PromQL
    for llama-server's slots and token speeds (`llamacpp:*`), each selecting it."""
    raw = synth.raw("dev", "standard")
    body, named = dashboard_body(raw)
    assert body["name"] == "semif-dev-standard"
    assert sorted(named) == sorted(name for name, _ in resources(raw, "AWS::CloudWatch::Alarm"))
    graphed = {
        tuple(metric[1:6])
        for widget in body["widgets"]
        if widget["type"] == "metric"
        for metric in widget["properties"]["metrics"]
    }
    assert (
        "Invocation5XXErrors",
        "EndpointName",
        "semif-dev-standard",
        "VariantName",
        "AllTraffic",
    ) in graphed
    (text,) = (w["properties"]["markdown"] for w in body["widgets"] if w["type"] == "text")
    queries = re.findall(r"^- \*\*[^*]+\*\*: `(.*)`$", text, re.MULTILINE)
    assert queries == list(standard_queries("semif-dev-standard").values())
    read = {name for query in queries for name in re.findall(r"llamacpp:\w+", query)}
    assert read == {
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:prompt_tokens_total",
        "llamacpp:prompt_seconds_total",
        "llamacpp:tokens_predicted_total",
        "llamacpp:tokens_predicted_seconds_total",
    }
    assert all('"aws.sagemaker.endpoint.name"="semif-dev-standard"' in query for query in queries)
