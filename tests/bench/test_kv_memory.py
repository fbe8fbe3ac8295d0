"""The KV-memory figure (bench.kv_memory) on the tiny model: what each budget buys."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.kv_memory import copy_cost, main, measure


def test_a_budget_is_measured_as_the_server_loads_it(tiny_gguf: Path) -> None:
    full = measure(tiny_gguf, "auto", threads=1)
    assert full["streams"] == 32  # the tiny model's streams are tiny: all fit auto's floor
    small = measure(tiny_gguf, "8MiB", threads=1)
    assert 3 <= int(str(small["streams"])) < 32
    assert float(str(small["cache_mib"])) <= 8.0 < float(str(full["cache_mib"]))


def test_one_budget_per_process_prints_one_json_line(
    tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["--gguf", str(tiny_gguf), "--threads", "1", "--one", "auto"])
    figures = json.loads(capsys.readouterr().out)
    assert figures["budget"] == "auto"
    assert figures["peak_vs_gguf"] > 1


def test_a_copy_is_timed_against_a_row(tiny_gguf: Path) -> None:
    cost = copy_cost(tiny_gguf, 1024, threads=1, repeats=2)
    assert cost["stream_cells"] == 1024
    assert cost["row_seconds"] > 0
    assert math.isfinite(cost["copy_rows"])
