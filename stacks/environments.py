"""The environments this app deploys: dev, prod and gpu. Data only; the types are in config.py.

To add an environment, add one `EnvironmentConfig(...)` to `ENVIRONMENTS`; `-c env=NAME`
then selects it and the tests synthesize it too. No environment names an account: the
deploy targets the account of your credentials (or `-c account=...`), see
`stacks/targets.py`. Network placement is opt-in (`network=` here, or `-c subnet_ids=...`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from cdk_constructs.endpoint_operations import Autoscaling, DecisionSignalThresholds, ScaleToZero
from cdk_constructs.endpoint_props import CpuPlacement, GpuPlacement
from model_build.embedded import SMOLLM2
from stacks.config import (
    CANARY_ONE_INSTANCE,
    AsyncEndpointSettings,
    ConfigError,
    DecisionEndpointSettings,
    DlcImages,
    EndpointKind,
    EnvironmentConfig,
    ModelSource,
    StandardEndpointSettings,
)

# The published llama.cpp DLC images (SageMaker CPU and CUDA 13) at the digests the AWS sample
# validated. The Dockerfiles' default bases are the same digests (tests/images/test_images.py
# checks); refresh both deliberately.
PUBLISHED_DLC_IMAGES = DlcImages(
    cpu="public.ecr.aws/deep-learning-containers/llama-cpp@sha256:"
    "1f19c220f5f169228f20cdddca00f4838be22a3a1ce9002bc444006adc3d6d43",
    cuda="public.ecr.aws/deep-learning-containers/llama-cpp@sha256:"
    "9f2eb2d9cbdc3172c2046117c4a43401bc95dbabdc3e2aeaa35daa11565c8b36",
)

# The embedded plumbing model: tiny, Apache-2.0, from PyPI; pinned once, in model_build.
SMOLLM2_135M = ModelSource(uri=SMOLLM2.source_uri, sha256=SMOLLM2.sha256, size_bytes=SMOLLM2.size)

# The production model the AWS sample pinned: Qwen3.5 4B, Q4_K_M, at a fixed commit.
QWEN35_4B = ModelSource(
    uri="hf://bartowski/Qwen_Qwen3.5-4B-GGUF@4168f45a16a1290d65a4ec0fa312ae917a4c15d6"
    "/Qwen_Qwen3.5-4B-Q4_K_M.gguf",
    sha256="13c16f426047e2de38cd075bdade4a7bcbc8c774384876f677740cda65f8a983",
)

CUDA13_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"

# The ScoringSpeed rollback alarm's limit, milliseconds per decoded row, per model and
# hardware: a few times what a healthy endpoint's dashboard shows (the query "Seconds per
# decoded row"). Starting points until each endpoint has been read: SmolLM2-135M on an
# ml.c6i.2xlarge decodes well under 1 ms a row; Qwen3.5-4B Q4_K_M on an ml.c6i.8xlarge a few
# ms (100-300 rows/s); on the gpu pools well under 1 ms, the slowest pool type (g4dn's T4)
# included. Generous on CPU, where a pass's cost does not depend on its size; on GPU a
# small pass costs nearly as much as a full one, and the limit leaves room for quiet hours.
SMOLLM2_CPU_MS = 10.0
QWEN35_CPU_MS = 40.0
QWEN35_GPU_MS = 5.0

ENVIRONMENTS: Mapping[str, EnvironmentConfig] = MappingProxyType(
    {
        env.name: env
        for env in (
            EnvironmentConfig(
                name="dev",
                account=None,
                region="us-east-1",
                model=SMOLLM2_135M,
                dlc_images=PUBLISHED_DLC_IMAGES,
                endpoints=frozenset({EndpointKind.STANDARD, EndpointKind.DECISION}),
                decision=DecisionEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.2xlarge"),
                    threads=8,
                    gpu_layers=0,
                    autoscaling=Autoscaling(min_capacity=1, max_capacity=2),
                    signal_alarms=DecisionSignalThresholds(max_ms_per_decoded_row=SMOLLM2_CPU_MS),
                    async_endpoint=AsyncEndpointSettings(),
                    # Idle most of the day: no instance while no call comes (docs/deploy.md,
                    # "Scale to zero"); prod keeps its instances warm.
                    scale_to_zero=ScaleToZero(idle_minutes=10),
                ),
                standard=StandardEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.2xlarge"),
                    context_size=4096,
                    threads=8,
                ),
                retain_data=False,
                tags={"project": "semif-decision", "environment": "dev"},
            ),
            EnvironmentConfig(
                name="prod",
                account=None,
                region="us-east-1",
                model=QWEN35_4B,
                dlc_images=PUBLISHED_DLC_IMAGES,
                endpoints=frozenset({EndpointKind.DECISION}),
                decision=DecisionEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.8xlarge"),
                    threads=32,
                    gpu_layers=0,
                    autoscaling=Autoscaling(min_capacity=2, max_capacity=6),
                    signal_alarms=DecisionSignalThresholds(max_ms_per_decoded_row=QWEN35_CPU_MS),
                    rollout=CANARY_ONE_INSTANCE,
                    prefix_aware_routing=True,
                ),
                standard=StandardEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.2xlarge"),
                    context_size=8192,
                    threads=8,
                ),
                retain_data=True,
                tags={"project": "semif-decision", "environment": "prod"},
            ),
            EnvironmentConfig(
                name="gpu",
                account=None,
                region="us-west-2",
                model=QWEN35_4B,
                dlc_images=PUBLISHED_DLC_IMAGES,
                endpoints=frozenset({EndpointKind.STANDARD, EndpointKind.DECISION}),
                decision=DecisionEndpointSettings(
                    placement=GpuPlacement(
                        instance_pools=(
                            "ml.g6e.xlarge",
                            "ml.g6.2xlarge",
                            "ml.g5.2xlarge",
                            "ml.g4dn.2xlarge",
                        ),
                        provision_timeout_seconds=1200,
                        inference_ami_version=CUDA13_AMI,
                    ),
                    gpu_layers=-1,
                    autoscaling=Autoscaling(min_capacity=1, max_capacity=4),
                    signal_alarms=DecisionSignalThresholds(max_ms_per_decoded_row=QWEN35_GPU_MS),
                ),
                standard=StandardEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.2xlarge"),
                    context_size=8192,
                    threads=8,
                ),
                retain_data=False,
                tags={"project": "semif-decision", "environment": "gpu"},
            ),
        )
    }
)

ALL_ENVIRONMENTS = "all"


def select_environments(name: str) -> tuple[EnvironmentConfig, ...]:
    """Resolve `-c env=NAME`: one environment, or every one for `all` (CI synth)."""
    if name == ALL_ENVIRONMENTS:
        return tuple(ENVIRONMENTS.values())
    try:
        return (ENVIRONMENTS[name],)
    except KeyError:
        known = ", ".join([*ENVIRONMENTS, ALL_ENVIRONMENTS])
        raise ConfigError(f"-c env={name!r}: unknown environment; choose one of {known}") from None
