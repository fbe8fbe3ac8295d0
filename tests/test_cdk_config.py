"""Per-environment config: every rule rejects a bad value with a message naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from stacks.config import (
    ALL_ENVIRONMENTS,
    ENVIRONMENTS,
    PUBLISHED_DLC_IMAGES,
    AlarmThresholds,
    Autoscaling,
    ConfigError,
    CpuPlacement,
    DecisionEndpointSettings,
    DlcImages,
    EnvironmentConfig,
    GpuPlacement,
    ModelSource,
    NetworkSettings,
    ScalingMetric,
    StandardEndpointSettings,
    require_digest_image,
    select_environments,
)

DIGEST = "sha256:" + "0" * 64
SCALING = Autoscaling(
    min_capacity=1, max_capacity=2, metric=ScalingMetric.INVOCATIONS, target_value=5
)


def gpu(**overrides: Any) -> GpuPlacement:
    values: dict[str, Any] = {
        "instance_pools": ("ml.g6e.xlarge", "ml.g5.2xlarge"),
        "provision_timeout_seconds": 1200,
        "inference_ami_version": "al2023-ami-sagemaker-inference-gpu-4-1",
    }
    return GpuPlacement(**{**values, **overrides})


def test_every_shipped_environment_is_valid_and_selectable() -> None:
    assert {"dev", "prod", "gpu"} <= set(ENVIRONMENTS)
    assert select_environments("prod") == (ENVIRONMENTS["prod"],)
    assert select_environments(ALL_ENVIRONMENTS) == tuple(ENVIRONMENTS.values())


def test_unknown_environment_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown environment.*dev.*prod.*gpu.*all"):
        select_environments("staging")


def test_config_is_frozen_including_its_tags() -> None:
    dev = ENVIRONMENTS["dev"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dev.region = "eu-west-1"  # type: ignore[misc]
    with pytest.raises(TypeError):
        dev.tags["owner"] = "someone"  # type: ignore[index]


@pytest.mark.parametrize(
    "uri",
    [
        "public.ecr.aws/deep-learning-containers/llama-cpp:server-sagemaker-cpu-v1",
        "public.ecr.aws/deep-learning-containers/llama-cpp:latest",
        "repo@sha256:" + "0" * 63,
        "repo@sha256:" + "A" * 64,
        "repo:tag@sha256",
    ],
)
def test_mutable_or_malformed_image_references_are_rejected(uri: str) -> None:
    with pytest.raises(ConfigError, match="not digest-pinned"):
        require_digest_image(uri, "dlc_images.cpu")
    with pytest.raises(ConfigError, match=r"dlc_images\.cpu"):
        DlcImages(cpu=uri, cuda=PUBLISHED_DLC_IMAGES.cuda)


def test_digest_pinned_image_is_accepted() -> None:
    assert require_digest_image(f"repo/name@{DIGEST}", "x") == f"repo/name@{DIGEST}"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"uri": "hf://org/repo@rev/model.bin"}, "model.uri"),
        ({"uri": "ftp://host/model.gguf"}, "model.uri"),
        ({"uri": "https://host/model.gguf"}, "model.uri"),
        ({"uri": "hf://org/repo@main/model.gguf"}, "model.uri: revision 'main'"),
        ({"sha256": "abc"}, "model.sha256"),
    ],
)
def test_model_source_rules(kwargs: dict[str, str], field: str) -> None:
    values = {"uri": f"hf://org/repo@{'a' * 40}/model.gguf", "sha256": "0" * 64, **kwargs}
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        ModelSource(**values)


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
    with pytest.raises(ConfigError, match=message):
        gpu(**overrides)


def test_gpu_pool_bounds_are_inclusive() -> None:
    pools = tuple(f"ml.g5.{n}xlarge" for n in (2, 4, 8, 12, 16))
    assert gpu(instance_pools=pools, provision_timeout_seconds=300).instance_pools == pools
    assert gpu(provision_timeout_seconds=3600).provision_timeout_seconds == 3600


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: CpuPlacement(instance_type="c6i.2xlarge", threads=8), "cpu.instance_type"),
        (lambda: CpuPlacement(instance_type="ml.c6i.2xlarge", threads=0), "cpu.threads"),
        (
            lambda: Autoscaling(
                min_capacity=3, max_capacity=2, metric=ScalingMetric.INVOCATIONS, target_value=1
            ),
            "min_capacity",
        ),
        (
            lambda: Autoscaling(
                min_capacity=0, max_capacity=2, metric=ScalingMetric.INVOCATIONS, target_value=1
            ),
            "min_capacity",
        ),
        (
            lambda: Autoscaling(
                min_capacity=1, max_capacity=2, metric=ScalingMetric.CONCURRENCY, target_value=0
            ),
            "target_value",
        ),
        (lambda: AlarmThresholds(five_xx_rate_percent=0), "five_xx_rate_percent"),
        (lambda: AlarmThresholds(p95_model_latency_ms=0), "p95_model_latency_ms"),
        (lambda: AlarmThresholds(max_disk_utilization_percent=120), "max_disk_utilization"),
        (
            lambda: DecisionEndpointSettings(
                placement=CpuPlacement(instance_type="ml.c6i.2xlarge", threads=8),
                gpu_layers=-1,
                autoscaling=SCALING,
            ),
            "CPU placement",
        ),
        (
            lambda: DecisionEndpointSettings(placement=gpu(), gpu_layers=0, autoscaling=SCALING),
            "GPU pools",
        ),
        (
            lambda: DecisionEndpointSettings(
                placement=gpu(), gpu_layers=-1, autoscaling=SCALING, max_in_flight=100
            ),
            "decision: SEMIF_MAX_IN_FLIGHT=100 is out of range; allowed 1..64",
        ),
        (
            lambda: DecisionEndpointSettings(
                placement=gpu(), gpu_layers=-1, autoscaling=SCALING, max_tokens=200_000
            ),
            "decision: SEMIF_MAX_TOKENS=200000 is out of range",
        ),
        (
            lambda: StandardEndpointSettings(
                instance_type="ml.c6i.2xlarge", context_size=4096, threads=8, gpu_layers=99
            ),
            "standard.gpu_layers",
        ),
        (
            lambda: StandardEndpointSettings(
                instance_type="ml.c6i.2xlarge", context_size=100, threads=8
            ),
            "standard.context_size",
        ),
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
def test_settings_rules(factory: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        factory()


def test_gpu_decision_endpoints_get_long_startup_timeouts() -> None:
    settings = DecisionEndpointSettings(placement=gpu(), gpu_layers=-1, autoscaling=SCALING)
    assert settings.uses_gpu
    assert settings.startup_timeout_seconds >= 600


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "Prod"}, "name"),
        ({"account": "1234"}, "account"),
        ({"region": "useast1"}, "region"),
        ({"endpoints": frozenset()}, "endpoints"),
        ({"tags": {"": "x"}}, "tags"),
    ],
)
def test_environment_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(ENVIRONMENTS["dev"], **overrides)


def test_environment_accepts_a_valid_replacement() -> None:
    config = dataclasses.replace(ENVIRONMENTS["dev"], name="test", account="999999999999")
    assert isinstance(config, EnvironmentConfig)
    assert config.account == "999999999999"
