"""The standard stack: the published CPU DLC on one instance, and VPC settings of both models."""

from __future__ import annotations

from aws_cdk.assertions import Match

from stacks.environments import ENVIRONMENTS
from tests.cdk.support import Synth, as_list, statements


def test_standard_endpoint_serves_the_published_dlc_by_digest(synth: Synth) -> None:
    config = ENVIRONMENTS["dev"]
    template = synth.template("dev", "standard")
    template.resource_count_is("AWS::SageMaker::Model", 1)
    template.has_resource_properties(
        "AWS::SageMaker::Model",
        {
            "EnableNetworkIsolation": True,
            "PrimaryContainer": Match.object_like(
                {
                    "Image": config.dlc_images.cpu,
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
    template.has_output("StandardImageUri", {"Value": config.dlc_images.cpu})
    actions = {a for _, s in statements(template.to_json()) for a in as_list(s["Action"])}
    assert not any(action.startswith("ecr:") for action in actions)
    template.resource_count_is("AWS::CloudWatch::Alarm", 4)


def test_vpc_settings_reach_both_models(synth: Synth) -> None:
    network = ENVIRONMENTS["gpu"].network
    assert network is not None
    for unit in ("decision", "standard"):
        synth.template("gpu", unit).has_resource_properties(
            "AWS::SageMaker::Model",
            {
                "VpcConfig": Match.exact(
                    {
                        "SecurityGroupIds": list(network.security_group_ids),
                        "Subnets": list(network.subnet_ids),
                    }
                )
            },
        )
    synth.template("dev", "standard").has_resource_properties(
        "AWS::SageMaker::Model", {"VpcConfig": Match.absent()}
    )
