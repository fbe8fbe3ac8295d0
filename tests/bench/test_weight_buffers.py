"""`semif-bench-weight-buffers` on the tiny model: every setting measured and compared, or
`plain` and `auto` alone where the CPU offers AMX (`all` would crash there); with AMX
simulated on the host, `auto` keeps the repack a backend built without AMX offers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import bench.weight_buffers
from adapter.backends import cpu_backend, load_backends
from adapter.weight_buffers import CpuBackend
from model_build.tiny_gguf import write_tiny_gguf
from tests.support.cpus import ICE_LAKE, SAPPHIRE_RAPIDS, SAPPHIRE_RAPIDS_WITHOUT_AMX


def _run(tmp_path: Path, gguf: Path, *extra: str, types: str = "as-is") -> dict[str, Any]:
    out = tmp_path / "figures.json"
    args = ["--gguf", str(gguf), "--types", types, "--rounds", "1", "--out", str(out), *extra]
    bench.weight_buffers.main(args)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


@pytest.mark.parametrize(
    ("cpu", "measured"),
    [
        (ICE_LAKE, ["all", "auto", "plain"]),
        (SAPPHIRE_RAPIDS_WITHOUT_AMX, ["all", "auto", "plain"]),
        (SAPPHIRE_RAPIDS, ["auto", "plain"]),
    ],
)
def test_the_benchmark_measures_what_is_safe_here(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_gguf: Path,
    cpu: CpuBackend,
    measured: list[str],
) -> None:
    monkeypatch.setattr(bench.weight_buffers, "cpu_backend", lambda lib_dir: cpu)
    report = _run(tmp_path, tiny_gguf)
    [figure] = report["figures"].values()
    assert sorted(figure["tokens_per_second"]) == measured
    assert all(rate > 0 for rates in figure["tokens_per_second"].values() for rate in rates)
    assert sorted(figure["ratios"]) == (["auto/all", "plain/all"] if "all" in measured else [])
    assert figure["weights_in"]["plain"] == ["CPU"]
    assert (report["cpu_backend"], report["host_amx"]) == (cpu.library, cpu.host_amx)
    assert report["auto_refuses"] == (["AMX", "CPU_REPACK"] if cpu is SAPPHIRE_RAPIDS else [])


def test_with_amx_simulated_on_the_host_auto_keeps_the_repack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """This CPU reported as an AMX host whose backend was built without AMX (what the images
    and scripts/setup.sh give one): `auto` loads the Q4_0 weights into CPU_REPACK, as `all`."""
    load_backends(None)
    if "CPU_REPACK" not in cpu_backend(None).extra_buffer_types:
        pytest.skip("this CPU backend offers no CPU_REPACK buffers")
    monkeypatch.setattr(bench.weight_buffers, "DEFAULT_MODEL_CACHE", tmp_path)
    gguf = write_tiny_gguf(tmp_path / "tiny64.gguf", n_embd=64)  # rows the repack takes
    report = _run(tmp_path, gguf, "--simulate-amx-host", types="Q4_0")
    assert report["host_amx"] is True
    assert report["auto_refuses"] == []
    figure = report["figures"]["Q4_0"]
    assert "CPU_REPACK" in figure["weights_in"]["auto"]
    assert figure["weights_in"]["auto"] == figure["weights_in"]["all"]
    assert "CPU_REPACK" not in figure["weights_in"]["plain"]


def test_an_unknown_type_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.weight_buffers.main(["--types", "Q3_X"])
    assert "--types: 'Q3_X' is not as-is or one of Q4_0, Q4_K_M, Q8_0" in capsys.readouterr().err
