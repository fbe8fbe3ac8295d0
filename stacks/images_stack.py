"""Images stack: the private ECR mirror of the pinned DLC images (every environment) and, when
the decision endpoint is deployed, the adapter's ECR repository and the project that fills it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aws_cdk import CfnOutput, RemovalPolicy, Stack
from aws_cdk import aws_kms as kms
from constructs import Construct

from cdk_constructs.build_project import RepoSource, allow_log_encryption
from cdk_constructs.dlc_mirror import DlcMirror
from cdk_constructs.image_build import (
    SOURCE_PATHS,
    ImageBuildProject,
    ImageFlavor,
    ImageRepository,
)


class ImagesStack(Stack):
    """Long-lived image infrastructure. The adapter build itself runs in the decision stack.

    Running that build there keeps the ever-changing image digest inside one stack: a
    digest exported from here would be an export CloudFormation refuses to change while
    another stack imports it. The DLC copy runs here: its digests are pinned in the config,
    so the endpoint stacks know them at synth time.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        repo_root: Path,
        mirror_repository_name: str,
        dlc_images: Mapping[str, str],
        served_dlc_images: Mapping[str, str | None],
        adapter_flavor: ImageFlavor | None,
        removal_policy: RemovalPolicy,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        key = kms.Key(
            self,
            "BuildKey",
            description="Encrypts image build logs and artifacts",
            enable_key_rotation=True,
            removal_policy=removal_policy,
        )
        allow_log_encryption(key)
        self.mirror = DlcMirror(
            self,
            "DlcMirror",
            repository_name=mirror_repository_name,
            images=dlc_images,
            served=served_dlc_images,
            repo_root=repo_root,
            encryption_key=key,
            log_key=key,
        )
        CfnOutput(self, "DlcMirrorRepositoryUri", value=self.mirror.repository.repository_uri)
        self.image_build: ImageBuildProject | None = None
        if adapter_flavor is None:
            return
        repository = ImageRepository(self, "Adapter", removal_policy=removal_policy).repository
        self.image_build = ImageBuildProject(
            self,
            f"{adapter_flavor.label.capitalize()}Image",
            flavor=adapter_flavor,
            base_image=dlc_images[adapter_flavor.label],
            base_pull_uri=self.mirror.pull_uri(adapter_flavor.label),
            base_repository=self.mirror.repository,
            source=RepoSource(self, "ImageSource", root=repo_root, include=SOURCE_PATHS),
            repository=repository,
            encryption_key=key,
            removal_policy=removal_policy,
        )
        CfnOutput(self, "RepositoryUri", value=repository.repository_uri)
        CfnOutput(self, "ImageBuildProject", value=self.image_build.project.project_name)
