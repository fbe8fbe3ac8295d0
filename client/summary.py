"""What a finished batch did: lines answered, errors by status, time.

Every batch path reports the same `Summary`: `semif batch local` (client.batch_local), a
transform job (client.batch_aws) and the asynchronous endpoint (client.async_endpoint,
which `DecisionClient.batch_async` calls). It sits below all of them and below the client,
so none has to import another for it.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Summary:
    """What a finished batch did."""

    lines: int
    statuses: dict[int, int]  # answer status -> lines
    seconds: float
    resumed: int  # lines already answered by an earlier run

    @property
    def errors(self) -> int:
        return sum(count for status, count in self.statuses.items() if status != 200)

    def describe(self) -> str:
        rate = (self.lines - self.resumed) / self.seconds if self.seconds > 0 else 0.0
        kinds = ", ".join(
            f"{count} x {status}"
            for status, count in sorted(self.statuses.items())
            if status != 200
        )
        errors = f"{self.errors} errors ({kinds})" if self.errors else "no errors"
        resumed = f", {self.resumed} from an earlier run" if self.resumed else ""
        return (
            f"{self.lines} lines answered{resumed}: {errors}; "
            f"{self.seconds:.1f} s, {rate:.1f} lines/s"
        )


def count_statuses(lines: Iterable[bytes | str]) -> Counter[int]:
    """Answer lines by status (an answer without one is a 200)."""
    statuses: Counter[int] = Counter()
    for line in lines:
        if line.strip():
            answer = json.loads(line)
            statuses[int(answer.get("status", 200)) if isinstance(answer, dict) else 0] += 1
    return statuses
