"""The two endpoint stacks: the decision endpoint (our adapter image) and the standard one.

Both read the same `model.tar.gz` from the artifact stack by its content-addressed key.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from cdk_constructs.deploy_time_build import DeployTimeBuild
from cdk_constructs.endpoint_operations import EndpointAlarms, EndpointAutoscaling
from cdk_constructs.image_build import IMAGE_URI_VARIABLE, ImageBuildProject
from cdk_constructs.sagemaker_endpoint import SageMakerEndpoint
from stacks.config import (
    CpuPlacement,
    DecisionEndpointSettings,
    GpuPlacement,
    NetworkSettings,
    StandardEndpointSettings,
)


def standard_environment(settings: StandardEndpointSettings) -> dict[str, str]:
    """The DLC turns each `SM_LLAMA_CPP_FOO_BAR` into llama-server's `--foo-bar`."""
    return {
        "SM_LLAMA_CPP_CTX_SIZE": str(settings.context_size),
        "SM_LLAMA_CPP_THREADS": str(settings.threads),
        "SM_LLAMA_CPP_N_GPU_LAYERS": str(settings.gpu_layers),
    }


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
        bucket: s3.IBucket,
        key: kms.IKey,
        object_key: str,
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
            bucket=bucket,
            object_key=object_key,
            key=key,
            environment=settings.container_environment(),
            placement=settings.placement,
            initial_instance_count=settings.autoscaling.min_capacity,
            startup_timeout_seconds=settings.startup_timeout_seconds,
            network=network,
            removal_policy=removal_policy,
        )
        EndpointAutoscaling(self, "Scaling", endpoint=self.endpoint, settings=settings.autoscaling)
        pools = (
            settings.placement.instance_pools
            if isinstance(settings.placement, GpuPlacement)
            else ()
        )
        EndpointAlarms(
            self,
            "Alarms",
            endpoint=self.endpoint,
            thresholds=settings.alarms,
            instance_types=pools,
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
        bucket: s3.IBucket,
        key: kms.IKey,
        object_key: str,
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
            bucket=bucket,
            object_key=object_key,
            key=key,
            environment=standard_environment(settings),
            placement=CpuPlacement(instance_type=settings.instance_type, threads=settings.threads),
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
