"""The CloudFormation properties the stacks write that some regions' schemas lack.

A property a region's resource schema does not have fails the deploy there; worse, where
the SageMaker side still deploys, PromQL alarms on metrics that detailed observability never
publishes would stay OK forever. So an environment whose region lacks a property its
endpoints use is refused at synth (`stacks/config.py`, `require_region_supports`), naming
the property. The table is data read from cfn-lint's per-region CloudFormation schemas
(`cfnlint/data/schemas/providers/<region>.json`); `tests/cdk/test_regions.py` checks it
against them, so a cfn-lint update that adds or removes a gap fails the tests until the
table follows.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType


class CfnFeature(enum.Enum):
    """A resource type, the property path within it (through lists and `$ref`s) and, for an
    enum, the value the stacks write."""

    DETAILED_OBSERVABILITY = (
        "AWS::SageMaker::EndpointConfig",
        "MetricsConfig.EnableDetailedObservability",
        None,
    )
    PROMQL_ALARMS = ("AWS::CloudWatch::Alarm", "EvaluationCriteria.PromQLCriteria", None)
    PREFIX_AWARE_ROUTING = (
        "AWS::SageMaker::EndpointConfig",
        "ProductionVariants.RoutingConfig.RoutingStrategy",
        "PREFIX_AWARE",
    )
    LEAST_OUTSTANDING_ROUTING = (
        "AWS::SageMaker::EndpointConfig",
        "ProductionVariants.RoutingConfig.RoutingStrategy",
        "LEAST_OUTSTANDING_REQUESTS",
    )
    INSTANCE_POOLS = ("AWS::SageMaker::EndpointConfig", "ProductionVariants.InstancePools", None)
    INFERENCE_COMPONENTS = ("AWS::SageMaker::InferenceComponent", "RuntimeConfig.CopyCount", None)

    @property
    def resource_type(self) -> str:
        return str(self.value[0])

    @property
    def path(self) -> tuple[str, ...]:
        return tuple(str(self.value[1]).split("."))

    @property
    def enum_value(self) -> str | None:
        value = self.value[2]
        return None if value is None else str(value)

    def __str__(self) -> str:
        where = f"{self.resource_type} {self.value[1]}"
        return where if self.enum_value is None else f"{where} {self.enum_value}"


_SAGEMAKER = frozenset(f for f in CfnFeature if f.resource_type.startswith("AWS::SageMaker::"))

_COMPONENTS = frozenset({CfnFeature.INFERENCE_COMPONENTS})

# Regions whose schema lacks a feature, from cfn-lint 1.58: me-central-1 and us-gov-east-1
# have no AWS::SageMaker::EndpointConfig (nor Endpoint, nor Model) at all, us-gov-east-1 no
# InferenceComponent either; the others lack AWS::SageMaker::InferenceComponent only.
# Regions not named here have every feature; a region cfn-lint does not know is not checked.
REGIONS_WITHOUT: Mapping[str, frozenset[CfnFeature]] = MappingProxyType(
    {
        "me-central-1": _SAGEMAKER - _COMPONENTS,
        "us-gov-east-1": _SAGEMAKER,
        **{
            region: _COMPONENTS
            for region in (
                "af-south-1",
                "ap-east-1",
                "ap-east-2",
                "ap-northeast-3",
                "ap-south-2",
                "ap-southeast-4",
                "ap-southeast-5",
                "ap-southeast-6",
                "ap-southeast-7",
                "ca-west-1",
                "cn-north-1",
                "cn-northwest-1",
                "eu-central-2",
                "eu-south-1",
                "eu-south-2",
                "eu-west-3",
                "il-central-1",
                "mx-central-1",
                "us-gov-west-1",
                "us-west-1",
            )
        },
    }
)


def missing_features(region: str, features: frozenset[CfnFeature]) -> list[CfnFeature]:
    """Those of `features` that `region`'s CloudFormation schema lacks, in table order."""
    lacking = REGIONS_WITHOUT.get(region, frozenset())
    return [feature for feature in CfnFeature if feature in features & lacking]
