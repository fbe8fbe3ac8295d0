"""SEMIF_WEIGHT_BUFFERS: which of llama.cpp's extra weight buffer types the weights may use.

The policy runs on every machine with the CPU backend's report stubbed (AMX offered or
not), asserting what the engine passes to llama.cpp; on this machine's real backend a
quantized tiny model shows the parameter reaches llama.cpp (weights land in CPU_REPACK or
not) and that the load log is read back.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import llama_cpp
import pytest

from adapter.backends import cpu_backend, load_backends
from adapter.core.engine import LlamaEngine
from adapter.core.native import restrict_weight_buffers
from adapter.runtime import load_service
from adapter.settings import Settings, SettingsError, load_settings
from adapter.weight_buffers import (
    CpuBackend,
    WeightBufferError,
    WeightBuffers,
    check_landed,
    choose_buffers,
)
from tests.support.cpus import ICE_LAKE, SAPPHIRE_RAPIDS


@pytest.mark.parametrize(
    ("setting", "cpu", "use_extra", "refused"),
    [
        ("auto", SAPPHIRE_RAPIDS, False, ("AMX", "CPU_REPACK")),
        ("auto", ICE_LAKE, True, ()),
        ("auto", CpuBackend(features={}, extra_buffer_types=()), True, ()),
        ("plain", ICE_LAKE, False, ("CPU_REPACK",)),
        ("all", SAPPHIRE_RAPIDS, True, ()),
    ],
)
def test_the_choice_refuses_amx_unless_asked(
    setting: WeightBuffers, cpu: CpuBackend, use_extra: bool, refused: tuple[str, ...]
) -> None:
    choice = choose_buffers(setting, cpu)
    assert (choice.use_extra, choice.refused) == (use_extra, refused)
    assert choice.offered == cpu.extra_buffer_types


def test_weights_in_a_refused_buffer_fail_the_load() -> None:
    choice = choose_buffers("auto", SAPPHIRE_RAPIDS)
    check_landed(choice, {"CPU": 92.1})
    with pytest.raises(WeightBufferError, match=r"loaded into AMX buffers .*=auto refused"):
        check_landed(choice, {"CPU": 10.0, "AMX": 82.0})
    check_landed(choose_buffers("all", SAPPHIRE_RAPIDS), {"AMX": 82.0})


@pytest.fixture
def load_parameters(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """What every model load in the test passed as `use_extra_bufts` (the load still runs)."""
    seen: list[bool] = []
    real = llama_cpp.llama_model_load_from_file

    def spy(path: bytes, params: llama_cpp.llama_model_params) -> Any:
        seen.append(bool(params.use_extra_bufts))
        return real(path, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy)
    return seen


def _engine(gguf: Path, setting: WeightBuffers, cpu: CpuBackend) -> LlamaEngine:
    return LlamaEngine(
        gguf,
        stream_cells=256,
        max_branches=4,
        threads=2,
        n_gpu_layers=0,
        weight_buffers=setting,
        cpu=cpu,
    )


@pytest.mark.parametrize(
    ("setting", "cpu", "passed"),
    [
        ("auto", SAPPHIRE_RAPIDS, False),  # AMX reported
        ("auto", ICE_LAKE, True),  # not reported: llama.cpp's default stays
        ("all", SAPPHIRE_RAPIDS, True),  # opted in
        ("plain", ICE_LAKE, False),
    ],
)
def test_the_engine_passes_the_choice_to_llama_cpp(
    tiny_gguf: Path,
    load_parameters: list[bool],
    setting: WeightBuffers,
    cpu: CpuBackend,
    passed: bool,
) -> None:
    engine = _engine(tiny_gguf, setting, cpu)
    try:
        assert load_parameters == [passed]
        weights = engine.description()["weight_buffers"]
        assert weights == {
            "setting": setting,
            "offered": list(cpu.extra_buffer_types),
            "refused": [] if passed else list(cpu.extra_buffer_types),
            "weights_in": ["CPU"],  # read from llama.cpp's load log (f32: nothing repacks)
        }
    finally:
        engine.close()


def test_the_server_applies_the_setting_and_logs_placement_before_the_probe(
    tiny_model_dir: Path,
    load_parameters: list[bool],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr("adapter.runtime.cpu_backend", lambda lib_dir: SAPPHIRE_RAPIDS)
    with caplog.at_level(logging.INFO, logger="adapter"):
        service = load_service(Settings(model_dir=tiny_model_dir, threads=2))
    try:
        assert load_parameters == [False]
        messages = [record.getMessage() for record in caplog.records]
        [placement] = [index for index, text in enumerate(messages) if "weights in:" in text]
        [probe] = [index for index, text in enumerate(messages) if "probe decision" in text]
        assert placement < probe
        line = messages[placement]
        assert "llama.cpp CPU features: AVX512 AMX_INT8 AMX_BF16 REPACK;" in line
        assert "offered: AMX, CPU_REPACK; refused: AMX, CPU_REPACK" in line
        assert "(SEMIF_WEIGHT_BUFFERS=auto: the CPU backend offers AMX" in line
        assert "weights in: CPU " in line
    finally:
        service.close(wait_seconds=5.0)


def test_a_binding_that_cannot_turn_extra_buffers_off_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Setting a field an old binding lacks would silently do nothing: fail, not fail open."""

    class OldParams:
        _fields_: ClassVar = [("n_gpu_layers", None), ("use_mmap", None)]

    monkeypatch.setattr(llama_cpp, "llama_model_params", OldParams)
    params: Any = OldParams()
    restrict_weight_buffers(params, choose_buffers("auto", ICE_LAKE))  # nothing to turn off
    with pytest.raises(WeightBufferError, match=r"no llama_model_params\.use_extra_bufts"):
        restrict_weight_buffers(params, choose_buffers("auto", SAPPHIRE_RAPIDS))


def test_the_setting_is_validated_at_start() -> None:
    assert load_settings({}).weight_buffers == "auto"
    assert load_settings({"SEMIF_WEIGHT_BUFFERS": " plain "}).weight_buffers == "plain"
    with pytest.raises(
        SettingsError,
        match=r"^SEMIF_WEIGHT_BUFFERS='amx' is not allowed; allowed auto, plain, all$",
    ):
        load_settings({"SEMIF_WEIGHT_BUFFERS": "amx"})


# -- this machine's real CPU backend ----------------------------------------------------------


def test_the_cpu_backend_report_agrees_with_itself() -> None:
    """Two entry points of the backend: its feature list says whether it was built with the
    repack kernels, its extra buffer types whether it offers them."""
    load_backends(None)
    cpu = cpu_backend(None)
    assert cpu.features, "the CPU backend reported no features"
    assert ("REPACK" in cpu.features) == ("CPU_REPACK" in cpu.extra_buffer_types)
    assert ("AMX_INT8" in cpu.features) == ("AMX" in cpu.extra_buffer_types)


@pytest.fixture(scope="module")
def q4_0_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model in Q4_0, which llama.cpp's CPU repack supports (quantized by llama.cpp)."""
    from model_build.tiny_gguf import write_tiny_gguf

    folder = tmp_path_factory.mktemp("q4_0")
    source = write_tiny_gguf(folder / "f32.gguf", n_embd=64)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    target = folder / "q4_0.gguf"
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0
    return target


def test_the_choice_decides_where_real_weights_land(q4_0_gguf: Path) -> None:
    load_backends(None)
    cpu = cpu_backend(None)
    if "CPU_REPACK" not in cpu.extra_buffer_types:
        pytest.skip("this CPU backend offers no CPU_REPACK buffers")
    unsafe_free = CpuBackend(features=cpu.features, extra_buffer_types=("CPU_REPACK",))
    landed: dict[str, set[str]] = {}
    first_logit: dict[str, float] = {}
    for setting in ("all", "plain"):
        engine = _engine(q4_0_gguf, setting, unsafe_free)
        try:
            landed[setting] = set(engine.weights.landed)
            first_logit[setting] = float(engine.score([[1, 2, 3, 4]])[0][0].logits[0])
        finally:
            engine.close()
    assert "CPU_REPACK" in landed["all"]
    assert landed["plain"] == {"CPU"}
    # The same weights in another layout: the scores agree closely (not bitwise).
    assert first_logit["all"] == pytest.approx(first_logit["plain"], rel=1e-3)
