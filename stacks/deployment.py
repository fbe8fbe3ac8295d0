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
    images: ImagesStack
    decision: DecisionEndpointStack | None
    standard: StandardEndpointStack | None

    @property
    def stacks(self) -> list[cdk.Stack]:
        return [s for s in (self.artifact, self.images, self.decision, self.standard) if s]


def stack_name(config: EnvironmentConfig, unit: str) -> str:
    return f"semif-{config.name}-{unit}"


def endpoint_name(config: EnvironmentConfig, kind: EndpointKind) -> str:
    return f"semif-{config.name}-{kind.value}"


def mirror_repository_name(config: EnvironmentConfig) -> str:
    """The DLC mirror's fixed ECR repository name (never retained, see DlcMirror)."""
    return f"semif-{config.name}/llama-cpp-dlc"


def add_environment(scope: Construct, config: EnvironmentConfig, repo_root: Path) -> Deployment:
    """Create the stacks `config` asks for, wired by typed props only.

    `config.account` None makes every stack environment-agnostic in the account (the
    deploy's credentials decide it); the region is always the config's resolved one.
    """
    env = cdk.Environment(account=config.account, region=config.region)
    removal = RemovalPolicy.RETAIN if config.retain_data else RemovalPolicy.DESTROY
    candidate = config.decision.candidate if config.deploys(EndpointKind.DECISION) else None
    artifact = ArtifactStack(
        scope,
        stack_name(config, "artifact"),
        env=env,
        description=f"semif {config.name}: environment key, model bucket, model build, alarm topic",
        repo_root=repo_root,
        model=config.model,
        notifications=config.notifications,
        removal_policy=removal,
        candidate=None if candidate is None else candidate.model,
    )
    model = artifact.model_artifact  # what both endpoint stacks serve
    decision_flavor = None
    if config.deploys(EndpointKind.DECISION):
        decision_flavor = ImageFlavor.CUDA if config.decision.uses_gpu else ImageFlavor.CPU
    dlc_images = {}
    if config.deploys(EndpointKind.STANDARD) or decision_flavor is ImageFlavor.CPU:
        dlc_images[ImageFlavor.CPU.label] = config.dlc_images.cpu
    if decision_flavor is ImageFlavor.CUDA:
        dlc_images[ImageFlavor.CUDA.label] = config.dlc_images.cuda
    # What SageMaker serves directly (not as a base image): the standard endpoint's CPU DLC.
    served: dict[str, str | None] = {}
    if config.deploys(EndpointKind.STANDARD):
        served[ImageFlavor.CPU.label] = config.dlc_images.cpu_served_digest
    images = ImagesStack(
        scope,
        stack_name(config, "images"),
        env=env,
        description=f"semif {config.name}: DLC mirror, adapter image repository and build",
        repo_root=repo_root,
        mirror_repository_name=mirror_repository_name(config),
        dlc_images=dlc_images,
        served_dlc_images=served,
        adapter_flavor=decision_flavor,
        removal_policy=removal,
    )
    decision = standard = None
    if images.image_build is not None:
        decision = DecisionEndpointStack(
            scope,
            stack_name(config, "decision"),
            env=env,
            description=f"semif {config.name}: decision endpoint",
            endpoint_name=endpoint_name(config, EndpointKind.DECISION),
            settings=config.decision,
            image_build=images.image_build,
            model=model,
            candidate_model=artifact.candidate_artifact,
            network=config.network,
            alarm_topic=artifact.alarm_topic,
        )
    if config.deploys(EndpointKind.STANDARD):
        standard = StandardEndpointStack(
            scope,
            stack_name(config, "standard"),
            env=env,
            description=f"semif {config.name}: standard llama.cpp DLC endpoint",
            endpoint_name=endpoint_name(config, EndpointKind.STANDARD),
            settings=config.standard,
            image=images.mirror.image(ImageFlavor.CPU.label),
            model=model,
            network=config.network,
            alarm_topic=artifact.alarm_topic,
        )
        # The image is named from pseudo parameters, not imported: wait for the mirror copy.
        standard.add_stack_dependency(images)
    deployment = Deployment(artifact=artifact, images=images, decision=decision, standard=standard)
    for stack in deployment.stacks:
        for name, value in config.tags.items():
            Tags.of(stack).add(name, value)
    return deployment
