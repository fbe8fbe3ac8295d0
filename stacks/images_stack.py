"""Images stack: the adapter's ECR repository and the CodeBuild project that fills it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from aws_cdk import aws_kms as kms
from constructs import Construct

from cdk_constructs.build_project import RepoSource
from cdk_constructs.image_build import (
    SOURCE_PATHS,
    ImageBuildProject,
    ImageFlavor,
    ImageRepository,
)


class ImagesStack(Stack):
    """Long-lived build infrastructure. The build itself is triggered by the decision stack.

    Running the build there keeps the ever-changing image digest inside one stack: a
    digest exported from here would be an export CloudFormation refuses to change while
    another stack imports it.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        repo_root: Path,
        flavor: ImageFlavor,
        base_image: str,
        removal_policy: RemovalPolicy,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.repository = ImageRepository(self, "Adapter", removal_policy=removal_policy).repository
        key = kms.Key(
            self,
            "BuildKey",
            description="Encrypts image build logs and artifacts",
            enable_key_rotation=True,
            removal_policy=removal_policy,
        )
        self.image_build = ImageBuildProject(
            self,
            f"{flavor.label.capitalize()}Image",
            flavor=flavor,
            base_image=base_image,
            source=RepoSource(self, "ImageSource", root=repo_root, include=SOURCE_PATHS),
            repository=self.repository,
            encryption_key=key,
            removal_policy=removal_policy,
        )
        CfnOutput(self, "RepositoryUri", value=self.repository.repository_uri)
        CfnOutput(self, "ImageBuildProject", value=self.image_build.project.project_name)
