"""The checks construct props run in `__post_init__`: a bad value fails synth, naming the field."""

from __future__ import annotations

import re

# `repo@sha256:<64 hex>`: the only image reference accepted anywhere (a tag can move).
_DIGEST_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class PropsError(ValueError):
    """A construct prop is invalid; the message names the field."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise PropsError(message)


def require_digest_image(uri: str, what: str) -> str:
    """Reject anything but `repo@sha256:<64 hex>`: a tag can be re-pointed, a digest cannot."""
    require(
        bool(_DIGEST_IMAGE.fullmatch(uri)),
        f"{what}: {uri!r} is not digest-pinned; use 'repository@sha256:<64 lowercase hex>'",
    )
    return uri


def require_digest(value: str, what: str) -> str:
    """Reject anything but a manifest digest, `sha256:<64 lowercase hex>`."""
    require(
        bool(_DIGEST.fullmatch(value)),
        f"{what}: {value!r} is not a digest; use 'sha256:<64 lowercase hex>'",
    )
    return value


def require_instance_type(value: str, what: str) -> None:
    require(
        bool(_INSTANCE_TYPE.fullmatch(value)),
        f"{what}: {value!r} is not a SageMaker instance type (ml.<family>.<size>)",
    )


# Documentation examples and filler: ids no real account has. Refused where a real one is
# required (`looks_like_placeholder`), so a deploy never targets them.
_PLACEHOLDER_ACCOUNTS = {"123456789012", "210987654321", "012345678901"}
_SEQUENCES = ("0123456789abcdef" * 3, "fedcba9876543210" * 3, "0123456789" * 3)


def looks_like_placeholder(value: str) -> bool:
    """An account id or the hex part of a resource id that is a known placeholder: one
    repeated character (111111111111, subnet-00000000), a run of the sequence 0123..., its
    reverse, or a documented example account."""
    if value in _PLACEHOLDER_ACCOUNTS or len(set(value)) <= 1:
        return True
    return any(value in sequence for sequence in _SEQUENCES)
