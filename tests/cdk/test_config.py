"""Per-environment config: every rule rejects a bad value with a message naming the field."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from adapter.prompts import PROMPT_VERSION
from cdk_constructs.endpoint_operations import Autoscaling, DecisionSignalThresholds
from cdk_constructs.endpoint_props import (
    CpuPlacement,
    GpuPlacement,
    LeastOutstandingRouting,
    Observability,
    PrefixAwareRouting,
    Rollout,
    TrafficShift,
)
from cdk_constructs.validation import PropsError
from model_build.build import BuildRequest
from model_build.calibration import load_calibration
from model_build.fetch import HttpSettings, RetryPolicy
from model_build.manifest import calibration_sha256
from model_build.publish import parse_destination
from model_build.sources import parse_source
from stacks import config
from stacks.config import (
    CANARY_ONE_INSTANCE,
    REPO_ROOT,
    AsyncEndpointSettings,
    ConfigError,
    DecisionEndpointSettings,
    EnvironmentConfig,
    ModelSource,
    StandardEndpointSettings,
)
from stacks.environments import ENVIRONMENTS, SMOLLM2_135M
from tests.support.templates import CALIBRATIONS, VALID_CALIBRATION, VALID_CHAT_TEMPLATE

SCALING = Autoscaling(min_capacity=1, max_capacity=2)
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
        ({"size_bytes": 0}, "model.size_bytes"),
    ],
)
def test_model_source_rules(kwargs: dict[str, Any], field: str) -> None:
    values: dict[str, Any] = {
        "uri": f"hf://org/repo@{'a' * 40}/model.gguf",
        "sha256": "0" * 64,
        **kwargs,
    }
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
        (
            lambda: StandardEndpointSettings(
                placement=CPU, context_size=4096, threads=8, initial_instance_count=0
            ),
            "standard.initial_instance_count: 0 must be >= 1",
        ),
        (
            lambda: StandardEndpointSettings(
                placement=CPU, context_size=4096, threads=8, startup_timeout_seconds=59
            ),
            r"standard.startup_timeout_seconds: 59 is outside 60..3600",
        ),
        (
            lambda: StandardEndpointSettings(
                placement=CPU, context_size=4096, threads=8, startup_timeout_seconds=3601
            ),
            r"standard.startup_timeout_seconds: 3601 is outside 60..3600",
        ),
        (  # a canary of one instance needs at least two
            lambda: StandardEndpointSettings(
                placement=CPU, context_size=4096, threads=8, rollout=CANARY_ONE_INSTANCE
            ),
            r"standard.rollout: a CANARY step of 1 instance\(s\) is 100 % of 1",
        ),
    ],
)
def test_endpoint_settings_rules(factory: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        factory()


def test_a_standard_endpoint_of_two_instances_may_canary_one() -> None:
    """The canary rule counts the standard endpoint's own instances, not a fixed one."""
    settings = StandardEndpointSettings(
        placement=CPU,
        context_size=4096,
        threads=8,
        initial_instance_count=2,
        rollout=CANARY_ONE_INSTANCE,
    )
    assert settings.rollout is CANARY_ONE_INSTANCE


def test_standard_endpoint_takes_no_gpu_layers() -> None:
    """The CPU DLC on a CPU instance: there is no GPU layer count to set."""
    with pytest.raises(TypeError, match="gpu_layers"):
        StandardEndpointSettings(  # type: ignore[call-arg]
            placement=CPU, context_size=4096, threads=8, gpu_layers=99
        )
    settings = StandardEndpointSettings(placement=CPU, context_size=4096, threads=8)
    assert settings.container_environment()["SM_LLAMA_CPP_N_GPU_LAYERS"] == "0"


def test_standard_endpoint_serves_llama_servers_metrics_and_routes_by_load() -> None:
    """SM_LLAMA_CPP_METRICS=true is the DLC's `--metrics`: llama-server then serves
    `/metrics`, which the explicit MetricsConfig publishes."""
    settings = StandardEndpointSettings(placement=CPU, context_size=4096, threads=8)
    assert settings.container_environment()["SM_LLAMA_CPP_METRICS"] == "true"
    assert settings.metrics == Observability()
    assert settings.routing == LeastOutstandingRouting()


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


def _decision(**overrides: Any) -> DecisionEndpointSettings:
    return DecisionEndpointSettings(
        placement=gpu(), gpu_layers=-1, autoscaling=SCALING, **overrides
    )


def test_decision_batching_settings_become_the_adapter_variables() -> None:
    settings = _decision(
        max_queue=64,
        queue_timeout_seconds=5,
        request_timeout_seconds=30.5,
        max_batch_requests=8,
        max_request_tokens=4096,
    )
    assert settings.container_environment() == {
        "SEMIF_VARIANT": "AllTraffic",
        "SEMIF_N_GPU_LAYERS": "-1",
        "SEMIF_MAX_TOKENS": "4096",
        "SEMIF_MAX_QUEUE": "64",
        "SEMIF_QUEUE_TIMEOUT_S": "5",
        "SEMIF_REQUEST_TIMEOUT_S": "30.5",
        "SEMIF_MAX_BATCH_REQUESTS": "8",
        "SEMIF_MAX_REQUEST_TOKENS": "4096",
        "SEMIF_WEIGHT_BUFFERS": "auto",
        "SEMIF_KV_MEMORY": "auto",
    }
    assert "SEMIF_MAX_IN_FLIGHT" not in _decision().container_environment()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # The adapter's own ranges (adapter/settings.py), named by their variable.
        ({"max_queue": 0}, "decision: SEMIF_MAX_QUEUE=0 is out of range; allowed 1..4096"),
        ({"max_queue": 5000}, "decision: SEMIF_MAX_QUEUE=5000 is out of range"),
        ({"queue_timeout_seconds": 0.05}, "decision: SEMIF_QUEUE_TIMEOUT_S=0.05 is out of range"),
        ({"request_timeout_seconds": 0.5}, "decision: SEMIF_REQUEST_TIMEOUT_S=0.5 is out of range"),
        ({"max_batch_requests": 0}, "decision: SEMIF_MAX_BATCH_REQUESTS=0 is out of range"),
        ({"max_batch_requests": 257}, "decision: SEMIF_MAX_BATCH_REQUESTS=257 is out of range"),
        ({"max_request_tokens": 63}, "decision: SEMIF_MAX_REQUEST_TOKENS=63 is out of range"),
        (
            {"weight_buffers": "amx"},
            "decision: SEMIF_WEIGHT_BUFFERS='amx' is not allowed; allowed auto, plain, all",
        ),
        (
            {"queue_timeout_seconds": 30, "request_timeout_seconds": 20},
            "decision: SEMIF_REQUEST_TIMEOUT_S",  # must be >= the queue timeout
        ),
        # SageMaker's own limit, stricter than the adapter's 3600 s.
        (
            {"request_timeout_seconds": 56},
            "decision.request_timeout_seconds: 56 is above 55; a real-time endpoint's "
            "InvokeEndpoint waits 60 s",
        ),
    ],
)
def test_decision_batching_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        _decision(**overrides)


@pytest.mark.parametrize(
    ("instance_type", "kv_memory", "message"),
    [
        ("ml.c6i.2xlarge", "auto", None),
        ("ml.c6i.2xlarge", "0.5", None),
        ("ml.c6i.2xlarge", "8GiB", None),  # 16 GiB instance: half of it
        ("ml.c6i.2xlarge", "0.75", "0.75 is more than 0.5 of the instance's memory"),
        ("ml.c6i.2xlarge", "9GiB", r"9GiB is more than 0.5 .*\(ml.c6i.2xlarge: 16 GiB\)"),
        ("ml.r7i.xlarge", "15GiB", None),  # 32 GiB
        ("ml.c6i.2xlarge", "a lot", "decision: SEMIF_KV_MEMORY='a lot' is not a budget"),
        (None, "4GiB", "4GiB cannot be checked against GPU pools; give auto or a fraction"),
    ],
)
def test_decision_kv_memory_leaves_the_instance_room(
    instance_type: str | None, kv_memory: str, message: str | None
) -> None:
    """SEMIF_KV_MEMORY is checked at synth: the adapter's syntax, and a budget in bytes
    against the CPU instance's memory (GPU pools: only auto or a fraction)."""

    def build() -> DecisionEndpointSettings:
        if instance_type is None:
            return _decision(kv_memory=kv_memory)
        return DecisionEndpointSettings(
            placement=CpuPlacement(instance_type=instance_type),
            gpu_layers=0,
            threads=8,
            autoscaling=SCALING,
            kv_memory=kv_memory,
        )

    if message is None:
        assert build().container_environment()["SEMIF_KV_MEMORY"] == kv_memory
        return
    with pytest.raises(ConfigError, match=message):
        build()


def test_decision_audit_records_are_per_environment_and_full_needs_an_opt_in() -> None:
    """SEMIF_AUDIT reaches the container only where an environment asks for records; a
    `full` level (request text in the logs) fails synth unless the environment allows it."""
    assert "SEMIF_AUDIT" not in _decision().container_environment()
    assert _decision(audit="digest").container_environment()["SEMIF_AUDIT"] == "digest"
    with pytest.raises(ConfigError, match=r"^decision: SEMIF_AUDIT=full .*SEMIF_AUDIT_ALLOW_FULL"):
        _decision(audit="full")
    environment = _decision(audit="full", allow_full_audit=True).container_environment()
    assert (environment["SEMIF_AUDIT"], environment["SEMIF_AUDIT_ALLOW_FULL"]) == ("full", "true")


@pytest.mark.parametrize(
    ("instance_type", "weight_buffers", "no_repack"),
    [
        ("ml.c7i.2xlarge", "auto", True),  # Sapphire Rapids: AMX offered
        ("ml.r7i.xlarge", "auto", True),
        ("ml.c6i.2xlarge", "auto", False),  # Ice Lake: no AMX, repacking stays
        ("ml.c7a.2xlarge", "auto", False),  # AMD
        ("ml.c6i.2xlarge", "plain", True),
        ("ml.m7i.2xlarge", "all", False),  # opted in
    ],
)
def test_standard_endpoint_turns_repacking_off_on_amx_families(
    instance_type: str, weight_buffers: Any, no_repack: bool
) -> None:
    settings = StandardEndpointSettings(
        placement=CpuPlacement(instance_type=instance_type),
        context_size=4096,
        threads=8,
        weight_buffers=weight_buffers,
    )
    environment = settings.container_environment()
    assert ("SM_LLAMA_CPP_NO_REPACK" in environment) == no_repack
    if no_repack:
        assert environment["SM_LLAMA_CPP_NO_REPACK"] == "true"  # the DLC's bare --no-repack


def test_standard_endpoint_refuses_an_unknown_weight_buffer_setting() -> None:
    with pytest.raises(ConfigError, match=r"^standard\.weight_buffers: 'amx'; use one of"):
        StandardEndpointSettings(
            placement=CPU,
            context_size=4096,
            threads=8,
            weight_buffers="amx",  # type: ignore[arg-type]
        )


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (  # 5 minutes of pending, a minute's evaluation, a minute's publication
            lambda: _decision(rollout=Rollout(wait_interval_seconds=419)),
            r"^decision\.rollout: a 419 s bake \(wait_interval_seconds\) is shorter than the 420 s",
        ),
        (  # metrics published every 5 minutes: 660 s, past the shipped 600 s bake
            lambda: _decision(metrics=Observability(publish_frequency_seconds=300)),
            r"^decision\.rollout: a 600 s bake \(wait_interval_seconds\) is shorter than the 660 s",
        ),
        (  # the asynchronous endpoint always goes ALL_AT_ONCE, whatever the real-time one does
            lambda: _decision(
                rollout=Rollout(wait_interval_seconds=900),
                metrics=Observability(publish_frequency_seconds=300),
                async_endpoint=AsyncEndpointSettings(),
            ),
            r"^decision\.async_endpoint \(ALL_AT_ONCE\): a 600 s bake",
        ),
        (  # the 5XX rate alone: 3 breaching minutes and 2 of CloudWatch's delay
            lambda: StandardEndpointSettings(
                placement=CPU,
                context_size=4096,
                threads=8,
                rollout=Rollout(wait_interval_seconds=299),
            ),
            r"^standard\.rollout: a 299 s bake \(wait_interval_seconds\) is shorter than the 300 s",
        ),
    ],
)
def test_a_bake_shorter_than_its_rollback_alarms_is_refused(build: Any, message: str) -> None:
    """SageMaker watches the rollback alarms only during the bake: one they cannot fire
    within would let a regression through."""
    with pytest.raises(ConfigError, match=message):
        build()
    assert _decision(rollout=Rollout(traffic=TrafficShift.ALL_AT_ONCE, wait_interval_seconds=420))


def test_request_deadline_may_use_all_of_the_realtime_window() -> None:
    assert _decision(request_timeout_seconds=55).request_timeout_seconds == 55
    assert _decision(queue_timeout_seconds=55, request_timeout_seconds=55)


@pytest.mark.parametrize(
    ("max_batch_requests", "target"), [(1, 1), (2, 2), (4, 3), (10, 8), (32, 24), (256, 192)]
)
def test_scaling_target_is_three_quarters_of_a_batch_rounded_up(
    max_batch_requests: int, target: int
) -> None:
    assert _decision(max_batch_requests=max_batch_requests).target_concurrency == target


def test_the_calibration_fixture_matches_the_prompts() -> None:
    """If this fails the prompts changed: refit (regenerate) the fixture, as a deploy must."""
    fixture = json.loads((REPO_ROOT / VALID_CALIBRATION).read_text())
    assert fixture["prompt_version"] == PROMPT_VERSION


def test_model_source_takes_a_calibration_file_by_repository_path() -> None:
    source = dataclasses.replace(SMOLLM2_135M, calibration=VALID_CALIBRATION)
    assert source.build_calibration is not None
    assert source.build_calibration.path == VALID_CALIBRATION
    expected = calibration_sha256(load_calibration(REPO_ROOT / VALID_CALIBRATION))
    assert source.build_calibration.sha256 == expected
    assert SMOLLM2_135M.build_calibration is None


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            f"{CALIBRATIONS}/stale.json",
            # Both versions named, after the file.
            f"model.calibration: {CALIBRATIONS}/stale.json: .*'semif-direct-options/0'.*"
            f"'{PROMPT_VERSION}'; refit it with semif-calibrate",
        ),
        (
            f"{CALIBRATIONS}/invalid.json",
            r"model.calibration: .*invalid\.json: calibration\.temperatures\.choice: must be "
            "a number in 0.01..100",
        ),
        (f"{CALIBRATIONS}/missing.json", f"model.calibration: {CALIBRATIONS}/missing.json is not"),
        ("pyproject.toml", "model.calibration: 'pyproject.toml' must be a relative .json path"),
        ("/etc/calibration.json", "model.calibration: '/etc/calibration.json' must be a relative"),
        ("../outside/calibration.json", "model.calibration: '../outside/calibration.json' must"),
        ("calibration/*.json", "model.calibration: 'calibration/\\*.json' must be"),
        ("client/examples/check-decision.json", "model.calibration: .*schema_version"),
    ],
)
def test_a_bad_or_stale_calibration_file_is_refused(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        dataclasses.replace(SMOLLM2_135M, calibration=path)


def test_model_source_takes_a_chat_template_by_repository_path(tmp_path: Path) -> None:
    source = dataclasses.replace(SMOLLM2_135M, chat_template=VALID_CHAT_TEMPLATE)
    assert source.build_chat_template is not None
    assert source.build_chat_template.path == VALID_CHAT_TEMPLATE
    # The digest is the one model-build records as the manifest's chat_template.sha256.
    request = BuildRequest(
        source=parse_source(SMOLLM2_135M.uri),
        sha256=SMOLLM2_135M.sha256,
        dest=parse_destination(str(tmp_path / "model.tar.gz")),
        work_dir=tmp_path,
        built_at=datetime(2026, 1, 1, tzinfo=UTC),
        http=HttpSettings(base_url="https://huggingface.co"),
        retry=RetryPolicy(),
        chat_template=(REPO_ROOT / VALID_CHAT_TEMPLATE).read_bytes(),
    )
    assert request.chat_template_file is not None
    assert source.build_chat_template.sha256 == request.chat_template_file.sha256
    assert source.build_calibration is None
    assert source.build_files == (source.build_chat_template,)
    assert SMOLLM2_135M.build_chat_template is None
    assert SMOLLM2_135M.build_files == ()
    both = dataclasses.replace(source, calibration=VALID_CALIBRATION)
    assert both.build_files == (both.build_calibration, both.build_chat_template)


def test_a_chat_template_is_named_by_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unlike a calibration's canonical JSON, any byte of a template changes what the
    adapter renders, so any changed byte is a new digest (a new model object)."""
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path)
    template = tmp_path / "templates" / "prod.jinja"
    template.parent.mkdir()
    digests = set()
    for text in ("{{ messages[0]['content'] }}", "{{ messages[0]['content'] }}\n"):
        template.write_text(text, encoding="utf-8")
        source = dataclasses.replace(SMOLLM2_135M, chat_template="templates/prod.jinja")
        assert source.build_chat_template is not None
        digests.add(source.build_chat_template.sha256)
    assert len(digests) == 2


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (
            "tests/cdk/chat_template/missing.jinja",
            "model.chat_template: tests/cdk/chat_template/missing.jinja is not a file in",
        ),
        (
            "/etc/template.jinja",
            "model.chat_template: '/etc/template.jinja' must be a relative .jinja path",
        ),
        ("../outside/t.jinja", "model.chat_template: '../outside/t.jinja' must be a relative"),
        ("tests/cdk/chat_template/../x.jinja", "model.chat_template: .* must be a relative .jinja"),
        ("templates/*.jinja", "model.chat_template: 'templates/\\*.jinja' must be"),
        ("pyproject.toml", "model.chat_template: 'pyproject.toml' must be a relative .jinja"),
        ("", "model.chat_template: '' must be a relative .jinja path"),
    ],
)
def test_a_bad_chat_template_path_is_refused(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=f"^{message}"):
        dataclasses.replace(SMOLLM2_135M, chat_template=path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff{{ messages }}", "is not UTF-8 text \\(invalid start byte at byte 0\\)"),
        (b"", "is empty"),
        (b" \n\t\n", "is empty"),  # blank
    ],
)
def test_a_chat_template_that_is_not_text_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: bytes, message: str
) -> None:
    """model-build's own rule (`chat_template_text`), so synth fails where the build would."""
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path)
    (tmp_path / "bad.jinja").write_bytes(content)
    with pytest.raises(ConfigError, match=f"^model.chat_template: bad.jinja {message}$"):
        dataclasses.replace(SMOLLM2_135M, chat_template="bad.jinja")


def test_a_chat_template_directory_is_not_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "REPO_ROOT", tmp_path)
    (tmp_path / "templates.jinja").mkdir()
    with pytest.raises(ConfigError, match=r"^model\.chat_template: templates\.jinja is not a file"):
        dataclasses.replace(SMOLLM2_135M, chat_template="templates.jinja")


def test_prefix_aware_routing_needs_two_instances_and_follows_the_batch() -> None:
    one = Autoscaling(min_capacity=1, max_capacity=1)
    with pytest.raises(ConfigError, match="routing by prefix needs two or more instances"):
        DecisionEndpointSettings(
            placement=gpu(), gpu_layers=-1, autoscaling=one, prefix_aware_routing=True
        )
    alone = DecisionEndpointSettings(placement=gpu(), gpu_layers=-1, autoscaling=one)
    assert alone.routing == LeastOutstandingRouting()  # off: the fewest requests in flight
    routing = _decision(prefix_aware_routing=True, max_batch_requests=12).routing
    assert routing == PrefixAwareRouting(prefix_length_bytes=1024, concurrency_threshold=12)


@pytest.mark.parametrize(
    ("props", "message"),
    [
        (lambda: Observability(publish_frequency_seconds=45), "45 is not one of"),
        (
            lambda: DecisionSignalThresholds(max_unavailable_percent=0),
            "max_unavailable_percent: 0 is outside",
        ),
        (
            lambda: DecisionSignalThresholds(min_median_allowed_token_mass=1.0),
            "min_median_allowed_token_mass: 1.0 is outside",
        ),
        (
            lambda: DecisionSignalThresholds(max_ms_per_decoded_row=0),
            "max_ms_per_decoded_row: 0 must be > 0",
        ),
        (
            lambda: PrefixAwareRouting(prefix_length_bytes=512, concurrency_threshold=4),
            "prefix_length_bytes: 512 is outside 1024..65536",
        ),
        (
            lambda: PrefixAwareRouting(prefix_length_bytes=2048, concurrency_threshold=0),
            "concurrency_threshold: 0 is outside 1..1024",
        ),
    ],
)
def test_metrics_and_routing_props_take_only_what_sagemaker_takes(props: Any, message: str) -> None:
    with pytest.raises(PropsError, match=message):
        props()


# --- the asynchronous endpoint ----------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_capacity": 0}, "max_capacity: 0 < 1"),
        ({"target_backlog_per_instance": 0}, "target_backlog_per_instance: 0 must be > 0"),
        ({"request_timeout_seconds": 0.5}, r"request_timeout_seconds: 0\.5 is outside 1\.\.3600"),
        ({"request_timeout_seconds": 3601}, r"request_timeout_seconds: 3601 is outside 1\.\.3600"),
        (
            {"max_payload_bytes": (1 << 20) - 1},
            r"max_payload_bytes: 1048575 is outside 1048576\.\.1073741824",
        ),
        ({"max_payload_bytes": (1 << 30) + 1}, "max_payload_bytes: 1073741825 is outside"),
        ({"max_oldest_request_age_seconds": 59}, "max_oldest_request_age_seconds: 59 is outside"),
        (
            {"max_oldest_request_age_seconds": 21601},
            r"max_oldest_request_age_seconds: 21601 is outside 60\.\.21600",
        ),
    ],
)
def test_async_endpoint_rules(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=rf"^decision\.async_endpoint\.{message}"):
        AsyncEndpointSettings(**overrides)


def test_async_bounds_are_inclusive() -> None:
    low = AsyncEndpointSettings(
        request_timeout_seconds=1, max_payload_bytes=1 << 20, max_oldest_request_age_seconds=60
    )
    assert _decision(queue_timeout_seconds=1, async_endpoint=low).async_endpoint == low
    high = AsyncEndpointSettings(max_oldest_request_age_seconds=21600)
    assert high.request_timeout_seconds == 3600
    assert high.max_payload_bytes == 1 << 30


def test_async_deadline_covers_the_queue_wait() -> None:
    short = AsyncEndpointSettings(request_timeout_seconds=20)
    with pytest.raises(
        ConfigError,
        match=r"^decision\.async_endpoint\.request_timeout_seconds: 20 is below "
        r"decision\.queue_timeout_seconds \(30\)",
    ):
        _decision(queue_timeout_seconds=30, request_timeout_seconds=40, async_endpoint=short)


def test_async_environment_lifts_the_deadline_and_sets_the_body_limit() -> None:
    """The real-time rule (55 s) stays on the real-time endpoint; the asynchronous one
    gets its own deadline and the JSON Lines body limit, the rest unchanged."""
    settings = _decision(async_endpoint=AsyncEndpointSettings(max_payload_bytes=64 << 20))
    assert settings.async_container_environment() == {
        **settings.container_environment(),
        "SEMIF_REQUEST_TIMEOUT_S": "3600.0",
        "SEMIF_MAX_LINES_BYTES": str(64 << 20),
        "SEMIF_MAX_LINES": "100000",  # the adapter's default: more than a line per KiB
    }
    assert settings.container_environment()["SEMIF_REQUEST_TIMEOUT_S"] == "50.0"
    with pytest.raises(ConfigError, match=r"^decision\.async_endpoint: not set"):
        _decision().async_container_environment()


@pytest.mark.parametrize(("max_batch_requests", "invocations"), [(1, 1), (2, 2), (32, 2), (256, 2)])
def test_async_instances_take_two_files_at_once(max_batch_requests: int, invocations: int) -> None:
    """One file fills the passes; a second covers its gaps; serial scoring takes one."""
    settings = _decision(max_batch_requests=max_batch_requests)
    assert settings.async_invocations_per_instance == invocations


def test_only_dev_ships_an_async_endpoint() -> None:
    assert ENVIRONMENTS["dev"].decision.async_endpoint == AsyncEndpointSettings()
    assert ENVIRONMENTS["prod"].decision.async_endpoint is None
    assert ENVIRONMENTS["gpu"].decision.async_endpoint is None
