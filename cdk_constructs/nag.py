"""cdk-nag acknowledgments, kept beside the resource they excuse (cdk-nag 3 API)."""

from __future__ import annotations

from aws_cdk import Acknowledgment, Validations
from constructs import IConstruct

PACK = "AwsSolutions"


def acknowledge(scope: IConstruct, rule: str, reason: str) -> None:
    """Acknowledge one finding (`AwsSolutions-IAM5[Resource::...]`) on `scope` and below."""
    Validations.of(scope).acknowledge(Acknowledgment(id=f"{PACK}::{rule}", reason=reason))
