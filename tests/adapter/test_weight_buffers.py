"""SEMIF_WEIGHT_BUFFERS: which of llama.cpp's extra weight buffer types the weights may use.

The policy runs on every machine with the CPU backend's report stubbed (AMX offered or
not), asserting what the engine passes to llama.cpp; on this machine's real backend a
quantized tiny model shows the parameter reaches llama.cpp (weights land in CPU_REPACK or
not) and that the load log is read back. The ways an AMX host gets a backend without AMX
are checked with stand-in libraries (the images leave the AMX variant out) and the
compiler (scripts/setup.sh's flags).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, ClassVar

import llama_cpp
import pytest

from adapter.backends import (
    BackendLoadError,
    amx_libraries,
    bundled_lib_dir,
    cpu_backend,
    drop_amx_variants,
    host_has_amx,
    load_backends,
)
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
from tests.support.cpus import (
    ICE_LAKE,
    SAPPHIRE_RAPIDS,
    SAPPHIRE_RAPIDS_WITHOUT_AMX,
    write_ggml_library,
)
from tests.support.quantized import quantize

REPO = Path(__file__).resolve().parents[2]
NO_BACKEND = CpuBackend(library="none", features={}, extra_buffer_types=(), host_amx=False)
NO_BACKEND_WITH_REPACK = dataclasses.replace(NO_BACKEND, extra_buffer_types=("CPU_REPACK",))


@pytest.mark.parametrize(
    ("setting", "cpu", "use_extra", "refused"),
    [
        ("auto", SAPPHIRE_RAPIDS, False, ("AMX", "CPU_REPACK")),
        ("auto", SAPPHIRE_RAPIDS_WITHOUT_AMX, True, ()),  # the AMX host keeps the repack
        ("auto", ICE_LAKE, True, ()),
        ("auto", NO_BACKEND, True, ()),
        ("plain", ICE_LAKE, False, ("CPU_REPACK",)),
        ("plain", SAPPHIRE_RAPIDS_WITHOUT_AMX, False, ("CPU_REPACK",)),
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
            "cpu_backend": cpu.library,
            "host_amx": cpu.host_amx,
            "offered": list(cpu.extra_buffer_types),
            "refused": [] if passed else list(cpu.extra_buffer_types),
            "exact_kernels": True,  # f32 weights: no repacked products
            "weights_in": ["CPU"],  # read from llama.cpp's load log (f32: nothing repacks)
        }
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("cpu", "passed", "said"),
    [
        (
            SAPPHIRE_RAPIDS,
            False,
            "llama.cpp CPU backend: libggml-cpu-sapphirerapids.so (host CPU: AMX), features: "
            "AVX512 AMX_INT8 AMX_BF16 REPACK; extra weight buffer types offered: AMX, "
            "CPU_REPACK; refused: AMX, CPU_REPACK (SEMIF_WEIGHT_BUFFERS=auto: the CPU backend "
            "offers AMX, whose kernels crash",
        ),
        (
            SAPPHIRE_RAPIDS_WITHOUT_AMX,
            True,
            "llama.cpp CPU backend: libggml-cpu-zen4.so (host CPU: AMX), features: AVX512 "
            "AVX512_VBMI AVX512_BF16 REPACK; extra weight buffer types offered: CPU_REPACK; "
            "refused: none (SEMIF_WEIGHT_BUFFERS=auto: no unsafe extra buffer type offered)",
        ),
    ],
)
def test_the_server_applies_the_setting_and_logs_placement_before_the_probe(
    tiny_model_dir: Path,
    load_parameters: list[bool],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    cpu: CpuBackend,
    passed: bool,
    said: str,
) -> None:
    monkeypatch.setattr("adapter.runtime.cpu_backend", lambda lib_dir: cpu)
    with caplog.at_level(logging.INFO, logger="adapter"):
        service = load_service(Settings(model_dir=tiny_model_dir, threads=2))
    try:
        assert load_parameters == [passed]
        messages = [record.getMessage() for record in caplog.records]
        [placement] = [index for index, text in enumerate(messages) if "weights in:" in text]
        [probe] = [index for index, text in enumerate(messages) if "probe decision" in text]
        assert placement < probe
        line = messages[placement]
        assert line.startswith(said)
        assert "weights in: CPU " in line
        weights = service.model["serving"]["weight_buffers"]
        assert (weights["cpu_backend"], weights["host_amx"]) == (cpu.library, True)
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
    return quantize(write_tiny_gguf(folder / "f32.gguf", n_embd=64), folder / "q4_0.gguf", "Q4_0")


def test_the_choice_decides_where_real_weights_land(q4_0_gguf: Path) -> None:
    load_backends(None)
    cpu = cpu_backend(None)
    if "CPU_REPACK" not in cpu.extra_buffer_types:
        pytest.skip("this CPU backend offers no CPU_REPACK buffers")
    unsafe_free = dataclasses.replace(cpu, extra_buffer_types=("CPU_REPACK",))
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


@pytest.mark.parametrize(
    ("setting", "cpu", "types", "exact", "use_extra", "exact_kernels"),
    [
        # A Q4_K_M GGUF on the exact path: the repacked Q4_K products are not exact.
        ("auto", ICE_LAKE, {"F32", "Q4_K", "Q6_K"}, True, False, True),
        ("auto", ICE_LAKE, {"F32", "Q4_K", "Q6_K"}, False, True, True),  # not asked
        ("all", ICE_LAKE, {"F32", "Q4_K", "Q6_K"}, True, True, False),  # asked: said so
        # Q4_0 is repacked exactly; x86 does not repack Q6_K (an output head).
        ("auto", ICE_LAKE, {"F32", "Q4_0", "Q6_K"}, True, True, True),
        # Elsewhere (no x86 flags: NEON builds repack Q6_K too) only Q4_0 is known exact.
        ("auto", NO_BACKEND_WITH_REPACK, {"F32", "Q4_0", "Q6_K"}, True, False, True),
        ("auto", NO_BACKEND_WITH_REPACK, {"F32", "Q4_0"}, True, True, True),
        ("plain", ICE_LAKE, {"F32", "Q4_K"}, True, False, True),
    ],
)
def test_the_exact_path_keeps_the_repack_only_where_it_is_exact(
    setting: WeightBuffers,
    cpu: CpuBackend,
    types: set[str],
    exact: bool,
    use_extra: bool,
    exact_kernels: bool,
) -> None:
    choice = choose_buffers(setting, cpu, weight_types=frozenset(types), exact=exact)
    assert (choice.use_extra, choice.exact) == (use_extra, exact_kernels)
    if setting == "auto" and not use_extra:
        assert "Q4_K" in choice.reason or "Q6_K" in choice.reason


def test_the_report_names_the_library_the_cpu_backend_was_loaded_from() -> None:
    load_backends(None)
    cpu = cpu_backend(None)
    assert cpu.library.startswith("libggml-cpu")
    assert (bundled_lib_dir() / cpu.library).is_file()
    # A backend that offers AMX is one the build-time check finds (both are False here).
    assert ("AMX" in cpu.extra_buffer_types) <= bool(amx_libraries(bundled_lib_dir()))


# -- an AMX host with a CPU backend built without AMX ---------------------------------------


@pytest.mark.parametrize(
    ("flags", "has_amx"),
    [
        ("fpu avx512f avx512_vnni amx_bf16 amx_tile amx_int8 arch_lbr", True),
        ("fpu avx512f avx512_vnni amx_bf16 amx_tile", False),  # not the INT8 ggml needs
        ("fpu avx512f avx512_vnni", False),
    ],
)
def test_the_host_amx_flag_is_the_kernels_cpu_report(
    tmp_path: Path, flags: str, has_amx: bool
) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n")
    assert host_has_amx(cpuinfo) is has_amx
    assert host_has_amx(tmp_path / "absent") is False  # not Linux: no AMX claimed


@pytest.fixture
def dlc_lib_dir(tmp_path: Path) -> Path:
    """A GGML_BACKEND_DL directory as the DLC ships it: ggml's libraries and one CPU backend
    variant per family, the Sapphire Rapids one built with AMX."""
    for name in ("libggml.so", "libggml-base.so", "libggml-cpu-icelake.so", "libggml-cpu-zen4.so"):
        write_ggml_library(tmp_path / name, amx=False)
    write_ggml_library(tmp_path / "libggml-cpu-sapphirerapids.so", amx=True)
    return tmp_path


def test_the_image_build_leaves_out_the_cpu_variants_built_with_amx(dlc_lib_dir: Path) -> None:
    (dlc_lib_dir / "libggml-rpc.so").touch()  # an empty file cannot be mapped: no AMX
    assert amx_libraries(dlc_lib_dir) == [dlc_lib_dir / "libggml-cpu-sapphirerapids.so"]
    (dlc_lib_dir / "libggml-rpc.so").unlink()
    assert drop_amx_variants(dlc_lib_dir) == ["libggml-cpu-sapphirerapids.so"]
    assert sorted(path.name for path in dlc_lib_dir.iterdir()) == [
        "libggml-base.so",
        "libggml-cpu-icelake.so",
        "libggml-cpu-zen4.so",
        "libggml.so",
    ]
    assert drop_amx_variants(dlc_lib_dir) == []  # a second run finds nothing left to do


@pytest.mark.parametrize(
    ("amx_names", "error"),
    [
        (["libggml-cpu-zen4.so", "libggml-cpu-icelake.so"], "none would be left"),
        (["libggml-cpu.so"], r"libggml-cpu\.so in .* are not CPU backend variants"),
    ],
)
def test_the_image_build_fails_rather_than_keep_amx_or_lose_the_cpu(
    dlc_lib_dir: Path, amx_names: list[str], error: str
) -> None:
    """No AMX-free variant left, or AMX in a library the registry always loads: the build
    stops, deleting nothing."""
    for name in amx_names:
        write_ggml_library(dlc_lib_dir / name, amx=True)
    before = sorted(dlc_lib_dir.iterdir())
    with pytest.raises(BackendLoadError, match=error):
        drop_amx_variants(dlc_lib_dir)
    assert sorted(dlc_lib_dir.iterdir()) == before


def _setup_sh_flags() -> list[str]:
    match = re.search(r'no_amx="([^"]+)"', (REPO / "scripts" / "setup.sh").read_text())
    assert match is not None, "scripts/setup.sh sets no no_amx flags"
    return match.group(1).split()


def _amx_macros(flags: list[str]) -> set[str]:
    """The AMX macros the C compiler defines with `flags` (what ggml's AMX code tests)."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    result = subprocess.run(
        [compiler, *flags, "-dM", "-E", "-x", "c", "/dev/null"],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        pytest.skip(f"this compiler cannot target Sapphire Rapids: {result.stderr.strip()}")
    return set(re.findall(r"#define (__AMX_\w+__)", result.stdout))


def test_the_source_build_flags_compile_no_amx_even_for_an_amx_cpu() -> None:
    """setup.sh's flags beside -march=sapphirerapids, what -march=native means on a c7i, in
    either order (ggml puts its -march after the flags CFLAGS gives): no AMX macro, so ggml
    compiles neither the AMX kernels nor the AMX buffer type (its GGML_AMX_* options act
    only when GGML_NATIVE is off)."""
    amx_cpu = ["-march=sapphirerapids"]
    assert "__AMX_INT8__" in _amx_macros(amx_cpu)  # the control: AMX is what -march gives
    assert _amx_macros([*_setup_sh_flags(), *amx_cpu]) == set()
    assert _amx_macros([*amx_cpu, *_setup_sh_flags()]) == set()
