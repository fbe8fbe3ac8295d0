"""cdk-nag acknowledgments, kept beside the resource they excuse (cdk-nag 3 API)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aws_cdk import Acknowledgment, Stack, Validations
from aws_cdk import aws_lambda as lambda_
from aws_cdk import custom_resources as cr
from constructs import IConstruct

PACK = "AwsSolutions"


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one finding (`AwsSolutions-IAM5[Resource::...]`) on `scope` and below."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"{PACK}::{rule}", reason=reason))


def acknowledge_provider_invokes(
    scope: IConstruct, provider: cr.Provider, handlers: Iterable[lambda_.Function], owner: str
) -> None:
    """The `<function ARN>:*` grants of a CDK Provider: grantInvoke covers the versions of
    each named function it invokes (its handlers and its own framework functions)."""
    stack = Stack.of(scope)
    framework = [
        child for child in provider.node.find_all() if isinstance(child, lambda_.CfnFunction)
    ]
    for function in [*(handler.node.default_child for handler in handlers), *framework]:
        assert isinstance(function, lambda_.CfnFunction)
        logical_id = stack.resolve(stack.get_logical_id(function))
        acknowledge(
            scope,
            f"AwsSolutions-IAM5[Resource::<{logical_id}.Arn>:*]",
            "lambda:InvokeFunction on '<function ARN>:*' is how CDK's grantInvoke covers "
            f"the versions of one named function of {owner}; nothing else matches.",
        )


def nag_resource(stack: Stack, value: str) -> str:
    """How cdk-nag spells a resource in a finding id: intrinsics as `<AWS::Region>`, ...,
    an import as its export's name."""

    def render(part: Any) -> str:
        if isinstance(part, str):
            return part
        if isinstance(part, dict) and "Ref" in part:
            return f"<{part['Ref']}>"
        if isinstance(part, dict) and "Fn::Join" in part:
            separator, parts = part["Fn::Join"]
            return str(separator).join(render(p) for p in parts)
        if isinstance(part, dict) and "Fn::GetAtt" in part:
            return "<{}.{}>".format(*part["Fn::GetAtt"])
        if isinstance(part, dict) and "Fn::ImportValue" in part:
            return render(part["Fn::ImportValue"])  # the export's name, as written
        raise ValueError(f"cannot spell {part!r} as cdk-nag does")

    return render(stack.resolve(value))
