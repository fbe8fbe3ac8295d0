"""The versions the hashed locks pin, read the way pip reads requirements.txt's -r lines."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_PIN = re.compile(r"^([A-Za-z0-9._-]+)(?:\[[^\]]*\])?==([^\s;\\]+)")


def locked_versions(requirements: Path = REPO / "requirements.txt") -> dict[str, str]:
    """Package name (lower case) -> pinned version, following `-r` includes."""
    versions: dict[str, str] = {}
    for line in requirements.read_text().splitlines():
        if line.startswith("-r "):
            versions.update(locked_versions(requirements.parent / line[3:].strip()))
        elif match := _PIN.match(line):
            versions[match.group(1).lower()] = match.group(2)
    return versions
