"""A post-deploy check: one real invocation of the endpoint, or the deploy fails and rolls back.

A custom resource (`Custom::EndpointCheck`, CDK Provider framework, `on_event` only) that
depends on the endpoint, so it runs once the endpoint is InService, and again whenever the
endpoint's config or image changes (its properties name them). The handler
(`endpoint_probe/handler.py`) sends the request body it is given (the stacks pass the same
files `semif check` sends, `client/examples/check-*.json`) and checks the answer as the
probe kind asks. An endpoint whose model is an inference component is invoked through it
(`InferenceComponentName`), and checked again whenever the component's model changes: a
new image or model changes the component, not the endpoint config.

The decision check then waits up to `SERIES_WAIT` for the endpoint's container series to
reach CloudWatch, and warns in its result (never fails) when they do not: PromQL alarms
that match no series stay OK forever. It is given the names of the PromQL alarms of its
stack that select this endpoint, found at synth time, so the warning can name them.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsii
from aws_cdk import (
    ArnFormat,
    Aspects,
    Aws,
    CfnResource,
    CustomResource,
    Duration,
    IAspect,
    Stack,
)
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import custom_resources as cr
from constructs import Construct, IConstruct

from cdk_constructs.deploy_roles import allow_logging, machinery_logs
from cdk_constructs.endpoint_operations import ENDPOINT_LABEL
from cdk_constructs.nag import acknowledge, acknowledge_provider_invokes
from cdk_constructs.sagemaker_endpoint import SageMakerEndpoint

HANDLER_DIR = Path(__file__).parent / "endpoint_probe"
RESOURCE_TYPE = "Custom::EndpointCheck"
# The probe's retries, then the wait for the container series, inside one invocation.
HANDLER_TIMEOUT = Duration.minutes(10)
# Three publish periods at the default 60 s (Observability), once the first call answered.
SERIES_WAIT = Duration.minutes(3)


class Probe(enum.Enum):
    """What the check sends (the handler's PROBES)."""

    DECISION = "decision"
    CHAT = "chat"


@jsii.implements(IAspect)
class _NamePromQLAlarms:
    """Before synthesis, when every alarm of the stack exists: give the check the names of
    its stack's PromQL alarms whose query selects `endpoint_name`'s series."""

    def __init__(self, resource: CfnResource, endpoint_name: str) -> None:
        self._resource = resource
        self._selector = f'"{ENDPOINT_LABEL}"="{endpoint_name}"'

    def visit(self, node: IConstruct) -> None:
        if node.node.path != self._resource.node.path:
            return
        names = []
        for alarm in Stack.of(node).node.find_all():
            if not isinstance(alarm, cloudwatch.CfnAlarm):
                continue
            criteria = alarm.evaluation_criteria
            promql = getattr(criteria, "prom_ql_criteria", None)
            if self._selector in str(getattr(promql, "query", "")):
                names.append(alarm.ref)
        self._resource.add_property_override("PromQLAlarms", names)


class EndpointCheck(Construct):
    """Invoke `endpoint` once after each deploy that changes it; a wrong answer fails it."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        endpoint: SageMakerEndpoint,
        probe: Probe,
        body: Mapping[str, Any],
        log_key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        stack = Stack.of(self)
        log_group = machinery_logs(self, log_key)
        role = iam.Role(
            self,
            "HandlerRole",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description=f"Invokes {endpoint.endpoint_name} once after a deploy",
        )
        component = endpoint.inference_component_name
        invoked = [("endpoint", endpoint.endpoint_name)]
        if component is not None:
            invoked.append(("inference-component", component))
        role.add_to_policy(
            iam.PolicyStatement(
                actions=["sagemaker:InvokeEndpoint"],
                resources=[
                    stack.format_arn(
                        service="sagemaker",
                        resource=kind,
                        # SageMaker ARNs carry the name in lower case.
                        resource_name=name.lower(),
                        arn_format=ArnFormat.SLASH_RESOURCE_NAME,
                    )
                    for kind, name in invoked
                ],
            )
        )
        role.add_to_policy(
            iam.PolicyStatement(actions=["cloudformation:DescribeStacks"], resources=[Aws.STACK_ID])
        )
        series: dict[str, Any] = {}
        if probe is Probe.DECISION:
            # GetSeries (CloudWatch's PromQL API) is authorized as ListMetrics.
            role.add_to_policy(
                iam.PolicyStatement(actions=["cloudwatch:ListMetrics"], resources=["*"])
            )
            acknowledge(
                role,
                "AwsSolutions-IAM5[Resource::*]",
                "cloudwatch:ListMetrics (what CloudWatch's PromQL GetSeries asks) has no "
                "resource-level permissions; it reads metric names and labels only.",
            )
            series = {"SeriesWaitSeconds": SERIES_WAIT.to_seconds()}
        framework_role = iam.Role(
            self,
            "FrameworkRole",
            assumed_by=iam.ServicePrincipal("lambda.amazonaws.com"),
            description="CDK Provider framework function of the endpoint check",
        )
        allow_logging((role, framework_role), log_group)
        handler = lambda_.Function(
            self,
            "Handler",
            runtime=lambda_.Runtime.PYTHON_3_14,
            handler="handler.on_event",
            code=lambda_.Code.from_asset(str(HANDLER_DIR), exclude=["__pycache__", "*.pyc"]),
            role=role,
            log_group=log_group,
            timeout=HANDLER_TIMEOUT,
            memory_size=256,
        )
        provider = cr.Provider(
            self,
            "Provider",
            on_event_handler=handler,
            log_group=log_group,
            framework_on_event_role=framework_role,
        )
        acknowledge_provider_invokes(self, provider, [handler], "this check")
        self.resource = CustomResource(
            self,
            "Resource",
            service_token=provider.service_token,
            resource_type=RESOURCE_TYPE,
            properties={
                "EndpointName": endpoint.endpoint_name,
                "Probe": probe.value,
                "Body": json.dumps(body, separators=(",", ":")),
                # A new config (image, model, settings) is a new name: the check runs again.
                "EndpointConfigName": endpoint.endpoint_config.attr_endpoint_config_name,
                **series,
                **_component_properties(endpoint),
            },
        )
        self.resource.node.add_dependency(endpoint.endpoint)
        if endpoint.inference_component is not None:
            self.resource.node.add_dependency(endpoint.inference_component)
        if probe is Probe.DECISION:
            resource = self.resource.node.default_child
            assert isinstance(resource, CfnResource)
            Aspects.of(resource).add(_NamePromQLAlarms(resource, endpoint.endpoint_name))
        self.resource.node.add_dependency(role)

    @property
    def result(self) -> str:
        return self.resource.get_att_string("Result")


def _component_properties(endpoint: SageMakerEndpoint) -> dict[str, str]:
    """The component to invoke through, and its model: a new model (image, artifact,
    settings) is a new name, so the check runs again after the component's update."""
    component = endpoint.inference_component_name
    if component is None:
        return {}
    return {"InferenceComponentName": component, "ModelName": endpoint.model.attr_model_name}
