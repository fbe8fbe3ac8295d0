"""Run a CodeBuild build at deploy time and report its result to CloudFormation.

Used by the CDK Provider framework (the cdklabs/deploy-time-build pattern): `on_event`
starts the build and returns at once; the framework then calls `is_complete` every
query interval until the build ends. A successful build's exported variables become the
custom resource's attributes (e.g. `IMAGE_URI`); a failed one fails the deploy with a
link to the build log. Deleting the resource deletes nothing: builds are not resources.

Each build is tagged with the resource's `Trigger` (a hash of its inputs) as the variable
DEPLOY_TRIGGER. A Create or Update whose trigger already has a succeeded build reuses it
instead of building again. That is what makes a failed deploy roll back cleanly:
CloudFormation's rollback sends an Update with the previous trigger, which finds the build
that produced the previous outputs, rather than re-running the project (whose inputs have
already moved on) for up to the build timeout.

stdlib + boto3 only (the Lambda runtime provides boto3).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import boto3

LOG = logging.getLogger()
LOG.setLevel(logging.INFO)

IN_PROGRESS = "IN_PROGRESS"
SUCCEEDED = "SUCCEEDED"
TRIGGER_VARIABLE = "DEPLOY_TRIGGER"
_RECENT_BUILDS = 100  # how far back a reusable build is looked for (one API page)


class BuildFailedError(RuntimeError):
    """The build ended without success; CloudFormation shows this message as the reason."""


def _codebuild() -> Any:
    return boto3.client("codebuild")


def on_event(event: Mapping[str, Any], _context: object, client: Any = None) -> dict[str, Any]:
    """Create/Update: start the build. Delete: nothing to undo.

    The physical id stays the project name so an update never makes CloudFormation
    "delete" the previous build.
    """
    props = event["ResourceProperties"]
    project = str(props["ProjectName"])
    if event["RequestType"] == "Delete":
        return {"PhysicalResourceId": event.get("PhysicalResourceId", project)}
    codebuild = client or _codebuild()
    trigger = str(props["Trigger"])
    previous = succeeded_build(codebuild, project, trigger)
    if previous is not None:
        LOG.info("reusing %s: it succeeded for trigger %s", previous, trigger)
        return {"PhysicalResourceId": project, "Data": {"BuildId": previous}}
    build = codebuild.start_build(
        projectName=project,
        environmentVariablesOverride=[
            {"name": TRIGGER_VARIABLE, "value": trigger, "type": "PLAINTEXT"}
        ],
    )["build"]
    LOG.info("started %s for %s", build["id"], event["RequestType"])
    return {"PhysicalResourceId": project, "Data": {"BuildId": build["id"]}}


def succeeded_build(client: Any, project: str, trigger: str) -> str | None:
    """The newest recent build of `project` that succeeded for exactly `trigger`."""
    ids = client.list_builds_for_project(projectName=project, sortOrder="DESCENDING").get("ids", [])
    recent = ids[:_RECENT_BUILDS]
    if not recent:
        return None
    by_id = {build["id"]: build for build in client.batch_get_builds(ids=recent)["builds"]}
    for build in (by_id[build_id] for build_id in recent if build_id in by_id):
        variables = build.get("environment", {}).get("environmentVariables", [])
        tagged = any(
            v.get("name") == TRIGGER_VARIABLE and v.get("value") == trigger for v in variables
        )
        if tagged and build.get("buildStatus") == SUCCEEDED:
            return str(build["id"])
    return None


def is_complete(event: Mapping[str, Any], _context: object, client: Any = None) -> dict[str, Any]:
    """Poll the build; finish with its exported variables or fail with its log link."""
    if event["RequestType"] == "Delete":
        return {"IsComplete": True}
    build_id = str(event["Data"]["BuildId"])
    builds = (client or _codebuild()).batch_get_builds(ids=[build_id])["builds"]
    if not builds:
        raise BuildFailedError(f"CodeBuild build {build_id} not found")
    build = builds[0]
    status = str(build["buildStatus"])
    if status == IN_PROGRESS:
        return {"IsComplete": False}
    log_link = str(build.get("logs", {}).get("deepLink", "(no log link)"))
    if status != SUCCEEDED:
        raise BuildFailedError(f"CodeBuild build {build_id} ended {status}; build log: {log_link}")
    wanted: Sequence[str] = event["ResourceProperties"].get("OutputVariables", [])
    outputs = exported_variables(build, wanted, log_link)
    LOG.info("%s succeeded: %s", build_id, outputs)
    return {"IsComplete": True, "Data": {"BuildId": build_id, "LogLink": log_link, **outputs}}


def exported_variables(
    build: Mapping[str, Any], wanted: Sequence[str], log_link: str
) -> dict[str, str]:
    """Pick the requested exported variables; a missing or empty one fails the deploy."""
    exported = {
        str(item["name"]): str(item.get("value", ""))
        for item in build.get("exportedEnvironmentVariables", [])
    }
    missing = [name for name in wanted if not exported.get(name)]
    if missing:
        raise BuildFailedError(
            f"CodeBuild build {build['id']} succeeded but did not export {missing}; "
            f"build log: {log_link}"
        )
    return {name: exported[name] for name in wanted}
