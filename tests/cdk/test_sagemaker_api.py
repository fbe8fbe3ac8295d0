"""Every synthesized SageMaker Model, EndpointConfig and Endpoint, checked against the real
SageMaker API model (botocore's service definition), not only the CloudFormation schema:
member names, required members, enums, ranges, lengths and patterns.

CloudFormation passes these properties to CreateModel / CreateEndpointConfig /
CreateEndpoint (and UpdateEndpoint, which takes RetainAllVariantProperties and the
DeploymentConfig on updates). Values that are intrinsics are replaced by a sample of what
they resolve to (the model image by its private ECR shape, see container_image.render_image).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import botocore.loaders
import pytest
import regex  # type: ignore[import-untyped]  # Java-style \p{L} classes, as botocore's patterns use them

from cdk_constructs.container_image import render_image
from tests.support.templates import ALL_STACKS, Synth, resources

MODEL = botocore.loaders.Loader().load_service_model("sagemaker", "service-2")
SHAPES: dict[str, Any] = MODEL["shapes"]
# What an intrinsic stands for, by the API shape of the member it fills.
SAMPLES = {
    "RoleArn": "arn:aws:iam::498765432107:role/semif-execution",
    "Url": "s3://semif-artifacts/models/abc/model.tar.gz",
    "ModelName": "semif-dev-decision-model-1a2b3c",
    "EndpointConfigName": "semif-dev-decision-config-1a2b3c",
    "AlarmName": "semif-dev-decision-5xx-1a2b3c",
    "KmsKeyId": "arn:aws:kms:us-east-1:498765432107:key/0a1b2c3d-4e5f-6a7b-8c9d-0e1f2a3b4c5d",
    # An asynchronous endpoint's answer and failure paths, and its outcome topics.
    "DestinationS3Uri": "s3://semif-artifacts/async/output/",
    "SnsTopicArn": "arn:aws:sns:us-east-1:498765432107:semif-dev-decision-AsyncSuccessTopic-1A2B",
    # An inference component names its endpoint by the endpoint's attribute.
    "EndpointName": "semif-dev-decision",
}
CFN_ONLY = {"Tags"}  # CloudFormation members not sent as API members here


def _is_intrinsic(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) == 1
        and next(iter(value)).startswith(("Fn::", "Ref"))
    )


def check(value: Any, shape_name: str, path: str, shapes: dict[str, Any] = SHAPES) -> Iterator[str]:
    """Every way `value` breaks the botocore shape `shape_name` (of `shapes`: SageMaker's
    unless another service's are given)."""
    shape = shapes[shape_name]
    kind = shape["type"]
    if _is_intrinsic(value):
        if shape_name == "ContainerImage":
            value = render_image(value)
        elif shape_name in SAMPLES:
            value = SAMPLES[shape_name]
        else:
            yield f"{path}: an intrinsic where {shape_name} has no sample"
            return
    if kind == "structure":
        if not isinstance(value, dict):
            yield f"{path}: {shape_name} must be an object"
            return
        members = shape["members"]
        for name in value:
            if name not in members and name not in CFN_ONLY:
                yield f"{path}.{name}: not a member of {shape_name}"
        for name in shape.get("required", []):
            if name not in value:
                yield f"{path}: {shape_name} requires {name}"
        for name, member in members.items():
            if name in value:
                yield from check(value[name], member["shape"], f"{path}.{name}", shapes)
    elif kind == "list":
        if not isinstance(value, list):
            yield f"{path}: {shape_name} must be a list"
            return
        if not shape.get("min", 0) <= len(value) <= shape.get("max", 10**9):
            bounds = f"{shape.get('min')}..{shape.get('max')}"
            yield f"{path}: {len(value)} items, {shape_name} takes {bounds}"
        for index, item in enumerate(value):
            yield from check(item, shape["member"]["shape"], f"{path}[{index}]", shapes)
    elif kind == "map":
        if not isinstance(value, dict):
            yield f"{path}: {shape_name} must be a map"
            return
        if len(value) > shape.get("max", 10**9):
            yield f"{path}: {len(value)} entries > {shape['max']}"
        for key, item in value.items():
            yield from check(key, shape["key"]["shape"], f"{path} key {key!r}", shapes)
            yield from check(item, shape["value"]["shape"], f"{path}[{key!r}]", shapes)
    elif kind == "string":
        if not isinstance(value, str):
            yield f"{path}: {shape_name} must be a string, got {value!r}"
            return
        if "enum" in shape and value not in shape["enum"]:
            yield f"{path}: {value!r} is not one of {shape['enum']}"
        if not shape.get("min", 0) <= len(value) <= shape.get("max", 10**9):
            yield f"{path}: length {len(value)} outside {shape.get('min')}..{shape.get('max')}"
        pattern = shape.get("pattern")
        if pattern and not regex.fullmatch(pattern, value, flags=regex.DOTALL):
            yield f"{path}: {value!r} does not match {shape_name} pattern {pattern}"
    elif kind in ("integer", "long"):
        if isinstance(value, bool) or not isinstance(value, int):
            yield f"{path}: {shape_name} must be an integer, got {value!r}"
        elif not shape.get("min", -(10**18)) <= value <= shape.get("max", 10**18):
            yield f"{path}: {value} outside {shape.get('min')}..{shape.get('max')}"
    elif kind in ("float", "double"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            yield f"{path}: {shape_name} must be a number"
        elif not shape.get("min", -(10**18)) <= value <= shape.get("max", 10**18):
            yield f"{path}: {value} outside {shape.get('min')}..{shape.get('max')}"
    elif kind == "boolean" and not isinstance(value, bool):
        yield f"{path}: {shape_name} must be a boolean"


def _calls(template: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(resource, API input shape, request) for each SageMaker resource of the template."""
    for name, model in resources(template, "AWS::SageMaker::Model"):
        request = {"ModelName": SAMPLES["ModelName"], **model["Properties"]}
        yield name, "CreateModelInput", request
    for name, config in resources(template, "AWS::SageMaker::EndpointConfig"):
        request = {"EndpointConfigName": SAMPLES["EndpointConfigName"], **config["Properties"]}
        yield name, "CreateEndpointConfigInput", request
    for name, endpoint in resources(template, "AWS::SageMaker::Endpoint"):
        props = dict(endpoint["Properties"])
        retain = {k: props.pop(k) for k in ("RetainAllVariantProperties",) if k in props}
        yield name, "CreateEndpointInput", props
        yield name, "UpdateEndpointInput", {**props, **retain}
    for name, component in resources(template, "AWS::SageMaker::InferenceComponent"):
        props = dict(component["Properties"])
        deployment = {k: props.pop(k) for k in ("DeploymentConfig",) if k in props}
        yield name, "CreateInferenceComponentInput", props
        # Updates send the specification and copies again, by name, with the rollout.
        update = {k: v for k, v in props.items() if k not in ("EndpointName", "VariantName")}
        yield name, "UpdateInferenceComponentInput", {**update, **deployment}


STACKS = [name for name in ALL_STACKS if name.endswith(("-decision", "-standard"))]


def api_problems(template: dict[str, Any]) -> list[str]:
    return [
        f"{name} ({shape}): {problem}"
        for name, shape, request in _calls(template)
        for problem in check(request, shape, shape.removesuffix("Input"))
    ]


@pytest.mark.parametrize("stack", STACKS)
def test_sagemaker_resources_match_the_sagemaker_api(synth: Synth, stack: str) -> None:
    assert api_problems(synth.templates[stack]) == []


@pytest.mark.parametrize("stack", ["semif-shadow-decision", "semif-shadow-gpu-decision"])
def test_shadow_variants_match_the_sagemaker_api(
    candidate_templates: dict[str, Any], stack: str
) -> None:
    """A decision endpoint with a candidate (tests/cdk/candidates.py): its shadow variant is
    a ProductionVariant like the primary, and with shadows CreateEndpointConfig takes
    exactly one production and one shadow variant (the member's documentation)."""
    template = candidate_templates[stack]
    assert api_problems(template) == []
    shadowed = [
        request
        for _, shape, request in _calls(template)
        if shape == "CreateEndpointConfigInput" and "ShadowProductionVariants" in request
    ]
    assert [
        (len(r["ProductionVariants"]), len(r["ShadowProductionVariants"])) for r in shadowed
    ] == [(1, 1)]


def test_the_checker_catches_what_the_api_rejects() -> None:
    bad = {
        "EndpointName": "semif_dev",  # underscore: not in EndpointName's pattern
        "EndpointConfigName": "c",
        "DeploymentConfig": {
            "BlueGreenUpdatePolicy": {
                "TrafficRoutingConfiguration": {"Type": "SOMETIMES", "WaitIntervalInSeconds": 4000}
            },
            "AutoRollbackConfiguration": {"Alarms": []},
        },
        "Typo": 1,
    }
    problems = list(check(bad, "UpdateEndpointInput", "UpdateEndpoint"))
    assert any("EndpointName" in p and "pattern" in p for p in problems)
    assert any("SOMETIMES" in p for p in problems)
    assert any("4000 outside" in p for p in problems)
    assert any("0 items" in p for p in problems)
    assert any("Typo" in p for p in problems)
