"""Fixtures of the CDK tests; the code they wrap is in `tests/support/templates.py` and,
for the environments with a candidate, `tests/cdk/candidates.py`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cdk.candidates import CPU_ENV, GPU_ENV, synthesize_checked
from tests.support.templates import Synth, synthesize_all


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The whole app (`-c env=all`, cdk-nag included), synthesized once per test run."""
    return synthesize_all(
        tmp_path_factory.mktemp("cdk.out"), tmp_path_factory.mktemp("cdk.out.nonag")
    )


@pytest.fixture(scope="session")
def candidate_templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The stacks of two environments whose decision endpoints shadow a candidate, by
    stack name, synthesized once per test run with cdk-nag (a finding fails it)."""
    return synthesize_checked((CPU_ENV, GPU_ENV), tmp_path_factory.mktemp("cdk.out.candidate"))
