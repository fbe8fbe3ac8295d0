"""The standard stack: the published CPU DLC (from the private mirror) on one instance."""

from __future__ import annotations

import json

from aws_cdk.assertions import Match

from stacks.environments import ENVIRONMENTS
from tests.cdk.support import Synth, resources


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
            "ProductionVariants": [
                Match.object_like(
                    {
                        "InstanceType": config.standard.placement.instance_type,
                        "InstancePools": Match.absent(),
                    }
                )
            ]
        },
    )
    template.resource_count_is("AWS::SageMaker::Endpoint", 1)
    template.has_resource_properties(
        "AWS::SageMaker::Endpoint", {"EndpointName": "semif-dev-standard"}
    )
    template.has_output("StandardImageUri", {"Value": mirrored})
    template.resource_count_is("AWS::CloudWatch::Alarm", 4)


def test_standard_stack_waits_for_the_mirror(synth: Synth) -> None:
    manifest = json.loads((synth.outdir / "manifest.json").read_text())
    dependencies = manifest["artifacts"]["semif-dev-standard"]["dependencies"]
    assert "semif-dev-images" in dependencies


def test_only_the_decision_endpoint_has_a_dashboard(synth: Synth) -> None:
    """The standard endpoint serves the DLC's own metrics; the dashboard reads the adapter's."""
    assert not list(resources(synth.raw("dev", "standard"), "AWS::CloudWatch::Dashboard"))
