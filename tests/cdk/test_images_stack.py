"""The images stack: the DLC mirror (every environment), the adapter repository and the image
build project of each flavor."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML (via cfn-lint); no stubs pinned
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_kms as kms
from aws_cdk.assertions import Capture, Match

from cdk_constructs.build_project import QUEUED_TIMEOUT, RepoSource
from cdk_constructs.deploy_time_build import MAX_BUILD_TIMEOUT, TOTAL_TIMEOUT
from cdk_constructs.dlc_mirror import (
    CRANE_VERSION,
    MIRROR_BUILD_TIMEOUT,
    PROGRAM,
    DlcMirror,
    mirror_tag,
    pinned_digest,
)
from cdk_constructs.image_build import SOURCE_PATHS, ImageBuildProject, ImageFlavor, image_tag
from cdk_constructs.validation import PropsError
from stacks.config import REPO_ROOT, DlcImages, EndpointKind
from stacks.deployment import mirror_repository_name
from stacks.environments import ENVIRONMENTS, PUBLISHED_DLC_IMAGES
from tests.support.templates import Synth, as_list, resources, statements, synthesize_environment


def _repository_id(raw: Mapping[str, Any], *, mirror: bool) -> str:
    for name, resource in resources(raw, "AWS::ECR::Repository"):
        if ("RepositoryName" in resource["Properties"]) == mirror:
            return name
    raise AssertionError("repository not found")


@pytest.mark.parametrize(("env", "flavor"), [("dev", ImageFlavor.CPU), ("gpu", ImageFlavor.CUDA)])
def test_image_build_project_per_flavor(synth: Synth, env: str, flavor: ImageFlavor) -> None:
    config = ENVIRONMENTS[env]
    template = synth.template(env, "images")
    raw = template.to_json()
    template.resource_count_is("AWS::ECR::Repository", 2)
    template.has_resource_properties(
        "AWS::ECR::Repository",
        {
            "RepositoryName": Match.absent(),
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
    digest = base.rsplit("@", 1)[1]
    mirror = _repository_id(raw, mirror=True)
    pull = Capture()
    template.resource_count_is("AWS::CodeBuild::Project", 2)  # the image build + the DLC copy
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Source": Match.object_like({"BuildSpec": "images/buildspec.yml"}),
            "Cache": {"Type": "LOCAL", "Modes": ["LOCAL_DOCKER_LAYER_CACHE"]},
            "QueuedTimeoutInMinutes": QUEUED_TIMEOUT.to_minutes(),
            "TimeoutInMinutes": MAX_BUILD_TIMEOUT.to_minutes(),
            "Environment": Match.object_like(
                {
                    "PrivilegedMode": True,
                    # No GPU host: the CUDA image is built and smoke-tested on CPU.
                    "Type": "LINUX_CONTAINER",
                    "EnvironmentVariables": Match.array_with(
                        [
                            Match.object_like({"Name": "DLC_IMAGE", "Value": pull}),
                            Match.object_like({"Name": "DOCKERFILE", "Value": flavor.dockerfile}),
                            Match.object_like(
                                {
                                    "Name": "IMAGE_TAG",
                                    "Value": Match.string_like_regexp(
                                        rf"^{flavor.label}-[0-9a-f]{{32}}$"
                                    ),
                                }
                            ),
                            Match.object_like({"Name": "SMOKE_BACKEND", "Value": "CPU"}),
                            Match.object_like({"Name": "SMOKE_ENV", "Value": flavor.smoke_env}),
                            Match.object_like(
                                {"Name": "SMOKE_REQUIRE_FILE", "Value": flavor.backend_library}
                            ),
                        ]
                    ),
                }
            ),
        },
    )
    # The base is pulled from the private mirror, by the pinned digest.
    assert mirror in str(pull.as_object())
    assert pull.as_object()["Fn::Join"][1][-1] == f"@{digest}"


def test_cuda_image_smoke_test_serves_on_cpu_and_requires_the_cuda_library() -> None:
    assert ImageFlavor.CUDA.smoke_backend == "CPU"
    assert ImageFlavor.CUDA.smoke_env == "SEMIF_N_GPU_LAYERS=0"
    assert "libggml-cuda" in ImageFlavor.CUDA.backend_library


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_dlc_mirror_copies_the_pinned_digests_it_needs(synth: Synth, env: str) -> None:
    config = ENVIRONMENTS[env]
    template = synth.template(env, "images")
    template.has_resource(
        "AWS::ECR::Repository",
        {
            "DeletionPolicy": "Delete",
            "Properties": Match.object_like(
                {
                    "RepositoryName": mirror_repository_name(config),
                    "ImageTagMutability": "IMMUTABLE",
                    "EmptyOnDelete": True,
                    # Platform manifests of an index are untagged: nothing may expire here.
                    "LifecyclePolicy": Match.absent(),
                }
            ),
        },
    )
    wanted = {"cpu": config.dlc_images.cpu}
    if config.decision.uses_gpu:
        wanted["cuda"] = config.dlc_images.cuda
    pairs = " ".join(f"{mirror_tag(label, ref)}={ref}" for label, ref in sorted(wanted.items()))
    # The standard endpoint serves the CPU DLC itself: its served digest is checked too.
    served = config.dlc_images.cpu_served_digest or pinned_digest(config.dlc_images.cpu)
    serves = f"{mirror_tag('cpu', config.dlc_images.cpu)}={served}"
    variables = [Match.object_like({"Name": "MIRROR_IMAGES", "Value": pairs})]
    if config.deploys(EndpointKind.STANDARD):
        variables.append(Match.object_like({"Name": "MIRROR_SERVED", "Value": serves}))
    spec, location = Capture(), Capture()
    template.has_resource_properties(
        "AWS::CodeBuild::Project",
        {
            "Source": {"Type": "S3", "BuildSpec": spec, "Location": location},
            "TimeoutInMinutes": MIRROR_BUILD_TIMEOUT.to_minutes(),
            "QueuedTimeoutInMinutes": QUEUED_TIMEOUT.to_minutes(),
            "Environment": Match.object_like(
                {
                    "PrivilegedMode": False,
                    "EnvironmentVariables": Match.array_with(variables),
                }
            ),
        },
    )
    names = [
        v["Name"]
        for _, p in resources(template.to_json(), "AWS::CodeBuild::Project")
        for v in p["Properties"]["Environment"]["EnvironmentVariables"]
    ]
    assert ("MIRROR_SERVED" in names) == config.deploys(EndpointKind.STANDARD)
    buildspec = yaml.safe_load(spec.as_string())
    script = "\n".join(buildspec["phases"]["build"]["commands"])
    install = buildspec["phases"]["install"]
    assert f"crane@{CRANE_VERSION}" in " ".join(install["commands"])
    assert install["runtime-versions"]["python"] == "3.12"
    # Copy, verify, serve: the program, given the project's variables.
    program = f'python3 {PROGRAM} "${{MIRROR_REPOSITORY_URI}}" "${{MIRROR_IMAGES}}"'
    assert script.rstrip().endswith(f'{program} "${{MIRROR_SERVED:-}}"')
    # The build's source is the program alone, so nothing else re-runs the copy.
    asset = str(location.as_object()["Fn::Join"][1][-1]).strip("/").removesuffix(".zip")
    shipped = [
        p.relative_to(synth.outdir / f"asset.{asset}")
        for p in (synth.outdir / f"asset.{asset}").rglob("*")
        if p.is_file()
    ]
    assert [str(path) for path in shipped] == [PROGRAM]
    template.resource_count_is("Custom::DeployTimeBuild", 1)


def _mirror(served: dict[str, str | None]) -> DlcMirror:
    stack = cdk.Stack(cdk.App(), "Probe")
    key = kms.Key(stack, "Key")
    images = {
        "cpu": "public.ecr.aws/dlc@sha256:" + "1" * 64,
        "cuda": "public.ecr.aws/dlc@sha256:" + "2" * 64,
    }
    return DlcMirror(
        stack,
        "Mirror",
        repository_name="semif-x/llama-cpp-dlc",
        images=images,
        served=served,
        repo_root=REPO_ROOT,
        encryption_key=key,
        log_key=key,
    )


def test_the_mirror_serves_the_pinned_served_digest_and_builds_upon_the_pin() -> None:
    mirror = _mirror({"cpu": "sha256:" + "3" * 64})
    assert mirror.image("cpu").digest == "sha256:" + "3" * 64
    assert (
        "sha256:" + "1" * 64
        in cdk.Stack.of(mirror).resolve(mirror.pull_uri("cpu"))["Fn::Join"][1][-1]
    )
    assert _mirror({"cpu": None}).image("cpu").digest == "sha256:" + "1" * 64
    with pytest.raises(PropsError, match="'cuda' is not served"):
        mirror.image("cuda")


@pytest.mark.parametrize(
    ("served", "message"),
    [
        ({"gpu": None}, "served 'gpu': not one of the mirrored"),
        ({"cpu": "sha256:abc"}, "image.digest: 'sha256:abc' is not"),
    ],
)
def test_the_mirror_refuses_bad_served_images(served: dict[str, str | None], message: str) -> None:
    with pytest.raises(PropsError, match=message):
        _mirror(served)


def test_builds_end_before_the_waiter_gives_up() -> None:
    longest = max(MAX_BUILD_TIMEOUT.to_minutes(), MIRROR_BUILD_TIMEOUT.to_minutes())
    assert QUEUED_TIMEOUT.to_minutes() + longest + 1 < TOTAL_TIMEOUT.to_minutes() < 60


def test_image_tag_hashes_every_input() -> None:
    base = image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "1" * 64)
    assert base != image_tag(ImageFlavor.CPU, "b" * 64, "repo@sha256:" + "1" * 64)
    assert base != image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "2" * 64)
    assert base != image_tag(ImageFlavor.CUDA, "a" * 64, "repo@sha256:" + "1" * 64)
    assert base == image_tag(ImageFlavor.CPU, "a" * 64, "repo@sha256:" + "1" * 64)


def test_image_build_role_pushes_only_to_its_repository(synth: Synth) -> None:
    raw = synth.raw("dev", "images")
    adapter = {"Fn::GetAtt": [_repository_id(raw, mirror=False), "Arn"]}
    mirror = {"Fn::GetAtt": [_repository_id(raw, mirror=True), "Arn"]}
    push = [
        (name, s["Resource"])
        for name, s in statements(raw)
        if "ecr:PutImage" in as_list(s["Action"])
    ]
    assert sorted(resource["Fn::GetAtt"][0] for _, resource in push) == sorted(
        [adapter["Fn::GetAtt"][0], mirror["Fn::GetAtt"][0]]
    )
    for name, resource in push:  # each build pushes to its own repository only
        expected = mirror if name.startswith("DlcMirror") else adapter
        assert resource == expected, name


def test_image_build_refuses_a_mutable_base_image() -> None:
    stack = cdk.Stack(cdk.App(), "Probe")
    repository = ecr.Repository(stack, "Repository")
    with pytest.raises(PropsError, match="not digest-pinned"):
        ImageBuildProject(
            stack,
            "CpuImage",
            flavor=ImageFlavor.CPU,
            base_image="public.ecr.aws/deep-learning-containers/llama-cpp:latest",
            base_pull_uri="unused",
            base_repository=repository,
            source=RepoSource(stack, "Source", root=REPO_ROOT, include=SOURCE_PATHS),
            repository=repository,
            encryption_key=kms.Key(stack, "Key"),
            removal_policy=cdk.RemovalPolicy.DESTROY,
        )


def test_a_pinned_served_digest_is_what_the_standard_endpoint_serves(tmp_path: Path) -> None:
    """An index or OCI pin: the standard model names the served digest the config pins,
    and the mirror build is told to check exactly that one."""
    config = ENVIRONMENTS["dev"]
    served = "sha256:" + "5" * 64
    images = dataclasses.replace(config.dlc_images, cpu_served_digest=served)
    assembly = synthesize_environment(dataclasses.replace(config, dlc_images=images), tmp_path)
    standard = assembly.get_stack_by_name("semif-dev-standard").template
    ((_, model),) = resources(standard, "AWS::SageMaker::Model")
    image = model["Properties"]["PrimaryContainer"]["Image"]["Fn::Join"][1][-1]
    assert image == f"/semif-dev/llama-cpp-dlc@{served}"
    mirror = assembly.get_stack_by_name("semif-dev-images").template
    variables = [
        v
        for _, project in resources(mirror, "AWS::CodeBuild::Project")
        for v in project["Properties"]["Environment"]["EnvironmentVariables"]
    ]
    serves = [v["Value"] for v in variables if v["Name"] == "MIRROR_SERVED"]
    assert serves == [f"{mirror_tag('cpu', config.dlc_images.cpu)}={served}"]


def test_a_served_digest_must_be_a_digest() -> None:
    with pytest.raises(PropsError, match=r"dlc_images\.cpu_served_digest: 'latest' is not a"):
        DlcImages(
            cpu=PUBLISHED_DLC_IMAGES.cpu, cuda=PUBLISHED_DLC_IMAGES.cuda, cpu_served_digest="latest"
        )
