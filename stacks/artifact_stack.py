"""Artifact stack: the environment's key, the model bucket, the deploy-time model build (and
the candidate's, when the decision endpoint shadows one) and the alarm topic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from aws_cdk import aws_sns as sns
from constructs import Construct

from cdk_constructs.alarm_topic import AlarmTopic
from cdk_constructs.artifact_bucket import ArtifactBucket
from cdk_constructs.build_project import RepoSource
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.model_build import (
    ARCHIVE_SHA256,
    ARCHIVE_URI,
    GGUF_SHA256,
    SOURCE_PATHS,
    ModelBuild,
    model_object_key,
)
from stacks.config import AlarmNotifications, ModelSource


class ArtifactStack(Stack):
    """Holds the only copy of `model.tar.gz`; `model_artifact` is what the endpoints serve.
    A `candidate` model is built the same way, by a model build of its own (outputs
    prefixed `Candidate`), into `candidate_artifact`; one that names the same object as
    `model` is that artifact, built once.

    What crosses to other stacks (bucket name/ARN, key ARN) never changes for the life of
    the stack, so CloudFormation exports never block an update; the object key is fixed at
    synth time. Referencing the bucket makes each endpoint stack wait for this whole stack,
    including the model build that writes the object.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        repo_root: Path,
        model: ModelSource,
        notifications: AlarmNotifications,
        removal_policy: RemovalPolicy,
        candidate: ModelSource | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.artifacts = ArtifactBucket(self, "Artifacts", removal_policy=removal_policy)
        self.alarm_topic: sns.ITopic
        if notifications.topic_arn is not None:
            self.alarm_topic = sns.Topic.from_topic_arn(self, "Alarms", notifications.topic_arn)
        else:
            self.alarm_topic = AlarmTopic(
                self, "Alarms", key=self.artifacts.key, email=notifications.email
            ).topic
        CfnOutput(self, "AlarmTopicArn", value=self.alarm_topic.topic_arn)
        self.model_artifact: ModelArtifact = self._build("", model, repo_root, removal_policy)
        self.candidate_artifact: ModelArtifact | None = None
        if candidate is not None:
            self.candidate_artifact = (
                self.model_artifact
                if _object_key(candidate) == self.model_artifact.object_key
                else self._build("Candidate", candidate, repo_root, removal_policy)
            )

    def _build(
        self, prefix: str, model: ModelSource, repo_root: Path, removal_policy: RemovalPolicy
    ) -> ModelArtifact:
        """`model`'s build into its own object, and its outputs, each id prefixed."""
        # The calibration and chat template files travel in the build's source, so their
        # bytes are in the source hash (the build trigger) and model-build reads them by
        # their repository paths.
        include = (*SOURCE_PATHS, *(file.path for file in model.build_files))
        model_build = ModelBuild(
            self,
            f"{prefix}ModelBuild",
            source=RepoSource(self, f"{prefix}ModelBuildSource", root=repo_root, include=include),
            model_uri=model.uri,
            model_sha256=model.sha256,
            calibration=model.build_calibration,
            chat_template=model.build_chat_template,
            bucket=self.artifacts.bucket,
            key=self.artifacts.key,
            removal_policy=removal_policy,
        )
        build = model_build.build
        CfnOutput(
            self,
            f"{prefix}ModelS3Uri",
            value=build.output(ARCHIVE_URI),
            description="model.tar.gz the endpoints serve (written by the model build)",
        )
        CfnOutput(
            self,
            f"{prefix}ModelSha256",
            value=build.output(GGUF_SHA256),
            description="sha256 of the GGUF inside model.tar.gz, as the model build verified it",
        )
        CfnOutput(self, f"{prefix}ModelArchiveSha256", value=build.output(ARCHIVE_SHA256))
        CfnOutput(self, f"{prefix}ModelBuildId", value=build.build_id)
        return model_build.artifact


def _object_key(model: ModelSource) -> str:
    return model_object_key(model.sha256, model.build_calibration, model.build_chat_template)
