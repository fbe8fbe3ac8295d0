"""Audit records: one structured JSON line per decision answered, for the record of what was
decided and (at `full`) the calibration set a team builds from its own traffic.

`SEMIF_AUDIT` sets the level:
- `none` (the default): no record;
- `digest`: what was decided and how, never the request's text: which API answered
  (`api`: `decision`, or `systemone`, whose records name the question's key as
  `decision_id`), the request id, the decision's id and the caller's `audit_id` when the
  body gave one (the join key for labels that arrive later and for a shadow's records),
  the serving variant (`variant`: SEMIF_VARIANT, the SageMaker production or shadow
  variant's name, so one log group's records split into the two sides of a shadow test),
  sha256 of its state, question and options and of the exact prompt, the model (GGUF file
  and sha256, the manifest's calibration, the ggml backends, the chat template's identity),
  prompt version, readout, option order, the calibration applied, the options'
  probabilities, the prediction set, abstention and its reason, and the request's latency
  and tokens;
- `full`: the digest plus the state, question and options as sent, refused at start unless
  `SEMIF_AUDIT_ALLOW_FULL=true` says the environment may keep request text.
A record is the line `{"audit": {...}}` on the container's standard output, which SageMaker
sends to CloudWatch Logs, where a query finds it by its key (docs/adapter.md, "Audit
records"). It is at most MAX_RECORD_BYTES: a longer one drops the request's text first,
then keeps the most probable options only, and says what it left out.

Never a decision's problem: records go through a bounded queue to a writer thread, so a
slow or blocked log stream cannot slow an answer; when the queue is full the record is
dropped and counted (`semif_audit_dropped_total`).

Threads: `record` runs on request threads and the event loop; the writer is its own
daemon thread, the only one that writes records.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from adapter.schema import Decision
from adapter.settings import AuditLevel
from adapter.template_key import options_sha256, text_sha256

MAX_RECORD_BYTES = 16 * 1024  # one CloudWatch Logs event holds 256 KiB; a record far less
KEPT_OPTIONS = 16  # options a record too long keeps, the most probable first
QUEUE_RECORDS = 10_000  # records waiting for the writer before new ones are dropped
AuditedApi = Literal["decision", "systemone"]
# What a record copies of a result as answered (adapter.decisions): the decision's reading.
_RESULT_FIELDS = (
    "kind",
    "prompt_sha256",
    "prompt_version",
    "readout",
    "normalization",
    "option_order",
    "calibration",
    "abstained",
    "abstain_reason",
    "prediction_set",
    "coverage",
    "coverage_method",
    "applies",
    "timing",
)


def decision_record(
    level: AuditLevel,
    decision: Decision,
    result: Mapping[str, Any],
    *,
    api: AuditedApi,
    request_id: str,
    variant: str | None,
    model: Mapping[str, Any],
    seconds: float,
) -> dict[str, Any]:
    """One decision's record at `level` (`digest` or `full`), bounded to MAX_RECORD_BYTES.
    `result` holds the decision API's result fields (System One's: adapter.provenance)."""
    record: dict[str, Any] = {
        "api": api,
        "request_id": request_id,
        "decision_id": decision.id,
        **({"audit_id": decision.audit_id} if decision.audit_id is not None else {}),
        **({"variant": variant} if variant is not None else {}),
        "level": level,
        "state_sha256": text_sha256(decision.state_text),
        "question_sha256": text_sha256(decision.question),
        "options_sha256": options_sha256(decision.options),
        "model": {
            "file": model.get("file"),
            "sha256": model.get("sha256"),
            "calibration": model.get("calibration"),
            "backends": model.get("backends"),
            "chat_template": model.get("chat_template"),
        },
        **{key: result[key] for key in _RESULT_FIELDS if key in result},
        "option_ids": list(result["option_ids"]),
        "probabilities": list(result["probabilities"]),
        "request_seconds": round(seconds, 6),
    }
    if level == "full":
        record["request"] = {
            "state": decision.state,
            "question": decision.question,
            "options": [
                {"id": o.id, "description": o.description, "label": o.label}
                for o in decision.options
            ],
        }
    return bounded(record)


def bounded(record: dict[str, Any]) -> dict[str, Any]:
    """The record within MAX_RECORD_BYTES: without the request's text first, then with only
    the KEPT_OPTIONS most probable options; what was left out is said (`omitted`)."""
    if _size(record) <= MAX_RECORD_BYTES:
        return record
    omitted = []
    if "request" in record:
        record = {key: value for key, value in record.items() if key != "request"}
        omitted.append("request")
    if _size(record) > MAX_RECORD_BYTES:
        pairs = sorted(
            zip(record["option_ids"], record["probabilities"], strict=True), key=lambda p: -p[1]
        )[:KEPT_OPTIONS]
        record = {
            **record,
            "option_ids": [option for option, _ in pairs],
            "probabilities": [p for _, p in pairs],
        }
        omitted.append("options")
        record.pop("prediction_set", None)
        record.pop("applies", None)
    return {**record, "omitted": omitted}


def _size(record: Mapping[str, Any]) -> int:
    return len(json.dumps(record, ensure_ascii=False).encode())


class AuditLog:
    """Writes records at `level` from a bounded queue on its own thread, each naming the
    serving `variant`; `on_written` and `on_dropped` hear each record (the metrics)."""

    def __init__(
        self,
        level: AuditLevel,
        *,
        variant: str | None = None,
        write: Callable[[str], None] | None = None,
        on_written: Callable[[], None] = lambda: None,
        on_dropped: Callable[[], None] = lambda: None,
        capacity: int = QUEUE_RECORDS,
    ) -> None:
        self.level = level
        self.variant = variant
        self._write = write or _stdout_line
        self._on_written = on_written
        self._on_dropped = on_dropped
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize=capacity)
        self._writer: threading.Thread | None = None
        if level != "none":
            self._writer = threading.Thread(target=self._drain, name="audit", daemon=True)
            self._writer.start()

    def decisions(
        self,
        decisions: Sequence[Decision],
        results: Sequence[Mapping[str, Any]],
        *,
        api: AuditedApi,
        request_id: str,
        model: Mapping[str, Any],
        seconds: float,
    ) -> None:
        """Record each decision of a request as answered; never blocks, never raises."""
        if self.level == "none":
            return
        for decision, result in zip(decisions, results, strict=True):
            line = json.dumps(
                {
                    "audit": decision_record(
                        self.level,
                        decision,
                        result,
                        api=api,
                        request_id=request_id,
                        variant=self.variant,
                        model=model,
                        seconds=seconds,
                    )
                },
                ensure_ascii=False,
                allow_nan=False,
            )
            try:
                self._queue.put_nowait(line)
            except queue.Full:
                self._on_dropped()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (within `timeout`), then stop the writer."""
        if self._writer is None:
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return  # the writer is stuck; it is a daemon, the process may exit
        self._writer.join(timeout)

    def _drain(self) -> None:
        while (line := self._queue.get()) is not None:
            try:
                self._write(line)
                self._on_written()
            except Exception:  # a log stream that fails drops its record, nothing else
                self._on_dropped()


def _stdout_line(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
