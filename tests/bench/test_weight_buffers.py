"""`semif-bench-weight-buffers` on the tiny model: both settings measured and compared, or
`plain` alone where the CPU offers AMX (`all` would crash there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.weight_buffers
from tests.support.cpus import ICE_LAKE, SAPPHIRE_RAPIDS


@pytest.mark.parametrize(
    ("cpu", "measured"), [(ICE_LAKE, ["all", "plain"]), (SAPPHIRE_RAPIDS, ["plain"])]
)
def test_the_benchmark_measures_what_is_safe_here(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_gguf: Path,
    cpu: object,
    measured: list[str],
) -> None:
    monkeypatch.setattr(bench.weight_buffers, "cpu_backend", lambda lib_dir: cpu)
    out = tmp_path / "figures.json"
    args = ["--gguf", str(tiny_gguf), "--types", "as-is", "--rounds", "1", "--out", str(out)]
    bench.weight_buffers.main(args)
    [figure] = json.loads(out.read_text())["figures"].values()
    assert sorted(figure["tokens_per_second"]) == measured
    assert all(rate > 0 for rates in figure["tokens_per_second"].values() for rate in rates)
    assert (figure["ratio"] is None) == (measured == ["plain"])
    assert figure["weights_in"]["plain"] == ["CPU"]


def test_an_unknown_type_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.weight_buffers.main(["--types", "Q3_X"])
    assert "--types: 'Q3_X' is not as-is or one of Q4_0, Q4_K_M, Q8_0" in capsys.readouterr().err
