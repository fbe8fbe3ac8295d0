"""Where an environment is deployed, resolved without editing code.

Account and region: `-c account=... -c region=...`, then `CDK_DEFAULT_ACCOUNT` /
`CDK_DEFAULT_REGION` (the CDK CLI sets them from the credentials and profile it runs with),
then the environment's config. The shipped environments name no account, so:

- with credentials (any `cdk deploy`, or `cdk synth` on a machine that has them) the stacks
  target the credentials' account;
- without credentials and without `-c account=` (CI: `cdk synth -c env=all`) the account
  stays unresolved and the stacks synthesize environment-agnostic (`AWS::AccountId`), so CI
  needs no AWS access and looks nothing up;
- a placeholder account (`111111111111`, `123456789012`, ...) from any source is refused,
  naming the setting it came from, so no deploy can target one;
- a region always resolves (the config has one), so even the environment-agnostic synth is
  checked against `stacks/regions.py`: a region whose CloudFormation schema lacks a property
  the environment's endpoints write is refused, naming the property and the setting.

Also from context: `-c alarm_email=ADDRESS` (subscribed to the alarm topic) and, for VPC
placement, `-c subnet_ids=subnet-a,subnet-b -c security_group_ids=sg-a [-c vpc_id=vpc-x]`
(both lists or neither; explicit ids must be real-looking, never placeholders).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cdk_constructs.endpoint_props import NetworkSettings
from cdk_constructs.validation import PropsError
from stacks.config import (
    AlarmNotifications,
    ConfigError,
    EnvironmentConfig,
    require_account,
    require_region,
    require_region_supports,
)

CONTEXT_KEYS = ("account", "region", "alarm_email", "subnet_ids", "security_group_ids", "vpc_id")


def _first(*sources: tuple[str, Any]) -> tuple[str, str] | None:
    """The first (setting, value) whose value is set and not empty."""
    for setting, value in sources:
        if value is not None and str(value).strip():
            return setting, str(value).strip()
    return None


def _ids(value: Any) -> tuple[str, ...]:
    items = value if isinstance(value, list | tuple) else str(value).split(",")
    return tuple(str(item).strip() for item in items if str(item).strip())


def resolve_target(
    config: EnvironmentConfig, context: Mapping[str, Any], environ: Mapping[str, str]
) -> EnvironmentConfig:
    """`config` with account, region, alarm email and network taken from context/environ."""
    account = _first(
        ("-c account", context.get("account")),
        ("CDK_DEFAULT_ACCOUNT", environ.get("CDK_DEFAULT_ACCOUNT")),
        (f"{config.name}.account", config.account),
    )
    if account is not None:
        require_account(account[1], account[0])
    region = _first(
        ("-c region", context.get("region")),
        ("CDK_DEFAULT_REGION", environ.get("CDK_DEFAULT_REGION")),
        (f"{config.name}.region", config.region),
    )
    assert region is not None  # the config always has one
    require_region(region[1], region[0])
    require_region_supports(config, region[1], region[0])
    notifications = config.notifications
    email = _first(("-c alarm_email", context.get("alarm_email")))
    if email is not None:
        try:
            notifications = AlarmNotifications(topic_arn=notifications.topic_arn, email=email[1])
        except PropsError as error:
            raise ConfigError(f"-c alarm_email: {error}") from None
    network = config.network
    subnets, groups = context.get("subnet_ids"), context.get("security_group_ids")
    if subnets or groups:
        if not (subnets and groups):
            raise ConfigError("-c subnet_ids and -c security_group_ids go together")
        vpc = _first(("-c vpc_id", context.get("vpc_id")))
        try:
            network = NetworkSettings(
                subnet_ids=_ids(subnets),
                security_group_ids=_ids(groups),
                vpc_id=None if vpc is None else vpc[1],
            )
        except PropsError as error:
            raise ConfigError(f"-c {error}") from None
    return dataclasses.replace(
        config,
        account=None if account is None else account[1],
        region=region[1],
        notifications=notifications,
        network=network,
    )
