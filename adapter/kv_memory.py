"""How many KV streams the cache holds: sized to a memory budget, not to the worst case.

Every stream holds one sequence of up to SEMIF_MAX_TOKENS (+1 for a label continuation)
tokens, the promise made to every prompt, so the budget (`SEMIF_KV_MEMORY`) decides how
many streams there are, up to `MAX_STREAMS` (the widest pass the planner uses). llama.cpp
allocates and clears the whole cache when the context is created, so an oversized cache
costs resident memory and start time even when requests are short: 32 streams of 4,352
cells were 3.2 GB for the 94 MB embedded model.

The budget is bytes (`768MiB`, `2GiB`, `1500000000`), a fraction of the memory the
container sees (`0.25`), or `auto`: `AUTO_WEIGHTS_MULTIPLE` times the weights' size (at
least `AUTO_FLOOR_BYTES`), at most `AUTO_MEMORY_FRACTION` of the container's memory, so a
small model keeps a small cache and a large one leaves room for its weights and the OS.
Fewer streams mean fewer prompts per pass, never a refused prompt: a question's label
continuations that do not fit one pass are scored over several (adapter.service).

Pure policy: the engine measures what a stream costs on the loaded model and asks
`plan_cache`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MAX_STREAMS = 32
# A pass needs a prompt and one continuation; one more stream is kept for a chat generation.
MIN_STREAMS = 3
AUTO_WEIGHTS_MULTIPLE = 6
AUTO_MEMORY_FRACTION = 0.25
AUTO_FLOOR_BYTES = 256 << 20  # a tiny model's cache need not be tinier than this
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_AMOUNT = re.compile(r"^(\d+(?:\.\d+)?)\s*([kmgt]ib|b)?$", re.IGNORECASE)


AUTO = "auto"


class KvMemoryError(ValueError):
    """The budget cannot be read, or holds too few streams for the model and max tokens."""


@dataclass(frozen=True)
class KvBudget:
    """SEMIF_KV_MEMORY as given: `auto`, a number of bytes, or a fraction of memory."""

    setting: str
    amount: int | None = None  # bytes
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str) -> KvBudget:
        value = text.strip()
        if value.lower() == "auto":
            return cls("auto")
        match = _AMOUNT.match(value)
        if not match:
            raise KvMemoryError(
                f"SEMIF_KV_MEMORY={text!r} is not a budget; give auto, bytes (768MiB, 2GiB) "
                "or a fraction of the container's memory (0.25)"
            )
        number, unit = float(match.group(1)), (match.group(2) or "").lower()
        if not unit and "." in match.group(1):
            if not 0 < number <= 1:
                raise KvMemoryError(
                    f"SEMIF_KV_MEMORY={text!r}: a fraction of the container's memory is in (0, 1]"
                )
            return cls(value, fraction=number)
        return cls(value, amount=int(number * _UNITS[unit]))

    def limit(self, *, weights_bytes: int, container_bytes: int) -> int:
        """The bytes the cache may take."""
        if self.amount is not None:
            return self.amount
        if self.fraction is not None:
            return int(self.fraction * container_bytes)
        return min(
            max(AUTO_WEIGHTS_MULTIPLE * weights_bytes, AUTO_FLOOR_BYTES),
            int(AUTO_MEMORY_FRACTION * container_bytes),
        )


@dataclass(frozen=True)
class StreamCost:
    """What one stream takes on the loaded model: attention KV per cell, and the fixed
    recurrent state a sequence keeps (0 for a pure attention model)."""

    cell_bytes: int
    state_bytes: int = 0

    def of(self, cells: int) -> int:
        return cells * self.cell_bytes + self.state_bytes


@dataclass(frozen=True)
class CachePlan:
    """The cache the budget buys: streams of `stream_cells` cells, `bytes` in all."""

    streams: int
    stream_cells: int
    bytes: int
    limit: int
    setting: str

    def summary(self) -> dict[str, object]:
        return {
            "kv_memory": self.setting,
            "kv_budget_mib": round(self.limit / (1 << 20), 1),
            "kv_streams": self.streams,
            "stream_cells": self.stream_cells,
            "kv_cache_mib": round(self.bytes / (1 << 20), 1),
        }


def plan_cache(
    budget: KvBudget | None,
    *,
    stream_cells: int,
    cost: StreamCost,
    weights_bytes: int,
    container_bytes: int | None = None,
) -> CachePlan:
    """As many streams as the budget holds, between MIN_STREAMS and MAX_STREAMS (all of
    them without a budget); a budget below MIN_STREAMS is refused with what it would take.
    `container_bytes` defaults to what this process sees (`container_memory_bytes`)."""
    per_stream = cost.of(stream_cells)
    if budget is None:
        budget = KvBudget("none", amount=MAX_STREAMS * per_stream)
    if container_bytes is None and budget.amount is None:
        container_bytes = container_memory_bytes()
    limit = budget.limit(weights_bytes=weights_bytes, container_bytes=container_bytes or 0)
    streams = min(MAX_STREAMS, limit // max(per_stream, 1))
    if streams < MIN_STREAMS:
        need = MIN_STREAMS * per_stream
        raise KvMemoryError(
            f"SEMIF_KV_MEMORY={budget.setting} allows {_mib(limit)} for the KV cache, which "
            f"holds {streams} streams of {stream_cells} cells ({_mib(per_stream)} each on this "
            f"model); at least {MIN_STREAMS} are needed ({_mib(need)}): raise SEMIF_KV_MEMORY "
            "or lower SEMIF_MAX_TOKENS"
        )
    return CachePlan(streams, stream_cells, streams * per_stream, limit, budget.setting)


def container_memory_bytes(root: Path = Path("/")) -> int:
    """The memory this process may use: the cgroup's limit (v2, then v1) when it sets one,
    else the machine's (MemTotal)."""
    total = _meminfo_total(root / "proc/meminfo")
    for limit_file in (
        root / "sys/fs/cgroup/memory.max",
        root / "sys/fs/cgroup/memory/memory.limit_in_bytes",
    ):
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            return int(text)
    return total


def _meminfo_total(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise KvMemoryError(f"{path} does not say MemTotal")


def _mib(value: int) -> str:
    return f"{value / (1 << 20):.1f} MiB"
