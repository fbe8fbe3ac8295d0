"""The adapter image: ECR repository and the CodeBuild project that builds one flavor."""

from __future__ import annotations

import enum
import hashlib

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from constructs import Construct

from cdk_constructs.build_project import BuildProject, RepoSource
from cdk_constructs.container_image import DIGEST_ATTRIBUTE, ECR_PUSH_ACTIONS
from cdk_constructs.deploy_time_build import MAX_BUILD_TIMEOUT
from cdk_constructs.nag import acknowledge
from cdk_constructs.validation import require_digest_image

BUILDSPEC = "images/buildspec.yml"
# Exactly what goes into the image or its build: the image tag hashes these, so editing the
# client, a benchmark or a lint rule does not rebuild the image or replace the endpoint.
SOURCE_PATHS = ("images", "adapter", "model_build")
IMAGE_URI_VARIABLE = "IMAGE_URI"
IMAGE_DIGEST_VARIABLE = DIGEST_ATTRIBUTE  # `sha256:<64 hex>`, checked by the buildspec


class ImageFlavor(enum.Enum):
    """CPU or CUDA child image: its Dockerfile, the ggml backend the image serves with, and
    what its smoke test on an ordinary (GPU-less) CodeBuild host checks.

    Both flavors are smoke-tested with the CPU backend, against the image's own libllama
    (binding/ABI match, shared-state path); the CUDA image must also contain the CUDA
    backend library. Whether it loads on a GPU is checked where a GPU exists: the adapter
    refuses to start when GPU layers are asked for and no GPU backend loads, and the
    post-deploy check invokes the endpoint.
    """

    CPU = ("cpu", "images/Dockerfile", "CPU", "", "/opt/llama.cpp/bin/libggml-cpu*.so")
    CUDA = (
        "cuda",
        "images/Dockerfile.gpu",
        "CUDA",
        "SEMIF_N_GPU_LAYERS=0",
        "/opt/llama.cpp/bin/libggml-cuda*.so",
    )

    def __init__(
        self, label: str, dockerfile: str, backend: str, smoke_env: str, backend_library: str
    ) -> None:
        self.label = label
        self.dockerfile = dockerfile
        self.backend = backend
        self.smoke_backend = "CPU"
        self.smoke_env = smoke_env
        self.backend_library = backend_library

    @property
    def gpu(self) -> bool:
        return self is ImageFlavor.CUDA


def image_tag(flavor: ImageFlavor, source_hash: str, base_image: str) -> str:
    """A tag that is a hash of every build input: source files, flavor and base digest."""
    digest = hashlib.sha256(f"{flavor.label}|{source_hash}|{base_image}".encode()).hexdigest()
    return f"{flavor.label}-{digest[:32]}"


class ImageRepository(Construct):
    """Private ECR repository: immutable tags, scan on push, bounded history."""

    def __init__(
        self, scope: Construct, construct_id: str, *, removal_policy: RemovalPolicy
    ) -> None:
        super().__init__(scope, construct_id)
        self.repository = ecr.Repository(
            self,
            "Repository",
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            image_scan_on_push=True,
            encryption=ecr.RepositoryEncryption.AES_256,
            # Only untagged leftovers expire: every pushed image is tagged, and a tagged image
            # may be what an endpoint (or its rollback) serves, so age or count rules could
            # delete an image under a live endpoint. Old tags are removed with the repository.
            lifecycle_rules=[
                ecr.LifecycleRule(
                    description="Drop untagged layers left by interrupted pushes",
                    tag_status=ecr.TagStatus.UNTAGGED,
                    max_image_age=Duration.days(1),
                    rule_priority=1,
                ),
            ],
            removal_policy=removal_policy,
            empty_on_delete=removal_policy == RemovalPolicy.DESTROY,
        )


class ImageBuildProject(Construct):
    """Build one flavor FROM its digest-pinned DLC, smoke-test it, push it, export its digest.

    The tag is a hash of the inputs, so an unchanged input set reuses the pushed image.
    `base_image` is the published pin (`public.ecr.aws/...@sha256:...`: it names the
    inputs); `base_pull_uri` is where the build pulls that same digest from, this project's
    own mirror in private ECR (authenticated, no anonymous ECR Public rate limit), readable
    through `base_repository`.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        flavor: ImageFlavor,
        base_image: str,
        base_pull_uri: str,
        base_repository: ecr.IRepository,
        source: RepoSource,
        repository: ecr.IRepository,
        encryption_key: kms.IKey,
        removal_policy: RemovalPolicy,
    ) -> None:
        super().__init__(scope, construct_id)
        require_digest_image(base_image, f"{flavor.label} image build base_image")
        self.repository = repository
        self.image_tag = image_tag(flavor, source.asset_hash, base_image)
        self.build = BuildProject(
            self,
            "Project",
            description=f"Builds, smoke-tests and pushes the {flavor.label} adapter image",
            source=source,
            buildspec=BUILDSPEC,
            environment_variables={
                "ECR_REPOSITORY_URI": repository.repository_uri,
                "IMAGE_TAG": self.image_tag,
                "DOCKERFILE": flavor.dockerfile,
                "DLC_IMAGE": base_pull_uri,
                "SMOKE_BACKEND": flavor.smoke_backend,
                "SMOKE_ENV": flavor.smoke_env,
                "SMOKE_REQUIRE_FILE": flavor.backend_library,
            },
            encryption_key=encryption_key,
            compute_type=codebuild.ComputeType.LARGE,
            timeout=MAX_BUILD_TIMEOUT,
            removal_policy=removal_policy,
            privileged=True,
            docker_cache=True,
        )
        acknowledge(
            self.build.project,
            "AwsSolutions-CB3",
            "Privileged mode runs the Docker daemon that builds and smoke-tests the image.",
        )
        self.build.allow(["ecr:GetAuthorizationToken"], ["*"])
        acknowledge(
            self.build.role,
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken has no resource-level permissions; it only issues "
            "a login token, and every push/pull action is scoped to the one repository.",
        )
        self.build.allow(
            list(ECR_PUSH_ACTIONS),
            [repository.repository_arn],
        )
        self.build.allow(
            ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"],
            [base_repository.repository_arn],
        )

    @property
    def project(self) -> codebuild.IProject:
        return self.build.project
