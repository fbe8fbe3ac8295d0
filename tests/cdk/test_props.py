"""Construct props: every rule rejects a bad value with a message naming the field."""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
import pytest

from cdk_constructs.artifact_bucket import ArtifactBucket
from cdk_constructs.endpoint_operations import AlarmThresholds, Autoscaling
from cdk_constructs.endpoint_props import (
    CpuPlacement,
    GpuPlacement,
    NetworkSettings,
)
from cdk_constructs.model_artifact import ModelArtifact
from cdk_constructs.model_build import ModelCalibration, ModelChatTemplate, model_object_key
from cdk_constructs.validation import PropsError, require_digest_image
from stacks.config import DlcImages
from stacks.environments import PUBLISHED_DLC_IMAGES

DIGEST = "sha256:" + "0" * 64
MUTABLE_DLC = "public.ecr.aws/deep-learning-containers/llama-cpp:server-sagemaker-cpu-v1"


def gpu(**overrides: Any) -> GpuPlacement:
    values: dict[str, Any] = {
        "instance_pools": ("ml.g6e.xlarge", "ml.g5.2xlarge"),
        "provision_timeout_seconds": 1200,
        "inference_ami_version": "al2023-ami-sagemaker-inference-gpu-4-1",
    }
    return GpuPlacement(**{**values, **overrides})


@pytest.mark.parametrize(
    "uri",
    [
        MUTABLE_DLC,
        "public.ecr.aws/deep-learning-containers/llama-cpp:latest",
        "repo@sha256:" + "0" * 63,
        "repo@sha256:" + "A" * 64,
        "repo:tag@sha256",
    ],
)
def test_mutable_or_malformed_image_references_are_rejected(uri: str) -> None:
    with pytest.raises(PropsError, match="not digest-pinned"):
        require_digest_image(uri, "dlc_images.cpu")
    with pytest.raises(PropsError, match=r"dlc_images\.cpu"):
        DlcImages(cpu=uri, cuda=PUBLISHED_DLC_IMAGES.cuda)


def test_digest_pinned_image_is_accepted() -> None:
    assert require_digest_image(f"repo/name@{DIGEST}", "x") == f"repo/name@{DIGEST}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"instance_pools": ()}, "1..5"),
        ({"instance_pools": tuple(f"ml.g5.{n}xlarge" for n in range(2, 8))}, "1..5"),
        ({"instance_pools": ("ml.g5.2xlarge", "ml.g5.2xlarge")}, "repeats"),
        ({"instance_pools": ("g5.2xlarge",)}, r"instance_pools\[0\]"),
        ({"provision_timeout_seconds": 299}, "300..3600"),
        ({"provision_timeout_seconds": 3601}, "300..3600"),
        ({"inference_ami_version": ""}, "inference_ami_version"),
    ],
)
def test_gpu_pool_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(PropsError, match=message):
        gpu(**overrides)


def test_gpu_pool_bounds_are_inclusive() -> None:
    pools = tuple(f"ml.g5.{n}xlarge" for n in (2, 4, 8, 12, 16))
    assert gpu(instance_pools=pools, provision_timeout_seconds=300).instance_pools == pools
    assert gpu(provision_timeout_seconds=3600).provision_timeout_seconds == 3600


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: CpuPlacement(instance_type="c6i.2xlarge"), "cpu.instance_type"),
        (lambda: Autoscaling(min_capacity=3, max_capacity=2), "min_capacity"),
        (lambda: Autoscaling(min_capacity=0, max_capacity=2), "min_capacity"),
        (lambda: ModelCalibration(path="/abs.json", sha256="a" * 64), "calibration.path"),
        (lambda: ModelCalibration(path="../up.json", sha256="a" * 64), "calibration.path"),
        (lambda: ModelCalibration(path="c.json", sha256="A" * 64), "calibration.sha256"),
        (lambda: ModelChatTemplate(path="/t.jinja", sha256="a" * 64), "chat_template.path"),
        (lambda: ModelChatTemplate(path="../t.jinja", sha256="a" * 64), "chat_template.path"),
        (lambda: ModelChatTemplate(path="t.jinja", sha256="a" * 63), "chat_template.sha256"),
        (lambda: AlarmThresholds(five_xx_rate_percent=0), "five_xx_rate_percent"),
        (lambda: AlarmThresholds(max_disk_utilization_percent=120), "max_disk_utilization"),
        (
            lambda: NetworkSettings(subnet_ids=(), security_group_ids=("sg-0123456789abcdef0",)),
            "subnet_ids",
        ),
        (
            lambda: NetworkSettings(
                subnet_ids=("subnet-0123456789abcdef0",), security_group_ids=("default",)
            ),
            "security_group_ids",
        ),
    ],
)
def test_prop_rules(factory: Any, message: str) -> None:
    with pytest.raises(PropsError, match=message):
        factory()


def _artifacts() -> tuple[cdk.Stack, ArtifactBucket]:
    stack = cdk.Stack(cdk.App(), "Probe")
    return stack, ArtifactBucket(stack, "Artifacts", removal_policy=cdk.RemovalPolicy.DESTROY)


@pytest.mark.parametrize(
    "object_key", ["", "/models/x/model.tar.gz", "models/x/model.gguf", cdk.Aws.STACK_NAME]
)
def test_model_artifact_needs_a_fixed_relative_tar_gz_key(object_key: str) -> None:
    _, artifacts = _artifacts()
    with pytest.raises(PropsError, match=r"model\.object_key"):
        ModelArtifact(bucket=artifacts.bucket, key=artifacts.key, object_key=object_key)


def test_model_artifact_data_url_names_its_bucket_and_key() -> None:
    stack, artifacts = _artifacts()
    model = ModelArtifact(
        bucket=artifacts.bucket, key=artifacts.key, object_key="models/x/model.tar.gz"
    )
    assert stack.resolve(model.model_data_url) == {
        "Fn::Join": ["", ["s3://", {"Ref": "ArtifactsBucket88671897"}, "/models/x/model.tar.gz"]]
    }


def test_a_calibration_gets_its_own_model_object() -> None:
    """A refit must reach the endpoints: a new object key is a new ModelDataUrl, so a new
    SageMaker model and a blue/green update, never an object changed under a running one."""
    gguf = "b" * 64
    calibrated = ModelCalibration(path="calibration/prod.json", sha256="c" * 64)
    assert model_object_key(gguf) == f"models/{gguf}/model.tar.gz"
    assert model_object_key(gguf, calibrated) == (
        f"models/{gguf}/calibration-{'c' * 64}/model.tar.gz"
    )


def test_a_chat_template_gets_its_own_model_object() -> None:
    """Like a calibration: a new template is a new key, so a new SageMaker model. Its part
    follows the calibration's, and neither changes the key of a model built without it."""
    gguf = "b" * 64
    calibrated = ModelCalibration(path="calibration/prod.json", sha256="c" * 64)
    templated = ModelChatTemplate(path="templates/prod.jinja", sha256="d" * 64)
    assert model_object_key(gguf, chat_template=templated) == (
        f"models/{gguf}/chat-template-{'d' * 64}/model.tar.gz"
    )
    assert model_object_key(gguf, calibrated, templated) == (
        f"models/{gguf}/calibration-{'c' * 64}/chat-template-{'d' * 64}/model.tar.gz"
    )
    assert model_object_key(gguf, calibrated, None) == model_object_key(gguf, calibrated)
    other = ModelChatTemplate(path="templates/prod.jinja", sha256="e" * 64)
    assert model_object_key(gguf, chat_template=other) != model_object_key(
        gguf, chat_template=templated
    )
