"""The images stack: the adapter repository and the image build project of each flavor."""

from __future__ import annotations

import aws_cdk as cdk
import pytest
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from aws_cdk.assertions import Match

import app as cdk_app
from cdk_constructs.build_project import RepoSource
from cdk_constructs.image_build import SOURCE_PATHS, ImageBuildProject, ImageFlavor, image_tag
from cdk_constructs.validation import PropsError
from stacks.environments import ENVIRONMENTS
from tests.cdk.support import Synth, as_list, logical_id, statements


@pytest.mark.parametrize(("env", "flavor"), [("dev", ImageFlavor.CPU), ("gpu", ImageFlavor.CUDA)])
def test_image_build_project_per_flavor(synth: Synth, env: str, flavor: ImageFlavor) -> None:
    config = ENVIRONMENTS[env]
    template = synth.template(env, "images")
    template.resource_count_is("AWS::ECR::Repository", 1)
    template.has_resource_properties(
        "AWS::ECR::Repository",
        {
            "ImageTagMutability": "IMMUTABLE",
            "ImageScanningConfiguration": Match.exact({"ScanOnPush": True}),
            # Nothing an endpoint may serve expires: only untagged leftovers do.
            "LifecyclePolicy": {
                "LifecyclePolicyText": Match.serialized_json(
                    {
                        "rules": [
                            Match.object_like(
                                {"selection": Match.object_like({"tagStatus": "untagged"})}
                            )
                        ]
                    }
                )
            },
        },
    )
    base = config.dlc_images.cuda if flavor.gpu else config.dlc_images.cpu
    template.resource_count_is("AWS::CodeBuild::Project", 1)
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Source": Match.object_like({"BuildSpec": "images/buildspec.yml"}),
            "Environment": Match.object_like(
                {
                    "PrivilegedMode": True,
                    "Type": "LINUX_GPU_CONTAINER" if flavor.gpu else "LINUX_CONTAINER",
                    "EnvironmentVariables": Match.array_with(
                        [
                            Match.object_like({"Name": "DLC_IMAGE", "Value": base}),
                            Match.object_like({"Name": "DOCKERFILE", "Value": flavor.dockerfile}),
                            Match.object_like(
                                {
                                    "Name": "IMAGE_TAG",
                                    "Value": Match.string_like_regexp(
                                        rf"^{flavor.label}-[0-9a-f]{{32}}$"
                                    ),
                                }
                            ),
                            Match.object_like({"Name": "SMOKE_BACKEND", "Value": flavor.backend}),
                        ]
                    ),
                }
            ),
        },
    )


def test_image_tag_hashes_every_input() -> None:
    base = image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "1" * 64)
    assert base != image_tag(ImageFlavor.CPU, "b" * 64, "repo@sha256:" + "1" * 64)
    assert base != image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "2" * 64)
    assert base != image_tag(ImageFlavor.CUDA, "a" * 64, "repo@sha256:" + "1" * 64)
    assert base == image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "1" * 64)


def test_image_build_role_pushes_only_to_its_repository(synth: Synth) -> None:
    raw = synth.raw("dev", "images")
    repository_arn = {"Fn::GetAtt": [logical_id(raw, "AWS::ECR::Repository"), "Arn"]}
    push = [s for _, s in statements(raw) if "ecr:PutImage" in as_list(s["Action"])]
    assert len(push) == 1
    synth.template("dev", "images").has_resource_properties(
        "AWS::IAM::Policy",
        {
            "PolicyDocument": {
                "Statement": Match.array_with(
                    [
                        Match.object_like(
                            {
                                "Action": Match.array_with(["ecr:PutImage"]),
                                "Resource": repository_arn,
                            }
                        )
                    ]
                )
            }
        },
    )


def test_image_build_refuses_a_mutable_base_image() -> None:
    stack = cdk.Stack(cdk.App(), "Probe")
    with pytest.raises(PropsError, match="not digest-pinned"):
        ImageBuildProject(
            stack,
            "CpuImage",
            flavor=ImageFlavor.CPU,
            base_image="public.ecr.aws/deep-learning-containers/llama-cpp:latest",
            source=RepoSource(stack, "Source", root=cdk_app.REPO_ROOT, include=SOURCE_PATHS),
            repository=ecr.Repository(stack, "Repository"),
            encryption_key=kms.Key(stack, "Key"),
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )
