#!/usr/bin/env python3
"""CDK entry point: `cdk synth|deploy|destroy -c env=NAME` (`-c env=all` synthesizes all).

The only place that reads context; everything below receives typed props. cdk-nag's
AwsSolutions pack runs as a synth-time validation, so any finding fails synth.
"""

from __future__ import annotations

from pathlib import Path

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from stacks.deployment import add_environment
from stacks.environments import select_environments

REPO_ROOT = Path(__file__).resolve().parent
DEFAULT_ENVIRONMENT = "dev"


def build_app(app: cdk.App, env_name: str) -> cdk.App:
    """Add the stacks of `env_name` (or of every environment for `all`) and cdk-nag."""
    for config in select_environments(env_name):
        add_environment(app, config, REPO_ROOT)
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app


def main() -> None:
    app = cdk.App()
    env_name = app.node.try_get_context("env") or DEFAULT_ENVIRONMENT
    build_app(app, str(env_name)).synth()


if __name__ == "__main__":
    main()
