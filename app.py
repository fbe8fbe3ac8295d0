#!/usr/bin/env python3
"""CDK entry point: `cdk synth|deploy|destroy -c env=NAME` (`-c env=all` synthesizes all).

The only place that reads context and environment variables; everything below receives
typed props. `-c account=... -c region=...`, then CDK_DEFAULT_ACCOUNT / CDK_DEFAULT_REGION,
then the config decide where each environment goes (`stacks/targets.py`); with no account
from any of them the stacks are environment-agnostic, so CI synth needs no credentials.
cdk-nag's AwsSolutions pack runs as a synth-time validation, so any finding fails synth, and
every SageMaker model image must be a private ECR image pinned by digest.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from cdk_constructs.container_image import PrivateEcrImageRule
from cdk_constructs.validation import PropsError
from stacks.config import REPO_ROOT  # calibration paths in the config are relative to it
from stacks.deployment import add_environment
from stacks.environments import select_environments
from stacks.targets import CONTEXT_KEYS, resolve_target

DEFAULT_ENVIRONMENT = "dev"


def build_app(app: cdk.App, env_name: str, environ: Mapping[str, str] | None = None) -> cdk.App:
    """Add the stacks of `env_name` (or of every environment for `all`), the image rule and
    cdk-nag. `environ` defaults to the process environment (CDK_DEFAULT_ACCOUNT/REGION)."""
    context = {key: app.node.try_get_context(key) for key in CONTEXT_KEYS}
    environment = os.environ if environ is None else environ
    for config in select_environments(env_name):
        add_environment(app, resolve_target(config, context, environment), REPO_ROOT)
    cdk.Aspects.of(app).add(PrivateEcrImageRule())
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app


def main() -> None:
    """Synthesize; a config error is one line naming the setting, not a traceback."""
    app = cdk.App()
    env_name = app.node.try_get_context("env") or DEFAULT_ENVIRONMENT
    try:
        build_app(app, str(env_name))
    except PropsError as error:
        sys.exit(f"app.py: {error}")
    app.synth()


if __name__ == "__main__":
    main()
