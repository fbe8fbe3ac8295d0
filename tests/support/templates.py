"""What the CDK tests (tests/cdk) share about templates: the in-process synth of every
environment, walks over a synthesized template, and the snapshot normalisation. Tests import
this module; `tests/cdk/conftest.py` only wraps the synth in a fixture.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk.assertions import Match, Template

import app as cdk_app
from stacks.config import REPO_ROOT, EndpointKind, EnvironmentConfig
from stacks.deployment import add_environment, stack_name
from stacks.environments import ENVIRONMENTS

REPO = Path(__file__).resolve().parents[2]
CDK_CONTEXT: dict[str, Any] = json.loads((REPO / "cdk.json").read_text())["context"]
SNAPSHOTS = REPO / "tests" / "cdk" / "snapshots"
UPDATE_SNAPSHOTS_VARIABLE = "SEMIF_UPDATE_SNAPSHOTS"
# Calibration files for the tests, named relative to the repository like an environment's.
CALIBRATIONS = "tests/cdk/calibration"
VALID_CALIBRATION = f"{CALIBRATIONS}/valid.json"
# A chat template, named relative to the repository like an environment's.
VALID_CHAT_TEMPLATE = "tests/cdk/chat_template/valid.jinja"


@dataclass(frozen=True)
class Synth:
    """One `-c env=all` synth: its output directory, templates and cdk-nag findings."""

    outdir: Path
    templates: dict[str, dict[str, Any]]
    violations: dict[str, list[str]]

    def template(self, env: str, unit: str) -> Template:
        return Template.from_json(self.raw(env, unit))

    def raw(self, env: str, unit: str) -> dict[str, Any]:
        return self.templates[f"semif-{env}-{unit}"]


def _synthesize(outdir: Path, *, with_nag: bool) -> cdk.cx_api.CloudAssembly:
    """The app as the CLI runs it: cdk.json's context, every environment."""
    app = cdk.App(outdir=str(outdir), context={**CDK_CONTEXT, "env": "all"})
    if with_nag:  # no CDK_DEFAULT_ACCOUNT/REGION: CI's offline, environment-agnostic synth
        return cdk_app.build_app(app, "all", environ={}).synth()
    for config in ENVIRONMENTS.values():
        add_environment(app, config, REPO_ROOT)
    return app.synth()


def _violations(outdir: Path) -> dict[str, list[str]]:
    report = json.loads((outdir / "validation-report.json").read_text())
    found: dict[str, list[str]] = {}
    for plugin in report["pluginReports"]:
        for violation in plugin["violations"]:
            for construct in violation["violatingConstructs"]:
                stack = construct["constructPath"].split("/")[0]
                found.setdefault(stack, []).append(
                    f"{violation['ruleName']} at {construct['constructPath']}"
                )
    return found


def synthesize_all(outdir: Path, fallback_outdir: Path) -> Synth:
    """Synthesize with cdk-nag; if nag fails the synth, keep its report and synthesize
    again without it so the other tests still see the templates."""
    violations: dict[str, list[str]] = {}
    try:
        assembly = _synthesize(outdir, with_nag=True)
    except RuntimeError:
        violations = _violations(outdir)
        outdir = fallback_outdir
        assembly = _synthesize(outdir, with_nag=False)
    templates = {stack.stack_name: stack.template for stack in assembly.stacks}
    return Synth(outdir=outdir, templates=templates, violations=violations)


def synthesize_environment(config: EnvironmentConfig, outdir: Path) -> cdk.cx_api.CloudAssembly:
    """One (possibly modified) environment on its own, without cdk-nag."""
    app = cdk.App(outdir=str(outdir), context=CDK_CONTEXT)
    add_environment(app, config, REPO_ROOT)
    return app.synth()


def expected_stacks(config: EnvironmentConfig) -> set[str]:
    units = {"artifact", "images"}  # images: the DLC mirror, in every environment
    if config.deploys(EndpointKind.DECISION):
        units.add("decision")
    if config.deploys(EndpointKind.STANDARD):
        units.add("standard")
    return {stack_name(config, unit) for unit in units}


ALL_STACKS = sorted(name for c in ENVIRONMENTS.values() for name in expected_stacks(c))


# --- template walks ---------------------------------------------------------------------


def resources(template: Mapping[str, Any], kind: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for logical_id, resource in template["Resources"].items():
        if resource["Type"] == kind:
            yield logical_id, resource


def logical_id(template: Mapping[str, Any], kind: str) -> str:
    """The logical id of the one resource of `kind`."""
    found = [name for name, _ in resources(template, kind)]
    assert len(found) == 1, f"expected one {kind}, found {found}"
    return found[0]


def one(template: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """The properties of the one resource of `kind`."""
    return template["Resources"][logical_id(template, kind)]["Properties"]  # type: ignore[no-any-return]


def statements(template: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every IAM statement of the template, with the logical id of its policy or role."""
    for name, resource in template["Resources"].items():
        props = resource.get("Properties", {})
        if resource["Type"] == "AWS::IAM::Policy":
            documents = [props["PolicyDocument"]]
        elif resource["Type"] == "AWS::IAM::Role":
            documents = [policy["PolicyDocument"] for policy in props.get("Policies", [])]
        else:
            continue
        for document in documents:
            for statement in document["Statement"]:
                yield name, statement


def scaling_alarms(template: Mapping[str, Any]) -> set[str]:
    """The alarms that trigger a scaling policy (an asynchronous endpoint's start from zero),
    not a notification."""
    policies = {
        name for name, _ in resources(template, "AWS::ApplicationAutoScaling::ScalingPolicy")
    }
    return {
        name
        for name, alarm in resources(template, "AWS::CloudWatch::Alarm")
        if any(
            isinstance(action, dict) and action.get("Ref") in policies
            for action in alarm["Properties"]["AlarmActions"]
        )
    }


def notifying_alarms(template: Mapping[str, Any]) -> Template:
    """The template's alarms that notify, as a Template of their own (for
    `all_resources_properties`)."""
    scaling = scaling_alarms(template)
    return Template.from_json(
        {
            "Resources": {
                name: alarm
                for name, alarm in resources(template, "AWS::CloudWatch::Alarm")
                if name not in scaling
            }
        }
    )


def realtime_endpoint(template: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The one real-time endpoint of an endpoint stack (not the `-async` one)."""
    ((name, endpoint),) = [
        (name, endpoint)
        for name, endpoint in resources(template, "AWS::SageMaker::Endpoint")
        if not endpoint["Properties"]["EndpointName"].endswith("-async")
    ]
    return name, endpoint


def dashboard_body(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A stack's one dashboard, its body parsed with each token (an alarm's ARN, the
    region) replaced by a placeholder, its name, and the logical ids of the alarms it names."""
    ((_, dashboard),) = resources(raw, "AWS::CloudWatch::Dashboard")
    parts = dashboard["Properties"]["DashboardBody"]["Fn::Join"][1]
    named = [part["Fn::GetAtt"][0] for part in parts if "Fn::GetAtt" in part]
    text = "".join(part if isinstance(part, str) else "TOKEN" for part in parts)
    body: dict[str, Any] = json.loads(text)
    return {**body, "name": dashboard["Properties"]["DashboardName"]}, named


def assert_role_policy_has(template: Template, role_prefix: str, expected: list[Any]) -> None:
    """An IAM policy attached to the role whose logical id starts with `role_prefix` holds
    each of `expected` (statements matched object-like, among others)."""
    template.has_resource_properties(
        "AWS::IAM::Policy",
        {
            "Roles": [{"Ref": Match.string_like_regexp(f"^{role_prefix}")}],
            "PolicyDocument": {
                "Statement": Match.array_with([Match.object_like(s) for s in expected])
            },
        },
    )


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def object_arn(bucket_arn: dict[str, Any], key: str) -> dict[str, Any]:
    """`arn_for_objects(key)` as it appears in a template, given the bucket ARN expression."""
    return {"Fn::Join": ["", [bucket_arn, f"/{key}"]]}


def import_value(stack: str, export_fragment: str) -> dict[str, Any]:
    """A matcher for an `Fn::ImportValue` of an export of `stack` naming `export_fragment`."""
    return {
        "Fn::ImportValue": Match.string_like_regexp(
            rf"^{re.escape(stack)}:ExportsOutput.*{re.escape(export_fragment)}"
        )
    }


# --- snapshots --------------------------------------------------------------------------

# The adapter image tag: `<flavor>-<32 hex>`, a hash of the image source asset (image_tag()).
_IMAGE_TAG = re.compile(r"\b(cpu|cuda)-[0-9a-f]{32}\b")


def normalized_template(outdir: Path, stack: str) -> dict[str, Any]:
    """The template with every value that changes without a change to the stack replaced.

    File asset hashes (which change whenever any source file of adapter/, model_build/ or
    the waiter changes, or aws-cdk-lib's own handlers do) become `<asset:DISPLAY NAME>`;
    values derived from them (image tags, deploy-time build triggers) become placeholders;
    the CDKMetadata resource (library version and construct analytics) is dropped.
    """
    text = (outdir / f"{stack}.template.json").read_text()
    manifest = json.loads((outdir / f"{stack}.assets.json").read_text())
    for asset_hash, entry in manifest.get("files", {}).items():
        text = text.replace(asset_hash, f"<asset:{entry.get('displayName', 'file')}>")
    text = _IMAGE_TAG.sub(lambda match: f"{match.group(1)}-<image-tag>", text)
    template: dict[str, Any] = json.loads(text)
    template["Resources"].pop("CDKMetadata", None)
    conditions = template.get("Conditions", {})
    conditions.pop("CDKMetadataAvailable", None)
    if "Conditions" in template and not conditions:
        del template["Conditions"]
    for _, resource in resources(template, "Custom::DeployTimeBuild"):
        if _IMAGE_TAG.fullmatch(
            str(resource["Properties"]["Trigger"]).replace("<image-tag>", "0" * 32)
        ):
            continue  # an image tag, already a placeholder
        resource["Properties"]["Trigger"] = "<hash of the build inputs>"
    return template


def snapshot_path(stack: str) -> Path:
    return SNAPSHOTS / f"{stack}.template.json"


def render_snapshot(template: dict[str, Any]) -> str:
    return json.dumps(template, indent=2, sort_keys=True) + "\n"
