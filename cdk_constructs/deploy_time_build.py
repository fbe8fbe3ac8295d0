"""Run a CodeBuild project during `cdk deploy` and wait for it (cdklabs/deploy-time-build).

A custom resource backed by the CDK Provider framework: `on_event` starts the build,
`is_complete` polls it every 30 s. A build waits at most 5 minutes in CodeBuild's queue
(`QUEUED_TIMEOUT`) and runs at most 40 (`MAX_BUILD_TIMEOUT`), so it always ends before the
framework's 50-minute total timeout, itself inside CloudFormation's one-hour custom-resource
limit; a failed build fails the deploy with its log link as the reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from aws_cdk import CustomResource, Duration, RemovalPolicy, Stack
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import custom_resources as cr
from constructs import Construct

from cdk_constructs.deploy_roles import allow_logging, machinery_logs
from cdk_constructs.nag import acknowledge, acknowledge_provider_invokes

HANDLER_DIR = Path(__file__).parent / "build_waiter"
POLL_INTERVAL = Duration.seconds(30)
TOTAL_TIMEOUT = Duration.minutes(50)
# Builds must end before the waiter gives up, so the deploy reports the build's own result:
# queued (build_project.QUEUED_TIMEOUT, 5 min) + build (40 min) + one poll < 50 min.
MAX_BUILD_TIMEOUT = Duration.minutes(40)
RESOURCE_TYPE = "Custom::DeployTimeBuild"


class BuildWaiter(Construct):
    """One per stack: the handler Lambdas and the Provider framework that polls them."""

    SINGLETON_ID = "DeployTimeBuildWaiter"

    @classmethod
    def of(cls, scope: Construct, log_key: kms.IKey) -> BuildWaiter:
        stack = Stack.of(scope)
        existing = stack.node.try_find_child(cls.SINGLETON_ID)
        if isinstance(existing, BuildWaiter):
            return existing
        return cls(stack, cls.SINGLETON_ID, log_key=log_key)

    def __init__(self, scope: Construct, construct_id: str, *, log_key: kms.IKey) -> None:
        super().__init__(scope, construct_id)
        log_group = machinery_logs(self, log_key)
        self.role = iam.Role(
            self,
            "HandlerRole",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="Starts and polls deploy-time CodeBuild builds",
        )
        code = lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"])
        handlers = {
            name: lambda_.Function(
                self,
                name,
                runtime=lambda_.Runtime.PYTHON_3_14,
                handler=f"handler.{entry}",
                code=code,
                role=self.role,
                log_group=log_group,
                timeout=Duration.seconds(30),
                memory_size=256,
            )
            for name, entry in (("OnEvent", "on_event"), ("IsComplete", "is_complete"))
        }
        framework_roles = [
            iam.Role(
                self,
                f"Framework{name}Role",
                assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
                description=f"CDK Provider framework {name} functions",
            )
            for name in ("OnEvent", "Waiter")
        ]
        allow_logging((self.role, *framework_roles), log_group)
        self.provider = cr.Provider(
            self,
            "Provider",
            on_event_handler=handlers["OnEvent"],
            is_complete_handler=handlers["IsComplete"],
            query_interval=POLL_INTERVAL,
            total_timeout=TOTAL_TIMEOUT,
            log_group=log_group,
            framework_on_event_role=framework_roles[0],
            framework_complete_and_timeout_role=framework_roles[1],
            disable_waiter_state_machine_logging=False,
            waiter_state_machine_log_options=cr.LogOptions(
                destination=logs.LogGroup(
                    self,
                    "WaiterLogs",
                    retention=logs.RetentionDays.ONE_MONTH,
                    encryption_key=log_key,
                    removal_policy=RemovalPolicy.DESTROY,
                ),
                level=sfn.LogLevel.ALL,
                include_execution_data=False,
            ),
        )
        self._acknowledge_framework(handlers.values())

    def _acknowledge_framework(self, handlers: Iterable[lambda_.Function]) -> None:
        """Findings on the resources the CDK Provider framework creates for itself."""
        acknowledge_provider_invokes(self, self.provider, handlers, "this waiter")
        acknowledge(
            self.provider,
            "AwsSolutions-IAM5[Resource::*]",
            "The waiter state machine's log delivery actions (logs:CreateLogDelivery, "
            "logs:DescribeResourcePolicies, ...) do not support resource-level permissions.",
        )
        acknowledge(
            self.provider,
            "AwsSolutions-SF2",
            "The CDK Provider framework's waiter state machine offers no X-Ray setting; "
            "its executions are logged to WaiterLogs and the handlers log every build.",
        )

    @property
    def service_token(self) -> str:
        return self.provider.service_token

    def allow_project(self, project: codebuild.IProject) -> None:
        """Let the handlers start and read builds of exactly this project."""
        self.role.add_to_policy(
            iam.PolicyStatement(
                actions=[
                    "codebuild:StartBuild",
                    "codebuild:BatchGetBuilds",
                    "codebuild:ListBuildsForProject",
                ],
                resources=[project.project_arn],
            )
        )


class DeployTimeBuild(Construct):
    """Start `project` at deploy time; expose the build's exported variables as attributes.

    `trigger` must change exactly when the build inputs change (a hash): CloudFormation then
    updates the resource and a new build runs; otherwise no build runs on deploy.
    """

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        project: codebuild.IProject,
        trigger: str,
        log_key: kms.IKey,
        output_variables: Sequence[str] = (),
    ) -> None:
        super().__init__(scope, construct_id)
        waiter = BuildWaiter.of(self, log_key)
        waiter.allow_project(project)
        self._outputs = tuple(output_variables)
        self.resource = CustomResource(
            self,
            "Resource",
            service_token=waiter.service_token,
            resource_type=RESOURCE_TYPE,
            properties={
                "ProjectName": project.project_name,
                "Trigger": trigger,
                "OutputVariables": list(self._outputs),
            },
        )
        # Its permissions (the waiter role's policy) must exist before the build starts.
        self.resource.node.add_dependency(waiter)

    @property
    def build_id(self) -> str:
        return self.resource.get_att_string("BuildId")

    def output(self, name: str) -> str:
        """A variable the build exported; only names declared in `output_variables`."""
        if name not in self._outputs:
            raise ValueError(f"{name!r} is not one of the declared outputs {self._outputs}")
        return self.resource.get_att_string(name)
