"""The shipped environments: valid, selectable by name, frozen."""

from __future__ import annotations

import dataclasses

import pytest

from stacks.config import ConfigError
from stacks.environments import ALL_ENVIRONMENTS, ENVIRONMENTS, select_environments


def test_every_shipped_environment_is_valid_and_selectable() -> None:
    assert {"dev", "prod", "gpu"} <= set(ENVIRONMENTS)
    assert select_environments("prod") == (ENVIRONMENTS["prod"],)
    everything = select_environments(ALL_ENVIRONMENTS)
    assert [config.name for config in everything] == ["dev", "prod", "gpu"]


def test_unknown_environment_names_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown environment.*dev.*prod.*gpu.*all"):
        select_environments("staging")


def test_config_is_frozen_including_its_tags() -> None:
    dev = ENVIRONMENTS["dev"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dev.region = "eu-west-1"  # type: ignore[misc]
    with pytest.raises(TypeError):
        dev.tags["owner"] = "someone"  # type: ignore[index]
