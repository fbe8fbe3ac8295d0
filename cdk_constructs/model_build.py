"""The model build: CodeBuild runs `model_build/buildspec.yml` once per pinned model."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from aws_cdk import Aws, RemovalPolicy
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from cdk_constructs.build_project import BuildProject, RepoSource
from cdk_constructs.deploy_time_build import MAX_BUILD_TIMEOUT, DeployTimeBuild
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.validation import require

BUILDSPEC = "model_build/buildspec.yml"
SOURCE_PATHS = ("model_build",)  # all the model build runs: its hash is the build key
# Variables model_build/buildspec.yml exports; the deploy fails if one is missing.
ARCHIVE_URI = "MODEL_ARCHIVE_URI"
ARCHIVE_SHA256 = "MODEL_ARCHIVE_SHA256"
GGUF_SHA256 = "MODEL_GGUF_SHA256"
CALIBRATION_FILE = "MODEL_CALIBRATION_FILE"  # read by model-build itself
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class ModelCalibration:
    """A calibration file inside the build's source (`path` relative to its root) and the
    digest of its content, which names the model object."""

    path: str
    sha256: str

    def __post_init__(self) -> None:
        require(
            bool(self.path) and not self.path.startswith("/") and ".." not in self.path,
            f"calibration.path: {self.path!r} must be relative to the build source",
        )
        require(
            bool(_SHA256.fullmatch(self.sha256)),
            f"calibration.sha256: {self.sha256!r} is not 64 lowercase hex characters",
        )


def model_object_key(sha256: str, calibration: ModelCalibration | None = None) -> str:
    """Content-addressed key: a new model or a new calibration gets a new key, so the
    endpoints get a new SageMaker model (a blue/green update) and never see a swap."""
    if calibration is None:
        return f"models/{sha256}/model.tar.gz"
    return f"models/{sha256}/calibration-{calibration.sha256}/model.tar.gz"


def source_object_arn(model_uri: str) -> str:
    """The ARN of an `s3://bucket/key` model source."""
    bucket, _, key = model_uri.removeprefix("s3://").partition("/")
    return f"arn:{Aws.PARTITION}:s3:::{bucket}/{key}"


class ModelBuild(Construct):
    """Fetch the pinned GGUF, check its sha256, write `model.tar.gz` to one exact key.

    The build role may write only that object (and use the bucket key); the deploy-time
    build re-runs only when the model pin or the source (the builder's code and the
    `calibration` file, which `source` must include) changes. `artifact` is what the
    endpoints serve.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        source: RepoSource,
        model_uri: str,
        model_sha256: str,
        calibration: ModelCalibration | None,
        bucket: s3.IBucket,
        key: kms.IKey,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        self.artifact = ModelArtifact(
            bucket=bucket, key=key, object_key=model_object_key(model_sha256, calibration)
        )
        environment = {
            "MODEL_SOURCE_URI": model_uri,
            "MODEL_SHA256": model_sha256,
            "MODEL_DEST_URI": self.artifact.model_data_url,
            "MODEL_KMS_KEY_ID": key.key_arn,
        }
        if calibration is not None:
            environment[CALIBRATION_FILE] = calibration.path
        self.project = BuildProject(
            self,
            "Project",
            description=f"Packages {model_uri} into model.tar.gz",
            source=source,
            buildspec=BUILDSPEC,
            environment_variables=environment,
            encryption_key=key,
            compute_type=codebuild.ComputeType.MEDIUM,
            timeout=MAX_BUILD_TIMEOUT,
            removal_policy=removal_policy,
        )
        self.project.allow(
            ["s3:PutObject", "s3:GetObject", "s3:AbortMultipartUpload"],
            [self.artifact.object_arn],
        )
        if model_uri.startswith("s3://"):
            # Read exactly the pinned source object (an SSE-KMS source also needs its key's
            # policy to allow this role kms:Decrypt; that key is not ours to grant).
            self.project.allow(["s3:GetObject"], [source_object_arn(model_uri)])
        trigger = hashlib.sha256(
            f"{source.asset_hash}|{model_uri}|{model_sha256}".encode()
        ).hexdigest()
        self.build = DeployTimeBuild(
            self,
            "Build",
            project=self.project.project,
            trigger=trigger,
            log_key=key,
            output_variables=[ARCHIVE_URI, ARCHIVE_SHA256, GGUF_SHA256],
        )
