"""The two endpoint stacks: the decision endpoint (our adapter image) and the standard one.

Both serve the same `model.tar.gz`: the artifact stack's `ModelArtifact`.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from aws_cdk import aws_ecr as ecr
from constructs import Construct

from cdk_constructs.deploy_time_build import DeployTimeBuild
from cdk_constructs.endpoint_operations import EndpointAlarms, EndpointAutoscaling
from cdk_constructs.image_build import IMAGE_URI_VARIABLE, ImageBuildProject
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.sagemaker_endpoint import NetworkSettings, SageMakerEndpoint
from stacks.config import DecisionEndpointSettings, StandardEndpointSettings


class DecisionEndpointStack(Stack):
    """Build the adapter image (deploy time), then serve it by digest with scaling and alarms."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        settings: DecisionEndpointSettings,
        image_build: ImageBuildProject,
        repository: ecr.IRepository,
        model: ModelArtifact,
        network: NetworkSettings | None,
        removal_policy: RemovalPolicy,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.image = DeployTimeBuild(
            self,
            "ImageBuild",
            project=image_build.project,
            trigger=image_build.image_tag,
            output_variables=[IMAGE_URI_VARIABLE],
        )
        self.endpoint = SageMakerEndpoint(
            self,
            "Decision",
            endpoint_name=endpoint_name,
            image_uri=self.image.output(IMAGE_URI_VARIABLE),
            repository=repository,
            model=model,
            environment=settings.container_environment(),
            placement=settings.placement,
            initial_instance_count=settings.autoscaling.min_capacity,
            startup_timeout_seconds=settings.startup_timeout_seconds,
            network=network,
            removal_policy=removal_policy,
        )
        EndpointAutoscaling(self, "Scaling", endpoint=self.endpoint, settings=settings.autoscaling)
        EndpointAlarms(
            self,
            "Alarms",
            endpoint=self.endpoint,
            thresholds=settings.alarms,
            instance_types=settings.instance_pools,
        )
        _outputs(self, "Decision", self.endpoint)


class StandardEndpointStack(Stack):
    """The published CPU DLC (chat completions) on one fixed CPU instance."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        settings: StandardEndpointSettings,
        image_uri: str,
        model: ModelArtifact,
        network: NetworkSettings | None,
        removal_policy: RemovalPolicy,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.endpoint = SageMakerEndpoint(
            self,
            "Standard",
            endpoint_name=endpoint_name,
            image_uri=image_uri,
            repository=None,
            model=model,
            environment=settings.container_environment(),
            placement=settings.placement,
            initial_instance_count=1,
            startup_timeout_seconds=600,
            network=network,
            removal_policy=removal_policy,
        )
        EndpointAlarms(self, "Alarms", endpoint=self.endpoint, thresholds=settings.alarms)
        _outputs(self, "Standard", self.endpoint)


def _outputs(stack: Stack, kind: str, endpoint: SageMakerEndpoint) -> None:
    CfnOutput(stack, f"{kind}EndpointName", value=endpoint.endpoint_name)
    CfnOutput(stack, f"{kind}ImageUri", value=endpoint.image_uri)
