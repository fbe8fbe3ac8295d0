"""Per-environment config: every rule rejects a bad value with a message naming the field."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from cdk_constructs.endpoint_operations import Autoscaling, ScalingMetric
from cdk_constructs.sagemaker_endpoint import CpuPlacement, GpuPlacement
from stacks.config import (
    ConfigError,
    DecisionEndpointSettings,
    EnvironmentConfig,
    ModelSource,
    StandardEndpointSettings,
)
from stacks.environments import ENVIRONMENTS

SCALING = Autoscaling(
    min_capacity=1, max_capacity=2, metric=ScalingMetric.INVOCATIONS, target_value=5
)
CPU = CpuPlacement(instance_type="ml.c6i.2xlarge")


def gpu() -> GpuPlacement:
    return GpuPlacement(
        instance_pools=("ml.g6e.xlarge", "ml.g5.2xlarge"),
        provision_timeout_seconds=1200,
        inference_ami_version="al2023-ami-sagemaker-inference-gpu-4-1",
    )


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
    ("factory", "message"),
    [
        (
            lambda: DecisionEndpointSettings(
                placement=CPU, threads=8, gpu_layers=-1, autoscaling=SCALING
            ),
            "CPU placement",
        ),
        (
            lambda: DecisionEndpointSettings(
                placement=CPU, threads=0, gpu_layers=0, autoscaling=SCALING
            ),
            "decision.threads",
        ),
        (
            lambda: DecisionEndpointSettings(placement=CPU, gpu_layers=0, autoscaling=SCALING),
            "decision.threads: None on a CPU placement",
        ),
        (
            lambda: DecisionEndpointSettings(placement=gpu(), gpu_layers=0, autoscaling=SCALING),
            "GPU pools",
        ),
        (
            lambda: DecisionEndpointSettings(
                placement=gpu(), threads=8, gpu_layers=-1, autoscaling=SCALING
            ),
            "decision.threads: 8 on GPU pools",
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
            lambda: StandardEndpointSettings(placement=CPU, context_size=100, threads=8),
            "standard.context_size",
        ),
        (
            lambda: StandardEndpointSettings(placement=CPU, context_size=4096, threads=0),
            "standard.threads",
        ),
        (
            lambda: StandardEndpointSettings(
                placement=gpu(),  # type: ignore[arg-type]
                context_size=4096,
                threads=8,
            ),
            "standard.placement",
        ),
    ],
)
def test_endpoint_settings_rules(factory: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        factory()


def test_standard_endpoint_takes_no_gpu_layers() -> None:
    """The CPU DLC on a CPU instance: there is no GPU layer count to set."""
    with pytest.raises(TypeError, match="gpu_layers"):
        StandardEndpointSettings(  # type: ignore[call-arg]
            placement=CPU, context_size=4096, threads=8, gpu_layers=99
        )
    settings = StandardEndpointSettings(placement=CPU, context_size=4096, threads=8)
    assert settings.container_environment()["SM_LLAMA_CPP_N_GPU_LAYERS"] == "0"


def test_gpu_decision_endpoints_get_long_startup_timeouts() -> None:
    settings = DecisionEndpointSettings(placement=gpu(), gpu_layers=-1, autoscaling=SCALING)
    assert settings.uses_gpu
    assert settings.startup_timeout_seconds >= 600
    assert settings.instance_pools == ("ml.g6e.xlarge", "ml.g5.2xlarge")


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
    config = dataclasses.replace(ENVIRONMENTS["dev"], name="test", account="498765432107")
    assert isinstance(config, EnvironmentConfig)
    assert config.account == "498765432107"
