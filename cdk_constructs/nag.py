"""cdk-nag acknowledgments, kept beside the resource they excuse (cdk-nag 3 API)."""

from __future__ import annotations

from typing import Any

from aws_cdk import Acknowledgment, Stack, Validations
from constructs import IConstruct

PACK = "AwsSolutions"


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one finding (`AwsSolutions-IAM5[Resource::...]`) on `scope` and below."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"{PACK}::{rule}", reason=reason))


def nag_resource(stack: Stack, value: str) -> str:
    """How cdk-nag spells a resource in a finding id: intrinsics as `<AWS::Region>`, ..."""

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
        raise ValueError(f"cannot spell {part!r} as cdk-nag does")

    return render(stack.resolve(value))
