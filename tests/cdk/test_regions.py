"""The region table (`stacks/regions.py`) against cfn-lint's per-region CloudFormation
schemas, the features each environment declares against what its templates write, and the
refusal at synth they drive."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import cfnlint
import pytest

from stacks.config import ConfigError
from stacks.environments import ENVIRONMENTS
from stacks.regions import REGIONS_WITHOUT, CfnFeature
from stacks.targets import resolve_target
from tests.support.templates import Synth, resources

SCHEMAS = Path(cfnlint.__file__).parent / "data" / "schemas"
REGIONS = sorted(path.stem for path in (SCHEMAS / "providers").glob("*.json") if path.stem != "sam")


@cache
def _schema(region: str, resource_type: str) -> dict[str, Any] | None:
    """`resource_type`'s schema as cfn-lint has it for `region` (None: the type is absent)."""
    providers = json.loads((SCHEMAS / "providers" / f"{region}.json").read_text())
    digest = providers.get(resource_type)
    if digest is None:
        return None
    schema: dict[str, Any] = json.loads((SCHEMAS / "resources" / f"{digest}.json").read_text())
    return schema


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    """Follow `$ref`s (`#/definitions/X`) and list items down to an object or a value."""
    while True:
        if "$ref" in node:
            node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
        elif "items" in node and "properties" not in node:
            node = node["items"]
        else:
            return node


def _schema_has(region: str, feature: CfnFeature) -> bool:
    schema = _schema(region, feature.resource_type)
    if schema is None:
        return False
    node: dict[str, Any] = schema
    for name in feature.path:
        properties = _resolve(schema, node).get("properties", {})
        if name not in properties:
            return False
        node = properties[name]
    return feature.enum_value is None or feature.enum_value in _resolve(schema, node).get(
        "enum", []
    )


def test_the_table_names_exactly_the_regions_cfn_lint_says_lack_a_feature() -> None:
    assert len(REGIONS) > 30  # cfn-lint ships every commercial, GovCloud, China, ISO region
    lacking = {
        region: frozenset(f for f in CfnFeature if not _schema_has(region, f)) for region in REGIONS
    }
    assert {region: gaps for region, gaps in lacking.items() if gaps} == dict(REGIONS_WITHOUT)
    assert not lacking["us-east-1"]  # every path of the table resolves where all exist


def _written(value: Any, path: tuple[str, ...]) -> Iterator[Any]:
    """The values at `path` in a resource's properties (lists: each element)."""
    if isinstance(value, list):
        for item in value:
            yield from _written(item, path)
    elif not path:
        yield value
    elif isinstance(value, dict) and path[0] in value:
        yield from _written(value[path[0]], path[1:])


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
def test_each_environment_declares_what_its_templates_write(synth: Synth, env: str) -> None:
    """The region check reads the config's declared features: they must be what the
    stacks really write, no more and no less."""
    templates = [t for name, t in synth.templates.items() if name.startswith(f"semif-{env}-")]
    found = {
        feature
        for feature in CfnFeature
        for template in templates
        for _, resource in resources(template, feature.resource_type)
        for value in _written(resource["Properties"], feature.path)
        if feature.enum_value in (None, value)
    }
    assert found == ENVIRONMENTS[env].cloudformation_features


@pytest.mark.parametrize("env", sorted(ENVIRONMENTS))
@pytest.mark.parametrize("region", sorted(REGIONS_WITHOUT))
def test_an_environment_in_a_region_without_its_features_is_refused(env: str, region: str) -> None:
    """Refused exactly where the region lacks one of its features, naming the first: the
    regions without SageMaker endpoints refuse every environment, those without inference
    components only an environment that scales to zero (dev)."""
    config = ENVIRONMENTS[env]
    missing = [
        f for f in CfnFeature if f in REGIONS_WITHOUT[region] & config.cloudformation_features
    ]
    # Said apart from the feature sets: every environment needs the endpoint features, only
    # one that scales to zero needs inference components.
    lacks = REGIONS_WITHOUT[region]
    components = CfnFeature.INFERENCE_COMPONENTS
    refused = bool(lacks - {components}) or (
        config.decision.scale_to_zero is not None and components in lacks
    )
    assert bool(missing) == refused
    if not missing:
        assert dataclasses.replace(config, region=region).region == region
        return
    with pytest.raises(
        ConfigError,
        match=rf"^{env}\.region: '{region}' is refused: its CloudFormation schema lacks "
        + re.escape(str(missing[0])),
    ):
        dataclasses.replace(config, region=region)


def test_scale_to_zero_is_refused_where_inference_components_are_missing() -> None:
    assert CfnFeature.INFERENCE_COMPONENTS in ENVIRONMENTS["dev"].cloudformation_features
    with pytest.raises(ConfigError, match=r"AWS::SageMaker::InferenceComponent RuntimeConfig"):
        dataclasses.replace(ENVIRONMENTS["dev"], region="us-west-1")
    assert dataclasses.replace(ENVIRONMENTS["prod"], region="us-west-1").region == "us-west-1"


@pytest.mark.parametrize(
    ("context", "environ", "setting"),
    [
        ({"region": "us-gov-east-1"}, {}, "-c region"),
        ({}, {"CDK_DEFAULT_REGION": "me-central-1"}, "CDK_DEFAULT_REGION"),
    ],
)
def test_a_resolved_region_is_refused_naming_its_setting_and_each_missing_property(
    context: dict[str, str], environ: dict[str, str], setting: str
) -> None:
    """The gpu environment writes GPU pools: the message names them with the rest."""
    with pytest.raises(ConfigError) as refused:
        resolve_target(ENVIRONMENTS["gpu"], context, environ)
    message = str(refused.value)
    assert message.startswith(f"{setting}: ")
    for feature in ENVIRONMENTS["gpu"].cloudformation_features - {CfnFeature.PROMQL_ALARMS}:
        assert str(feature) in message
    assert "ProductionVariants.InstancePools" in message


def test_the_environment_agnostic_synth_still_has_a_region_to_check() -> None:
    """No account and no region given (CI): the stacks take the config's region, which its
    own validation checked (the test above), so no synth goes unchecked."""
    resolved = resolve_target(ENVIRONMENTS["dev"], {}, {})
    assert (resolved.account, resolved.region) == (None, "us-east-1")
    elsewhere = dataclasses.replace(ENVIRONMENTS["dev"], region="eu-west-1")  # no gap there
    assert resolve_target(elsewhere, {}, {}).region == "eu-west-1"
