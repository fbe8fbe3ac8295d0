"""The two endpoint stacks: the decision endpoint (our adapter image) and the standard one.

Both serve the same `model.tar.gz` (the artifact stack's `ModelArtifact`), both pull from
private ECR by digest, both publish their container's metrics (detailed observability) to
a dashboard of their own, both alarm to the environment's topic, roll updates out
blue/green with automatic rollback on failures and model regressions (never on load or
latency), and end every deploy that changes them with one real invocation
(`EndpointCheck`). The decision stack also serves offline batches: transform jobs on its
model (`batch/` in the artifact bucket) and, where the environment asks, an asynchronous
endpoint that scales to zero (`async/`); and, where it names one, a candidate as the
real-time endpoint's shadow variant. Where the environment asks (`scale_to_zero`), the
decision model runs as an inference component whose copies, and so the endpoint's
instances, scale to zero when idle.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, Stack
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_sns as sns
from constructs import Construct

from cdk_constructs.alarm_topic import encrypted_topic
from cdk_constructs.container_image import EcrImage
from cdk_constructs.deploy_time_build import DeployTimeBuild
from cdk_constructs.endpoint_check import EndpointCheck, Probe
from cdk_constructs.endpoint_dashboard import (
    EndpointDashboard,
    decision_queries,
    standard_queries,
)
from cdk_constructs.endpoint_operations import (
    AsyncEndpointAlarms,
    AsyncEndpointAutoscaling,
    DecisionSignalAlarms,
    EndpointAlarms,
    EndpointAutoscaling,
    InferenceComponentAutoscaling,
)
from cdk_constructs.endpoint_props import (
    AsyncInference,
    GpuPlacement,
    NetworkSettings,
    ShadowVariant,
)
from cdk_constructs.image_build import (
    IMAGE_DIGEST_VARIABLE,
    IMAGE_URI_VARIABLE,
    ImageBuildProject,
)
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.sagemaker_endpoint import SageMakerEndpoint
from cdk_constructs.validation import require
from stacks.config import (
    ALL_AT_ONCE,
    CANDIDATE_VARIANT,
    DecisionEndpointSettings,
    StandardEndpointSettings,
)

# Where offline requests and answers live in the artifact bucket, beside the models: the
# decision model's role may read and write exactly these prefixes.
BATCH_INPUT_PREFIX = "batch/input/"
BATCH_OUTPUT_PREFIX = "batch/output/"
ASYNC_INPUT_PREFIX = "async/input/"
ASYNC_OUTPUT_PREFIX = "async/output/"
ASYNC_FAILURE_PREFIX = "async/failure/"
ASYNC_SUFFIX = "-async"
# The decision model's inference component (with `scale_to_zero`): a fixed name, which
# callers send as InvokeEndpoint's InferenceComponentName and alarms and scaling name.
COMPONENT_SUFFIX = "-model"


class DecisionEndpointStack(Stack):
    """Build the adapter image (deploy time), then serve it by digest with scaling, alarms
    and a dashboard; open its model to batch transform jobs, and add the asynchronous
    endpoint when `settings.async_endpoint` is set.

    The rollback alarms are the 5XX rate (per pool type with GPU pools) and the PromQL
    `ScoringSpeed` and `LetterMass`: failures and model regressions. Load (429s) and
    latency page no one and roll nothing back; the dashboard shows them.

    `settings.candidate` (served from `candidate_model`) becomes the endpoint's shadow
    variant, with alarms of its own on its variant's metrics (`CandidateAlarms`: 5XX rate,
    latency, instance health) that page and are never rollback alarms: a failing
    candidate must not roll back the decision endpoint.

    `settings.scale_to_zero` serves the model as the inference component
    `<endpoint>-model` instead (`InferenceComponentAutoscaling`: copies from zero, the
    instances following, on the CPU instance or the GPU pools): the same rollback alarms
    then watch the component's rolling updates, its 5XX rate read from the component's
    metrics (per pool type with pools); a wake-up that does not come pages; the dashboard
    shows the copies; an output names the component for callers."""

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
        candidate_model: ModelArtifact | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        require(
            (settings.candidate is None) == (candidate_model is None),
            f"{endpoint_name}: decision.candidate and its built model go together",
        )
        self.image = DeployTimeBuild(
            self,
            "ImageBuild",
            project=image_build.project,
            trigger=image_build.image_tag,
            log_key=model.key,
            output_variables=[IMAGE_URI_VARIABLE, IMAGE_DIGEST_VARIABLE],
        )
        hosting = (
            None
            if settings.scale_to_zero is None
            else settings.inference_component_hosting(f"{endpoint_name}{COMPONENT_SUFFIX}")
        )
        component_name = None if hosting is None else hosting.component_name
        alarms = EndpointAlarms(
            self,
            "Alarms",
            endpoint_name=endpoint_name,
            thresholds=settings.alarms,
            topic=alarm_topic,
            gpu=settings.uses_gpu,
            instance_types=settings.instance_pools,
            inference_component_name=component_name,
        )
        signals = DecisionSignalAlarms(
            self,
            "Signals",
            endpoint_name=endpoint_name,
            thresholds=settings.signal_alarms,
            topic=alarm_topic,
        )
        image = EcrImage(
            repository_name=image_build.repository.repository_name,
            digest=self.image.output(IMAGE_DIGEST_VARIABLE),
        )
        shadow, candidate_alarms = self._candidate(
            endpoint_name, settings, candidate_model, alarm_topic
        )
        self.endpoint = SageMakerEndpoint(
            self,
            "Decision",
            endpoint_name=endpoint_name,
            image=image,
            model=model,
            environment=settings.container_environment(),
            placement=settings.placement,
            initial_instance_count=settings.autoscaling.min_capacity,
            startup_timeout_seconds=settings.startup_timeout_seconds,
            network=network,
            rollout=settings.rollout,
            rollback_alarms=[*alarms.rollback_alarms, *signals.rollback_alarms],
            log_key=model.key,
            observability=settings.metrics,
            routing=settings.routing,
            shadow=shadow,
            inference_component=hosting,
        )
        scaling_alarms = self._scaling(settings, alarm_topic)
        self.endpoint.role.allow_batch_transform(
            input_prefix=BATCH_INPUT_PREFIX, output_prefix=BATCH_OUTPUT_PREFIX
        )
        self.async_endpoint: SageMakerEndpoint | None = None
        async_alarms: list[cloudwatch.AlarmBase] = []
        if settings.async_endpoint is not None:
            self.async_endpoint, async_alarms = self._add_async_endpoint(
                endpoint_name=f"{endpoint_name}{ASYNC_SUFFIX}",
                settings=settings,
                image=image,
                model=model,
                network=network,
                alarm_topic=alarm_topic,
            )
        EndpointDashboard(
            self,
            "Dashboard",
            endpoint_name=endpoint_name,
            alarms=[
                *alarms.alarms,
                *signals.alarms,
                *scaling_alarms,
                *candidate_alarms,
                *async_alarms,
            ],
            queries=decision_queries(endpoint_name),
            inference_component_name=component_name,
            instance_types=settings.instance_pools,
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
        if component_name is not None:
            CfnOutput(
                self,
                "DecisionInferenceComponentName",
                value=component_name,
                description="send it as InvokeEndpoint's InferenceComponentName; at zero "
                "copies a call is refused and starts one",
            )
        self._batch_outputs(model)

    def _scaling(
        self, settings: DecisionEndpointSettings, alarm_topic: sns.ITopic
    ) -> list[cloudwatch.Alarm]:
        """The variant's instances between the autoscaling bounds, or (scale to zero) the
        inference component's copies between zero and the upper bound; the alarms that
        scaling adds (a wake-up that does not come)."""
        if settings.scale_to_zero is None:
            EndpointAutoscaling(
                self,
                "Scaling",
                endpoint=self.endpoint,
                settings=settings.autoscaling,
                target_concurrency=settings.target_concurrency,
            )
            return []
        scaling = InferenceComponentAutoscaling(
            self,
            "Scaling",
            endpoint=self.endpoint,
            settings=settings.scale_to_zero,
            max_copies=settings.autoscaling.max_capacity,
            target_concurrency=settings.target_concurrency,
            startup_seconds=settings.startup_timeout_seconds,
            topic=alarm_topic,
            provision_seconds=settings.placement.provision_timeout_seconds
            if isinstance(settings.placement, GpuPlacement)
            else 0,
        )
        return scaling.alarms

    def _candidate(
        self,
        endpoint_name: str,
        settings: DecisionEndpointSettings,
        model: ModelArtifact | None,
        alarm_topic: sns.ITopic,
    ) -> tuple[ShadowVariant | None, list[cloudwatch.Alarm]]:
        """The candidate's shadow variant and its own alarms (none without a candidate)."""
        candidate = settings.candidate
        if candidate is None or model is None:
            return None, []
        placement = settings.candidate_placement
        alarms = EndpointAlarms(
            self,
            "CandidateAlarms",
            endpoint_name=endpoint_name,
            thresholds=candidate.alarms,
            topic=alarm_topic,
            gpu=settings.uses_gpu,
            instance_types=placement.instance_pools if isinstance(placement, GpuPlacement) else (),
            variant_name=CANDIDATE_VARIANT,
            max_latency_seconds=settings.candidate_latency_alarm_seconds,
        )
        shadow = ShadowVariant(
            variant_name=CANDIDATE_VARIANT,
            model=model,
            environment=settings.candidate_container_environment(),
            placement=placement,
            instance_count=candidate.instance_count,
            sampling_percentage=candidate.sampling_percentage,
        )
        return shadow, alarms.alarms

    def _batch_outputs(self, model: ModelArtifact) -> None:
        """What `semif batch submit` needs: the model a transform job runs (the current
        one: a blue/green update that replaces the model changes this output too), where
        its input and output go, and the key both are encrypted with."""
        CfnOutput(
            self,
            "DecisionModelName",
            value=self.endpoint.model.attr_model_name,
            description="the decision endpoint's current SageMaker model; batch transform "
            "jobs run on it",
        )
        CfnOutput(self, "BatchInputPrefix", value=model.s3_uri(BATCH_INPUT_PREFIX))
        CfnOutput(self, "BatchOutputPrefix", value=model.s3_uri(BATCH_OUTPUT_PREFIX))
        CfnOutput(
            self,
            "ArtifactKeyArn",
            value=model.key.key_arn,
            description="the KMS key of the artifact bucket (transform output KmsKeyId)",
        )

    def _add_async_endpoint(
        self,
        *,
        endpoint_name: str,
        settings: DecisionEndpointSettings,
        image: EcrImage,
        model: ModelArtifact,
        network: NetworkSettings | None,
        alarm_topic: sns.ITopic,
    ) -> tuple[SageMakerEndpoint, list[cloudwatch.AlarmBase]]:
        """The asynchronous endpoint: the decision image and model with the async deadline
        and body limit, answers and failures in S3, outcomes on two topics, scaled on its
        queue from zero, its container's metrics published (detailed observability, set
        explicitly) and its alarms on the decision dashboard. No post-deploy check
        (`EndpointCheck` invokes synchronously, which an asynchronous endpoint refuses).

        Updates are blue/green, all at once (the green fleet is one instance), rolled back
        on failed invocations and on the model regressions its own container reports
        (`ScoringSpeed`, `LetterMass`): not on 5XX rate or latency, which SageMaker does not
        publish or which run for minutes by design here, nor on the age of the oldest
        request (`AsyncEndpointAlarms` says why). An update does not retain the variant's
        instance count: at zero instances a retained count would deploy the new model onto
        no instance at all, unstarted and unwatched until the next request; the config's
        own count (1) starts it, proves it healthy during the deploy and bakes it, and the
        queue scaling takes it back to zero afterwards."""
        async_settings = settings.async_endpoint
        assert async_settings is not None
        topics = {
            outcome: encrypted_topic(
                self,
                f"Async{outcome}Topic",
                key=model.key,
                display_name=f"{endpoint_name} {outcome.lower()}",
            )
            for outcome in ("Success", "Error")
        }
        alarms = AsyncEndpointAlarms(
            self,
            "AsyncAlarms",
            endpoint_name=endpoint_name,
            max_oldest_request_age_seconds=async_settings.max_oldest_request_age_seconds,
            thresholds=settings.alarms,
            topic=alarm_topic,
            gpu=settings.uses_gpu,
        )
        signals = DecisionSignalAlarms(
            self,
            "AsyncSignals",
            endpoint_name=endpoint_name,
            thresholds=settings.signal_alarms,
            topic=alarm_topic,
        )
        endpoint = SageMakerEndpoint(
            self,
            "Async",
            endpoint_name=endpoint_name,
            image=image,
            model=model,
            environment=settings.async_container_environment(),
            placement=settings.placement,
            # SageMaker's least, and what each update starts (the count is not retained);
            # autoscaling takes it to zero once the queue is empty.
            initial_instance_count=1,
            startup_timeout_seconds=settings.startup_timeout_seconds,
            network=network,
            rollout=ALL_AT_ONCE,
            rollback_alarms=[*alarms.rollback_alarms, *signals.rollback_alarms],
            log_key=model.key,
            observability=settings.metrics,
            retain_variant_properties=False,
            async_inference=AsyncInference(
                input_prefix=ASYNC_INPUT_PREFIX,
                output_prefix=ASYNC_OUTPUT_PREFIX,
                failure_prefix=ASYNC_FAILURE_PREFIX,
                success_topic=topics["Success"],
                error_topic=topics["Error"],
                invocations_per_instance=settings.async_invocations_per_instance,
            ),
        )
        AsyncEndpointAutoscaling(
            self,
            "AsyncScaling",
            endpoint=endpoint,
            max_capacity=async_settings.max_capacity,
            target_backlog_per_instance=async_settings.target_backlog_per_instance,
            startup_seconds=settings.startup_timeout_seconds,
        )
        CfnOutput(self, "AsyncEndpointName", value=endpoint_name)
        CfnOutput(
            self,
            "AsyncInputPrefix",
            value=model.s3_uri(ASYNC_INPUT_PREFIX),
            description="upload each request here; InvokeEndpointAsync's InputLocation",
        )
        CfnOutput(self, "AsyncOutputPrefix", value=model.s3_uri(ASYNC_OUTPUT_PREFIX))
        CfnOutput(self, "AsyncFailurePrefix", value=model.s3_uri(ASYNC_FAILURE_PREFIX))
        CfnOutput(self, "AsyncSuccessTopicArn", value=topics["Success"].topic_arn)
        CfnOutput(self, "AsyncErrorTopicArn", value=topics["Error"].topic_arn)
        return endpoint, [*alarms.alarms, *signals.alarms]


class StandardEndpointStack(Stack):
    """The published CPU DLC (chat completions, from the private mirror) on the settings'
    CPU instances (one by default), with llama-server's own metrics on (`--metrics`),
    published by detailed observability to its dashboard; it rolls back on its 5XX rate."""

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
            initial_instance_count=settings.initial_instance_count,
            startup_timeout_seconds=settings.startup_timeout_seconds,
            network=network,
            rollout=settings.rollout,
            rollback_alarms=alarms.rollback_alarms,
            log_key=model.key,
            observability=settings.metrics,
            routing=settings.routing,
        )
        EndpointDashboard(
            self,
            "Dashboard",
            endpoint_name=endpoint_name,
            alarms=alarms.alarms,
            queries=standard_queries(endpoint_name),
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
