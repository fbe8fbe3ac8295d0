"""Images SageMaker can pull: private Amazon ECR in the endpoint's own account and region,
pinned by digest, and the synth-time rule that refuses every other model image.

SageMaker hosting pulls only from private ECR (an ECR Public URI fails CreateModel with
"Using non-ECR image without Vpc repository access mode is not supported"). Every model
image is therefore built here as `<account>.dkr.ecr.<region>.<url suffix>/<repo>@<digest>`
from the stack's own pseudo parameters, so it names the registry of the account and region
the stack is deployed to, also when the stack is environment-agnostic.

`PrivateEcrImageRule` is an Aspect: it adds a validation to every `AWS::SageMaker::Model`
in the app, so `cdk synth` fails when a model's image is anything else. Tokens are allowed
where they resolve to that shape: the account, region and URL suffix pseudo parameters,
a repository name that is a reference (`Ref`, `Fn::ImportValue`), and a digest exported
by a deploy-time build (`Fn::GetAtt [<build>, IMAGE_DIGEST]`, which the build checks to be
`sha256:<64 hex>` before it exports it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsii
from aws_cdk import ArnFormat, Aws, Fn, IAspect, Stack, Token
from aws_cdk import aws_sagemaker as sagemaker
from constructs import IConstruct, IValidation

from cdk_constructs.validation import require

# What a build that pushes to one repository (and reads it back) needs on that repository.
ECR_PUSH_ACTIONS = (
    "ecr:BatchCheckLayerAvailability",
    "ecr:BatchGetImage",
    "ecr:CompleteLayerUpload",
    "ecr:DescribeImages",
    "ecr:GetDownloadUrlForLayer",
    "ecr:InitiateLayerUpload",
    "ecr:PutImage",
    "ecr:UploadLayerPart",
)

DIGEST_ATTRIBUTE = "IMAGE_DIGEST"
PRIVATE_ECR_IMAGE = re.compile(
    r"^\d{12}\.dkr\.ecr\.[a-z]{2}(-[a-z]+)+-\d\.amazonaws\.com(\.cn)?"
    r"/[a-z0-9]+(?:[._/-][a-z0-9]+)*@sha256:[0-9a-f]{64}$"
)
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REPOSITORY_NAME = re.compile(r"^[a-z0-9]+(?:[._/-][a-z0-9]+)*$")

# What each kind of token stands for when a model's image is checked (see the module doc).
_PSEUDO = {
    "AWS::AccountId": "000000000000",
    "AWS::Region": "xx-region-1",
    "AWS::URLSuffix": "amazonaws.com",
}
_REFERENCE = "referenced-repository"
_BUILT_DIGEST = "sha256:" + "0" * 64


@dataclass(frozen=True, kw_only=True)
class EcrImage:
    """`<this account>.dkr.ecr.<this region>.<suffix>/<repository_name>@<digest>`.

    `digest` is `sha256:<64 hex>`, or the `IMAGE_DIGEST` output of a deploy-time build.
    `repository_name` may be a token (a repository of another stack).
    """

    repository_name: str
    digest: str

    def __post_init__(self) -> None:
        if not Token.is_unresolved(self.repository_name):
            require(
                bool(_REPOSITORY_NAME.fullmatch(self.repository_name)),
                f"image.repository_name: {self.repository_name!r} is not an ECR repository name",
            )
        if not Token.is_unresolved(self.digest):
            require(
                bool(_DIGEST.fullmatch(self.digest)),
                f"image.digest: {self.digest!r} is not 'sha256:<64 lowercase hex>'",
            )

    @property
    def uri(self) -> str:
        return Fn.join(
            "",
            [
                Aws.ACCOUNT_ID,
                ".dkr.ecr.",
                Aws.REGION,
                ".",
                Aws.URL_SUFFIX,
                "/",
                self.repository_name,
                "@",
                self.digest,
            ],
        )

    def repository_arn(self, scope: IConstruct) -> str:
        """The ARN of the repository in the account and region of `scope`'s stack."""
        return Stack.of(scope).format_arn(
            service="ecr",
            resource="repository",
            resource_name=self.repository_name,
            arn_format=ArnFormat.SLASH_RESOURCE_NAME,
        )


def render_image(value: Any) -> str:
    """The resolved CloudFormation value of an image as a string to check (module doc)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        ((function, argument),) = value.items()
        if function == "Ref":
            return _PSEUDO.get(str(argument), _REFERENCE)
        if function == "Fn::ImportValue":
            return _REFERENCE
        if function == "Fn::GetAtt":
            return _BUILT_DIGEST if list(argument)[1] == DIGEST_ATTRIBUTE else "<attribute>"
        if function == "Fn::Join":
            separator, parts = argument
            return str(separator).join(render_image(part) for part in parts)
    return "<unsupported intrinsic>"


def image_problem(resolved_image: Any) -> str | None:
    """None for a private ECR image pinned by digest; otherwise what is wrong."""
    rendered = render_image(resolved_image)
    if PRIVATE_ECR_IMAGE.fullmatch(rendered):
        return None
    return (
        f"SageMaker model image {rendered!r} is not a private Amazon ECR image pinned by "
        "digest ('<account>.dkr.ecr.<region>.amazonaws.com/<repository>@sha256:<64 hex>'). "
        "SageMaker hosting cannot pull from ECR Public or other registries; mirror the "
        "image into this project's ECR repository (DlcMirror) and use EcrImage."
    )


@jsii.implements(IValidation)
class _ModelImageValidation:
    def __init__(self, model: sagemaker.CfnModel) -> None:
        self._model = model

    def validate(self) -> list[str]:
        stack = Stack.of(self._model)
        extra = self._model.containers
        containers = [self._model.primary_container, *(extra if isinstance(extra, list) else [])]
        problems = []
        for container in containers:
            if container is None:
                continue
            resolved = stack.resolve(container)
            problem = image_problem(resolved.get("image") if isinstance(resolved, dict) else None)
            if problem:
                problems.append(problem)
        return problems


@jsii.implements(IAspect)
class PrivateEcrImageRule:
    """Add the image check to every SageMaker model (add once, to the app)."""

    def visit(self, node: IConstruct) -> None:
        if isinstance(node, sagemaker.CfnModel):
            node.node.add_validation(_ModelImageValidation(node))
