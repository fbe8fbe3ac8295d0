"""The two endpoint stacks: the decision endpoint (our adapter image) and the standard one.

Both serve the same `model.tar.gz` (the artifact stack's `ModelArtifact`), both pull from
private ECR by digest, both alarm to the environment's topic, roll updates out blue/green
with automatic rollback on their 5XX and latency alarms, and end every deploy that changes
them with one real invocation (`EndpointCheck`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, Stack
from aws_cdk import aws_sns as sns
from constructs import Construct

from cdk_constructs.container_image import EcrImage
from cdk_constructs.deploy_time_build import DeployTimeBuild
from cdk_constructs.endpoint_check import EndpointCheck, Probe
from cdk_constructs.endpoint_dashboard import DecisionDashboard
from cdk_constructs.endpoint_operations import (
    DecisionSignalAlarms,
    EndpointAlarms,
    EndpointAutoscaling,
)
from cdk_constructs.image_build import (
    IMAGE_DIGEST_VARIABLE,
    IMAGE_URI_VARIABLE,
    ImageBuildProject,
)
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.sagemaker_endpoint import NetworkSettings, SageMakerEndpoint
from stacks.config import DecisionEndpointSettings, StandardEndpointSettings


class DecisionEndpointStack(Stack):
    """Build the adapter image (deploy time), then serve it by digest with scaling, alarms
    and a dashboard."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        settings: DecisionEndpointSettings,
        image_build: ImageBuildProject,
        model: ModelArtifact,
        network: NetworkSettings | None,
        alarm_topic: sns.ITopic,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.image = DeployTimeBuild(
            self,
            "ImageBuild",
            project=image_build.project,
            trigger=image_build.image_tag,
            log_key=model.key,
            output_variables=[IMAGE_URI_VARIABLE, IMAGE_DIGEST_VARIABLE],
        )
        alarms = EndpointAlarms(
            self,
            "Alarms",
            endpoint_name=endpoint_name,
            thresholds=settings.alarms,
            topic=alarm_topic,
            gpu=settings.uses_gpu,
            instance_types=settings.instance_pools,
        )
        self.endpoint = SageMakerEndpoint(
            self,
            "Decision",
            endpoint_name=endpoint_name,
            image=EcrImage(
                repository_name=image_build.repository.repository_name,
                digest=self.image.output(IMAGE_DIGEST_VARIABLE),
            ),
            model=model,
            environment=settings.container_environment(),
            placement=settings.placement,
            initial_instance_count=settings.autoscaling.min_capacity,
            startup_timeout_seconds=settings.startup_timeout_seconds,
            network=network,
            rollout=settings.rollout,
            rollback_alarms=alarms.rollback_alarms,
            log_key=model.key,
            observability=settings.metrics,
            routing=settings.routing,
        )
        EndpointAutoscaling(
            self,
            "Scaling",
            endpoint=self.endpoint,
            settings=settings.autoscaling,
            target_concurrency=settings.target_concurrency,
        )
        signals = DecisionSignalAlarms(
            self,
            "Signals",
            endpoint_name=endpoint_name,
            thresholds=settings.signal_alarms,
            topic=alarm_topic,
        )
        DecisionDashboard(
            self,
            "Dashboard",
            endpoint_name=endpoint_name,
            alarms=[*alarms.alarms, *signals.alarms],
        )
        self.check = EndpointCheck(
            self,
            "Check",
            endpoint=self.endpoint,
            probe=Probe.DECISION,
            body=check_body(Probe.DECISION),
            log_key=model.key,
        )
        # The build's own IMAGE_URI: the same image, without an output of an import.
        _outputs(self, "Decision", self.endpoint, self.check, self.image.output(IMAGE_URI_VARIABLE))


class StandardEndpointStack(Stack):
    """The published CPU DLC (chat completions, from the private mirror) on one CPU instance."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint_name: str,
        settings: StandardEndpointSettings,
        image: EcrImage,
        model: ModelArtifact,
        network: NetworkSettings | None,
        alarm_topic: sns.ITopic,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        alarms = EndpointAlarms(
            self,
            "Alarms",
            endpoint_name=endpoint_name,
            thresholds=settings.alarms,
            topic=alarm_topic,
        )
        self.endpoint = SageMakerEndpoint(
            self,
            "Standard",
            endpoint_name=endpoint_name,
            image=image,
            model=model,
            environment=settings.container_environment(),
            placement=settings.placement,
            initial_instance_count=1,
            startup_timeout_seconds=600,
            network=network,
            rollout=settings.rollout,
            rollback_alarms=alarms.rollback_alarms,
            log_key=model.key,
        )
        self.check = EndpointCheck(
            self,
            "Check",
            endpoint=self.endpoint,
            probe=Probe.CHAT,
            body=check_body(Probe.CHAT),
            log_key=model.key,
        )
        _outputs(self, "Standard", self.endpoint, self.check, self.endpoint.image_uri)


# The requests `semif check` sends (client/examples/check-*.json): one definition for the
# deploy's check and the shell's, read as data so the stacks do not import the client.
_CHECK_BODIES = Path(__file__).resolve().parents[1] / "client" / "examples"


def check_body(probe: Probe) -> dict[str, Any]:
    """The request the check of `probe`'s kind sends."""
    path = _CHECK_BODIES / f"check-{probe.value}.json"
    body: dict[str, Any] = json.loads(path.read_text())
    return body


def _outputs(
    stack: Stack, kind: str, endpoint: SageMakerEndpoint, check: EndpointCheck, image_uri: str
) -> None:
    CfnOutput(stack, f"{kind}EndpointName", value=endpoint.endpoint_name)
    CfnOutput(stack, f"{kind}ImageUri", value=image_uri)
    CfnOutput(
        stack,
        f"{kind}CheckResult",
        value=check.result,
        description="what the post-deploy invocation answered",
    )
