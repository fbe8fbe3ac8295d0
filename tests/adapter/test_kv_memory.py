"""The KV cache sized to a memory budget (adapter.kv_memory), and served alike at any size."""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter.decisions import decide
from adapter.kv_memory import (
    AUTO_FLOOR_BYTES,
    MAX_STREAMS,
    MIN_STREAMS,
    KvBudget,
    KvMemoryError,
    StreamCost,
    container_memory_bytes,
    plan_cache,
)
from adapter.schema import Decision, Option
from adapter.settings import SettingsError, load_settings
from tests.support.models import open_test_model, service_of

MIB = 1 << 20


@pytest.mark.parametrize(
    ("text", "amount", "fraction"),
    [
        ("auto", None, None),
        ("768MiB", 768 * MIB, None),
        ("2GiB", 2 << 30, None),
        ("1.5 GiB", 3 << 29, None),
        ("1500000000", 1_500_000_000, None),
        ("0.25", None, 0.25),
        ("1.0", None, 1.0),
    ],
)
def test_a_budget_is_auto_bytes_or_a_fraction(
    text: str, amount: int | None, fraction: float | None
) -> None:
    budget = KvBudget.parse(text)
    assert (budget.amount, budget.fraction) == (amount, fraction)


@pytest.mark.parametrize("text", ["lots", "-1GiB", "1.5", "0.0", "2 GB", ""])
def test_an_unreadable_budget_is_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(KvMemoryError, match="SEMIF_KV_MEMORY"):
        KvBudget.parse(text)
    if text.strip():
        with pytest.raises(SettingsError, match="SEMIF_KV_MEMORY"):
            load_settings({"SEMIF_KV_MEMORY": text})


def test_the_budget_buys_streams_of_the_promised_length() -> None:
    cost = StreamCost(cell_bytes=1000, state_bytes=24_000)  # 1 MB per 976-cell stream
    plan = plan_cache(
        KvBudget.parse("5000000"), stream_cells=976, cost=cost, weights_bytes=1, container_bytes=1
    )
    assert (plan.streams, plan.stream_cells, plan.bytes) == (5, 976, 5_000_000)
    unbounded = plan_cache(None, stream_cells=976, cost=cost, weights_bytes=1)
    assert unbounded.streams == MAX_STREAMS
    half = plan_cache(
        KvBudget.parse("0.5"),
        stream_cells=976,
        cost=cost,
        weights_bytes=1,
        container_bytes=8 * 10**6,
    )
    assert half.streams == 4
    with pytest.raises(
        KvMemoryError, match=rf"holds 2 streams.*at least {MIN_STREAMS}.*SEMIF_MAX_TOKENS"
    ):
        plan_cache(
            KvBudget.parse("2MB".replace("MB", "000000")),
            stream_cells=976,
            cost=cost,
            weights_bytes=1,
            container_bytes=1,
        )


def test_auto_follows_the_weights_within_a_quarter_of_memory() -> None:
    cost = StreamCost(cell_bytes=16 << 10)  # 16 MiB per 1,024-cell stream
    auto = KvBudget.parse("auto")

    def streams(weights: int, container: int) -> int:
        return plan_cache(
            auto, stream_cells=1024, cost=cost, weights_bytes=weights, container_bytes=container
        ).streams

    assert streams(3 * MIB, 1 << 40) == AUTO_FLOOR_BYTES // (16 * MIB)  # the floor: 16
    assert streams(50 * MIB, 1 << 40) == 18  # six times the weights: 300 MiB
    assert streams(50 * MIB, 256 * MIB) == 4  # a quarter of the memory: 64 MiB
    with pytest.raises(KvMemoryError):
        streams(50 * MIB, 128 * MIB)


def test_container_memory_is_the_cgroup_limit_else_the_machine(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:       16384000 kB\nMemFree: 1 kB\n")
    assert container_memory_bytes(tmp_path) == 16_384_000 * 1024
    cgroup = tmp_path / "sys/fs/cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("max\n")  # v2 without a limit
    assert container_memory_bytes(tmp_path) == 16_384_000 * 1024
    (cgroup / "memory.max").write_text(f"{4 << 30}\n")
    assert container_memory_bytes(tmp_path) == 4 << 30


def _wide(index: int) -> Decision:
    """A question with 60 options: letter-digit labels with six first letters, so seven
    sequences in one pass."""
    options = tuple(Option(f"o{n}", f"n{n}") for n in range(60))
    return Decision(f"d{index}", "Order 1182 arrived damaged.", f"Which of these {index}?", options)


def test_a_small_budget_scores_exactly_what_a_full_cache_does(tiny_gguf: Path) -> None:
    """Five streams (four sequences a pass): a 60-option question's prompt and six label
    continuations go over several passes, and every probability is bit-identical to the
    32-stream cache's."""
    full = open_test_model(tiny_gguf, stream_cells=1025, max_branches=31)
    cell_bytes = full.engine.memory.bytes // (full.engine.memory.streams * 1280)
    small = open_test_model(
        tiny_gguf,
        stream_cells=1025,
        max_branches=31,
        kv_budget=KvBudget.parse(str(5 * 1280 * cell_bytes + 1000)),
    )
    try:
        assert full.engine.memory.streams == MAX_STREAMS
        assert (small.engine.memory.streams, small.engine.max_branches) == (5, 4)
        assert small.engine.description()["kv_streams"] == 5
        decisions = [_wide(0), _wide(1)]
        want = decide(service_of(full), decisions, "shared")
        got = decide(service_of(small), decisions, "shared")
        for mine, theirs in zip(got["results"], want["results"], strict=True):
            assert mine["probabilities"] == theirs["probabilities"]
        assert got["timing"]["passes"] > want["timing"]["passes"]
    finally:
        full.engine.close()
        small.engine.close()
