"""Reading the adapter's audit records back: from a local file or an `s3://bucket/key` object
of log lines, as the container wrote them or as a CloudWatch Logs export holds them.

The adapter (adapter/audit.py, `SEMIF_AUDIT=digest|full`) writes one line `{"audit": {...}}`
per decision answered. Whoever reads them back (`semif shadow-report`, client.shadow_report;
`semif-calibrate --from-audit`, bench.audit_tasks) gets the lines of a whole log: anything
before a line's first `{` (an export's timestamp) is ignored, and lines that are not records
(other log lines) are skipped. It lives in the client, which runs without llama.cpp, so
application pipelines can read records; the benchmarks import it from here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from client.aws import aws_client, split_s3_uri


class AuditRecordsError(ValueError):
    """A records source cannot be read; the message names it."""


def read_source(source: str, region: str | None = None) -> bytes:
    """A local file's bytes, or an S3 object's."""
    if source.startswith("s3://"):
        bucket, key = split_s3_uri(source)
        body: bytes = aws_client("s3", region).get_object(Bucket=bucket, Key=key)["Body"].read()
        return body
    return Path(source).read_bytes()


def read_lines(source: str, region: str | None = None) -> list[str]:
    """The source's lines as text; AuditRecordsError naming the source when it cannot be
    read (missing, not UTF-8, an S3 error), so a command line can say which one."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return read_source(source, region).decode().splitlines()
    except OSError as error:
        raise AuditRecordsError(f"cannot read {source}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise AuditRecordsError(f"{source} is not UTF-8 text: {error}") from None
    except (BotoCoreError, ClientError, ValueError) as error:  # ValueError: a bad s3:// URI
        raise AuditRecordsError(f"cannot read {source}: {error}") from None


def numbered_records(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number from 1, record) of every audit record among `lines`; the number lets a
    reader name the line of a record it cannot use."""
    for number, line in enumerate(lines, start=1):
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict) and isinstance(value.get("audit"), dict):
            yield number, value["audit"]


def records(lines: Iterable[str]) -> list[dict[str, Any]]:
    """Every audit record among `lines` (log lines that are not records are skipped)."""
    return [record for _, record in numbered_records(lines)]
