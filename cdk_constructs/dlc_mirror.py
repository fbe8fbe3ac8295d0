"""A deploy-time copy of the pinned public llama.cpp DLC images into this project's own
private ECR repository, digest preserved and verified.

SageMaker hosting cannot pull from ECR Public. The regional DLC registry
(`763104351884.dkr.ecr.<region>.amazonaws.com/llama-cpp`) could serve the image, but the
digest it serves for the same release is not known here and need not equal the public one.
So the public digest stays the one pin, and a CodeBuild build copies exactly that manifest
(`crane copy`, byte for byte: an image index stays an index) into the mirror repository,
then checks that the copy's digest equals the pin. The standard endpoint serves
`<mirror>@<pinned digest>`; the decision image build pulls its base from the mirror too
(authenticated, no anonymous ECR Public rate limit).

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

from aws_cdk import Duration, RemovalPolicy
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from constructs import Construct

from cdk_constructs.build_project import BuildProject
from cdk_constructs.container_image import ECR_PUSH_ACTIONS, EcrImage
from cdk_constructs.deploy_time_build import DeployTimeBuild
from cdk_constructs.nag import acknowledge
from cdk_constructs.validation import require, require_digest_image

CRANE_MODULE = "github.com/google/go-containerregistry/cmd/crane"
CRANE_VERSION = "v0.20.2"  # fetched through the Go module proxy, checked by sum.golang.org
MIRROR_BUILD_TIMEOUT = Duration.minutes(30)

# The whole build: a copy by digest, verified, never a rebuild. Inputs: MIRROR_REPOSITORY_URI
# and MIRROR_IMAGES ("<tag>=<repo>@sha256:<digest>" separated by spaces).
MIRROR_SCRIPT = r"""set -euo pipefail
: "${MIRROR_REPOSITORY_URI:?}" "${MIRROR_IMAGES:?}"
registry="${MIRROR_REPOSITORY_URI%%/*}"
repository="${MIRROR_REPOSITORY_URI#*/}"
aws ecr get-login-password --region "${AWS_DEFAULT_REGION}" \
  | crane auth login "${registry}" --username AWS --password-stdin
# Authenticated ECR Public pulls get the higher rate limit; anonymous if this fails.
aws ecr-public get-login-password --region us-east-1 \
  | crane auth login public.ecr.aws --username AWS --password-stdin \
  || echo "ECR Public login failed; pulling anonymously"
for pair in ${MIRROR_IMAGES}; do
  tag="${pair%%=*}"
  source="${pair#*=}"
  digest="${source##*@}"
  if [[ ! "${digest}" =~ ^sha256:[0-9a-f]{64}$ ]]; then
    echo "not pinned by digest: ${source}" >&2
    exit 1
  fi
  existing="$(aws ecr describe-images --repository-name "${repository}" \
    --image-ids imageTag="${tag}" --query 'imageDetails[0].imageDigest' \
    --output text 2>/dev/null || true)"
  if [[ "${existing}" == "${digest}" ]]; then
    echo "${tag}: already mirrored as ${digest}"
    continue
  fi
  if [[ "${existing}" == sha256:* ]]; then
    echo "${tag} holds ${existing}, not ${digest}" >&2
    exit 1
  fi
  crane copy "${source}" "${MIRROR_REPOSITORY_URI}:${tag}"
  copied="$(crane digest "${MIRROR_REPOSITORY_URI}:${tag}")"
  if [[ "${copied}" != "${digest}" ]]; then
    echo "the copy of ${source} has digest ${copied}, not the pinned ${digest}" >&2
    exit 1
  fi
  media_type="$(crane manifest "${MIRROR_REPOSITORY_URI}@${digest}" \
    | python3 -c 'import json, sys; print(json.load(sys.stdin).get("mediaType"))')"
  echo "${tag}: mirrored ${source} as ${MIRROR_REPOSITORY_URI}@${digest} (${media_type})"
done
"""


def mirror_build_spec() -> codebuild.BuildSpec:
    return codebuild.BuildSpec.from_object_to_yaml(
        {
            "version": "0.2",
            "env": {"shell": "bash"},
            "phases": {
                "install": {
                    "runtime-versions": {"golang": "1.x"},
                    "commands": [f"GOBIN=/usr/local/bin go install {CRANE_MODULE}@{CRANE_VERSION}"],
                },
                "build": {"commands": [MIRROR_SCRIPT]},
            },
        }
    )


def mirror_tag(label: str, image: str) -> str:
    """`<label>-<64 hex>`: one immutable tag per pinned digest."""
    return f"{label}-{image.rsplit('@sha256:', 1)[1]}"


class DlcMirror(Construct):
    """The mirror repository and the deploy-time copy of `images` (label -> pinned ref)."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        repository_name: str,
        images: Mapping[str, str],
        encryption_key: kms.IKey,
        log_key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        require(bool(images), "dlc mirror: give at least one image")
        for label, image in images.items():
            require_digest_image(image, f"dlc mirror image {label!r}")
        self.images = dict(sorted(images.items()))
        self.repository_name = repository_name
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
        self.build_project = BuildProject(
            self,
            "Copy",
            description="Copies the pinned llama.cpp DLC images into private ECR, by digest",
            source=None,
            buildspec=mirror_build_spec(),
            environment_variables={
                "MIRROR_REPOSITORY_URI": self.repository.repository_uri,
                "MIRROR_IMAGES": pairs,
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
        self.copy = DeployTimeBuild(
            self,
            "Build",
            project=self.build_project.project,
            trigger=hashlib.sha256(f"{spec}|{pairs}".encode()).hexdigest(),
            log_key=log_key,
        )

    def image(self, label: str) -> EcrImage:
        """The mirrored copy of `images[label]`: same digest, in this account's ECR."""
        digest = "sha256:" + self.images[label].rsplit("@sha256:", 1)[1]
        return EcrImage(repository_name=self.repository_name, digest=digest)

    def pull_uri(self, label: str) -> str:
        """Where a build in this stack pulls the mirrored copy from."""
        return self.repository.repository_uri_for_digest(self.image(label).digest)
