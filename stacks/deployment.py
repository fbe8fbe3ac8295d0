"""Assemble one environment's stacks from its config: the only place config meets CDK."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import aws_cdk as cdk
from aws_cdk import RemovalPolicy, Tags
from constructs import Construct

from cdk_constructs.image_build import ImageFlavor
from stacks.artifact_stack import ArtifactStack
from stacks.config import EndpointKind, EnvironmentConfig
from stacks.endpoint_stacks import DecisionEndpointStack, StandardEndpointStack
from stacks.images_stack import ImagesStack


@dataclass(frozen=True)
class Deployment:
    """The stacks of one environment (absent ones are None)."""

    artifact: ArtifactStack
    images: ImagesStack | None
    decision: DecisionEndpointStack | None
    standard: StandardEndpointStack | None

    @property
    def stacks(self) -> list[cdk.Stack]:
        return [s for s in (self.artifact, self.images, self.decision, self.standard) if s]


def stack_name(config: EnvironmentConfig, unit: str) -> str:
    return f"semif-{config.name}-{unit}"


def endpoint_name(config: EnvironmentConfig, kind: EndpointKind) -> str:
    return f"semif-{config.name}-{kind.value}"


def add_environment(scope: Construct, config: EnvironmentConfig, repo_root: Path) -> Deployment:
    """Create the stacks `config` asks for, wired by typed props only."""
    env = cdk.Environment(account=config.account, region=config.region)
    removal = RemovalPolicy.RETAIN if config.retain_data else RemovalPolicy.DESTROY
    artifact = ArtifactStack(
        scope,
        stack_name(config, "artifact"),
        env=env,
        description=f"semif {config.name}: model bucket and model build",
        repo_root=repo_root,
        model=config.model,
        removal_policy=removal,
    )
    model = artifact.model_artifact  # what both endpoint stacks serve
    images = decision = standard = None
    if config.deploys(EndpointKind.DECISION):
        flavor = ImageFlavor.CUDA if config.decision.uses_gpu else ImageFlavor.CPU
        images = ImagesStack(
            scope,
            stack_name(config, "images"),
            env=env,
            description=f"semif {config.name}: adapter image repository and build",
            repo_root=repo_root,
            flavor=flavor,
            base_image=config.dlc_images.cuda if flavor.gpu else config.dlc_images.cpu,
            removal_policy=removal,
        )
        decision = DecisionEndpointStack(
            scope,
            stack_name(config, "decision"),
            env=env,
            description=f"semif {config.name}: decision endpoint",
            endpoint_name=endpoint_name(config, EndpointKind.DECISION),
            settings=config.decision,
            image_build=images.image_build,
            repository=images.repository,
            model=model,
            network=config.network,
            removal_policy=removal,
        )
    if config.deploys(EndpointKind.STANDARD):
        standard = StandardEndpointStack(
            scope,
            stack_name(config, "standard"),
            env=env,
            description=f"semif {config.name}: standard llama.cpp DLC endpoint",
            endpoint_name=endpoint_name(config, EndpointKind.STANDARD),
            settings=config.standard,
            image_uri=config.dlc_images.cpu,
            model=model,
            network=config.network,
            removal_policy=removal,
        )
    deployment = Deployment(artifact=artifact, images=images, decision=decision, standard=standard)
    for stack in deployment.stacks:
        for name, value in config.tags.items():
            Tags.of(stack).add(name, value)
    return deployment
