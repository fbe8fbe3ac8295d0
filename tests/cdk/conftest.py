"""Fixtures of the CDK tests; the code they wrap is in `tests/support/templates.py`."""

from __future__ import annotations

import pytest

from tests.support.templates import Synth, synthesize_all


@pytest.fixture(scope="session")
def synth(tmp_path_factory: pytest.TempPathFactory) -> Synth:
    """The whole app (`-c env=all`, cdk-nag included), synthesized once per test run."""
    return synthesize_all(
        tmp_path_factory.mktemp("cdk.out"), tmp_path_factory.mktemp("cdk.out.nonag")
    )
