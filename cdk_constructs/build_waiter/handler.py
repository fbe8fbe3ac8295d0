"""Run a CodeBuild build at deploy time and report its result to CloudFormation.

Used by the CDK Provider framework (the cdklabs/deploy-time-build pattern): `on_event`
starts the build and returns at once; the framework then calls `is_complete` every
query interval until the build ends. A successful build's exported variables become the
custom resource's attributes (e.g. `IMAGE_URI`); a failed one fails the deploy with a
link to the build log. Deleting the resource deletes nothing: builds are not resources.

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
    build = (client or _codebuild()).start_build(projectName=project)["build"]
    LOG.info("started %s for %s", build["id"], event["RequestType"])
    return {"PhysicalResourceId": project, "Data": {"BuildId": build["id"]}}


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
