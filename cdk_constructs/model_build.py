"""The model build: CodeBuild runs `model_build/buildspec.yml` once per pinned model."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import ClassVar

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
CHAT_TEMPLATE_FILE = "MODEL_CHAT_TEMPLATE_FILE"  # read by model-build itself
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, kw_only=True)
class BuildSourceFile:
    """A file inside the build's source (`path` relative to its root), which model-build
    reads by its path from the variable `VARIABLE`, and the digest of its content, which
    names the model object (`<KEY_PART>-<sha256>/` in `model_object_key`). Use a subclass:
    each kind of file has its own variable, key part and field name in messages."""

    FIELD: ClassVar[str]
    VARIABLE: ClassVar[str]
    KEY_PART: ClassVar[str]

    path: str
    sha256: str

    def __post_init__(self) -> None:
        require(
            bool(self.path) and not self.path.startswith("/") and ".." not in self.path,
            f"{self.FIELD}.path: {self.path!r} must be relative to the build source",
        )
        require(
            bool(_SHA256.fullmatch(self.sha256)),
            f"{self.FIELD}.sha256: {self.sha256!r} is not 64 lowercase hex characters",
        )

    @property
    def key_part(self) -> str:
        """This file's segment of the model object key."""
        return f"{self.KEY_PART}-{self.sha256}"


class ModelCalibration(BuildSourceFile):
    """A calibration file; `sha256` is that of its canonical JSON
    (`model_build.manifest.calibration_sha256`), so reformatting it names the same object."""

    FIELD = "calibration"
    VARIABLE = CALIBRATION_FILE
    KEY_PART = "calibration"


class ModelChatTemplate(BuildSourceFile):
    """An operator's Jinja chat template; `sha256` is that of its bytes, as the manifest
    records it (`chat_template.sha256`)."""

    FIELD = "chat_template"
    VARIABLE = CHAT_TEMPLATE_FILE
    KEY_PART = "chat-template"


def model_object_key(
    sha256: str,
    calibration: ModelCalibration | None = None,
    chat_template: ModelChatTemplate | None = None,
) -> str:
    """Content-addressed key, `models/<gguf sha256>/[calibration-<sha256>/]
    [chat-template-<sha256>/]model.tar.gz`: a new model, calibration or chat template gets a
    new key, so the endpoints get a new SageMaker model (a blue/green update) and never see
    a swap."""
    parts = [file.key_part for file in (calibration, chat_template) if file is not None]
    return "/".join(["models", sha256, *parts, "model.tar.gz"])


def source_object_arn(model_uri: str) -> str:
    """The ARN of an `s3://bucket/key` model source."""
    bucket, _, key = model_uri.removeprefix("s3://").partition("/")
    return f"arn:{Aws.PARTITION}:s3:::{bucket}/{key}"


class ModelBuild(Construct):
    """Fetch the pinned GGUF, check its sha256, write `model.tar.gz` to one exact key.

    The build role may write only that object (and use the bucket key); the deploy-time
    build re-runs only when the model pin or the source (the builder's code and the
    `calibration` and `chat_template` files, which `source` must include) changes.
    `artifact` is what the endpoints serve.
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
        chat_template: ModelChatTemplate | None = None,
        bucket: s3.IBucket,
        key: kms.IKey,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        self.artifact = ModelArtifact(
            bucket=bucket,
            key=key,
            object_key=model_object_key(model_sha256, calibration, chat_template),
        )
        environment = {
            "MODEL_SOURCE_URI": model_uri,
            "MODEL_SHA256": model_sha256,
            "MODEL_DEST_URI": self.artifact.model_data_url,
            "MODEL_KMS_KEY_ID": key.key_arn,
        }
        for file in (calibration, chat_template):
            if file is not None:
                environment[file.VARIABLE] = file.path
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
