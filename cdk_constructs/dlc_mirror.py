"""A deploy-time copy of the pinned public llama.cpp DLC images into this project's own
private ECR repository, digest preserved and verified, in a form SageMaker serves.

SageMaker hosting cannot pull from ECR Public. The regional DLC registry
(`763104351884.dkr.ecr.<region>.amazonaws.com/llama-cpp`) could serve the image, but the
digest it serves for the same release is not known here and need not equal the public one.
So the public digest stays the one pin, and a CodeBuild build (`dlc_mirror_build.py`) copies
exactly that manifest (`crane copy`, byte for byte: an image index stays an index, which is
what the decision image build pulls its base from) into the mirror repository and checks
that the copy's digest equals the pin.

SageMaker's CreateModel accepts only Docker v2 single-platform manifests, so for each image
an endpoint serves directly (`served`: the standard endpoint's CPU DLC) the build also puts
the Docker v2 linux/amd64 form of the pin in the repository (the pin itself, its index's
linux/amd64 image, or that image converted from OCI; the module doc of
`dlc_mirror_build.py` says how) and fails unless its digest is the one the stack serves:
the pin's, or the served digest the config pins beside it (`DlcImages.cpu_served_digest`).
Both are known at synth time, so the standard stack names its image without a cross-stack
reference, and the app-wide image rule (`container_image.py`) sees a literal digest.

The repository has a fixed name (`<prefix>/llama-cpp-dlc`) so that the endpoint stacks can
name the image from pseudo parameters, without a cross-stack reference. Because its name is
fixed it is never retained: `cdk destroy` deletes it with its images (they are copies of a
public image; the next deploy copies them again), and a redeploy after a destroy can
create it again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from constructs import Construct

from cdk_constructs.build_project import BuildProject, RepoSource
from cdk_constructs.container_image import ECR_PUSH_ACTIONS, EcrImage
from cdk_constructs.deploy_time_build import DeployTimeBuild
from cdk_constructs.nag import acknowledge
from cdk_constructs.validation import require, require_digest_image

CRANE_MODULE = "github.com/google/go-containerregistry/cmd/crane"
CRANE_VERSION = "v0.20.2"  # fetched through the Go module proxy, checked by sum.golang.org
MIRROR_BUILD_TIMEOUT = Duration.minutes(30)

PROGRAM = "cdk_constructs/dlc_mirror_build.py"  # the build's source: this one file

# Log crane in to the mirror (and to ECR Public, for the higher rate limit of authenticated
# pulls; anonymous if that fails), then run the program: copy by digest, verified, and the
# Docker v2 form of each served image. Inputs: MIRROR_REPOSITORY_URI, MIRROR_IMAGES
# ("<tag>=<repo>@sha256:<digest>" separated by spaces) and MIRROR_SERVED ("<tag>=<digest>").
MIRROR_SCRIPT = f"""set -euo pipefail
: "${{MIRROR_REPOSITORY_URI:?}}" "${{MIRROR_IMAGES:?}}"
aws ecr get-login-password --region "${{AWS_DEFAULT_REGION}}" \\
  | crane auth login "${{MIRROR_REPOSITORY_URI%%/*}}" --username AWS --password-stdin
aws ecr-public get-login-password --region us-east-1 \\
  | crane auth login public.ecr.aws --username AWS --password-stdin \\
  || echo "ECR Public login failed; pulling anonymously"
python3 {PROGRAM} "${{MIRROR_REPOSITORY_URI}}" "${{MIRROR_IMAGES}}" "${{MIRROR_SERVED:-}}"
"""


def mirror_build_spec() -> codebuild.BuildSpec:
    return codebuild.BuildSpec.from_object_to_yaml(
        {
            "version": "0.2",
            "env": {"shell": "bash"},
            "phases": {
                "install": {
                    "runtime-versions": {"golang": "1.x", "python": "3.12"},
                    "commands": [f"GOBIN=/usr/local/bin go install {CRANE_MODULE}@{CRANE_VERSION}"],
                },
                "build": {"commands": [MIRROR_SCRIPT]},
            },
        }
    )


def mirror_tag(label: str, image: str) -> str:
    """`<label>-<64 hex>`: one immutable tag per pinned digest."""
    return f"{label}-{image.rsplit('@sha256:', 1)[1]}"


def pinned_digest(image: str) -> str:
    """`sha256:<64 hex>` of a `repo@sha256:<64 hex>` reference."""
    return "sha256:" + image.rsplit("@sha256:", 1)[1]


class DlcMirror(Construct):
    """The mirror repository and the deploy-time copy of `images` (label -> pinned ref).

    `served` names the labels a SageMaker model serves directly, each with the digest it
    serves: None for the pin itself (which must then be a Docker v2 linux/amd64 manifest),
    else the Docker v2 form the build derives from the pin (module doc). The build's program
    comes from `repo_root`, and its bytes are part of the build trigger.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        repository_name: str,
        images: Mapping[str, str],
        served: Mapping[str, str | None],
        repo_root: Path,
        encryption_key: kms.IKey,
        log_key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        require(bool(images), "dlc mirror: give at least one image")
        for label, image in images.items():
            require_digest_image(image, f"dlc mirror image {label!r}")
        self.images = dict(sorted(images.items()))
        self.repository_name = repository_name
        self.served: dict[str, EcrImage] = {}
        for label, digest in sorted(served.items()):
            require(
                label in self.images,
                f"dlc mirror served {label!r}: not one of the mirrored {sorted(self.images)}",
            )
            self.served[label] = EcrImage(
                repository_name=repository_name,
                digest=digest or pinned_digest(self.images[label]),
            )
        self.repository = ecr.Repository(
            self,
            "Repository",
            repository_name=repository_name,
            image_tag_mutability=ecr.TagMutability.IMMUTABLE,
            image_scan_on_push=True,
            encryption=ecr.RepositoryEncryption.AES_256,
            # No lifecycle rule: an image index's platform manifests are untagged, and
            # expiring them would break the tagged copy an endpoint serves.
            removal_policy=RemovalPolicy.DESTROY,  # fixed name: never retained (module doc)
            empty_on_delete=True,
        )
        pairs = " ".join(f"{mirror_tag(label, ref)}={ref}" for label, ref in self.images.items())
        serves = " ".join(
            f"{mirror_tag(label, self.images[label])}={image.digest}"
            for label, image in self.served.items()
        )
        source = RepoSource(self, "Source", root=repo_root, include=(PROGRAM,))
        self.build_project = BuildProject(
            self,
            "Copy",
            description="Copies the pinned llama.cpp DLC images into private ECR, by digest",
            source=source,
            buildspec=mirror_build_spec(),
            environment_variables={
                "MIRROR_REPOSITORY_URI": self.repository.repository_uri,
                "MIRROR_IMAGES": pairs,
                **({"MIRROR_SERVED": serves} if serves else {}),
            },
            encryption_key=encryption_key,
            compute_type=codebuild.ComputeType.SMALL,
            timeout=MIRROR_BUILD_TIMEOUT,
            removal_policy=RemovalPolicy.DESTROY,
        )
        self.build_project.allow(
            ["ecr:GetAuthorizationToken", "ecr-public:GetAuthorizationToken"], ["*"]
        )
        self.build_project.allow(["sts:GetServiceBearerToken"], ["*"])
        acknowledge(
            self.build_project.role,
            "AwsSolutions-IAM5[Resource::*]",
            "ecr:GetAuthorizationToken, ecr-public:GetAuthorizationToken and "
            "sts:GetServiceBearerToken have no resource-level permissions (they issue login "
            "tokens); every push and read is scoped to the one mirror repository.",
        )
        self.build_project.allow(
            list(ECR_PUSH_ACTIONS),
            [self.repository.repository_arn],
        )
        spec = json.dumps(mirror_build_spec().to_build_spec(), sort_keys=True)
        inputs = f"{spec}|{pairs}|{serves}|{source.asset_hash}"
        self.copy = DeployTimeBuild(
            self,
            "Build",
            project=self.build_project.project,
            trigger=hashlib.sha256(inputs.encode()).hexdigest(),
            log_key=log_key,
        )

    def image(self, label: str) -> EcrImage:
        """What a SageMaker model serves of `images[label]`: the digest `served` names, in
        this account's ECR (the build checked it is there, as a Docker v2 manifest)."""
        require(label in self.served, f"dlc mirror image {label!r} is not served (`served`)")
        return self.served[label]

    def pull_uri(self, label: str) -> str:
        """Where a build in this stack pulls the mirrored copy of the pin from."""
        return self.repository.repository_uri_for_digest(pinned_digest(self.images[label]))
